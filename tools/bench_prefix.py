"""Second-turn TTFT with a long history vs a cold prefill (prefix cache), SmolLM2 on the CPU.

    .venv/bin/python tools/bench_prefix.py [--history 2000] [--out bench/results]

Builds the engine the daemon builds (Engine.build: receipt, arena, prefix
cache), serves turn 1 of a conversation whose first user message makes a
history of about --history tokens, then turn 2 (the real chat template over
turn 1 + the reply + a new question). Cold: the same turn-2 prompt on a fresh
engine. Reports time to first token of each and the ratio; writes JSON and
Markdown named by date and commit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import time
from datetime import date
from pathlib import Path

import torch

from radianced.card import Card
from radianced.config import Config
from radianced.engine.driver import AsyncEngine
from radianced.engine.engine import Engine
from radianced.engine.sampling_params import SamplingParams
from radianced.model.default import ensure_default_model
from radianced.model.rad import RadFile

TOPIC = ("The lighthouse keeper kept a log of every ship, every storm and every quiet night on the rock. "
         "He wrote about the colour of the sea at dawn, the birds that nested on the ledges, and the supply "
         "boat that came on Thursdays when the weather allowed. ")


async def ttft(ae: AsyncEngine, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """(seconds to first token, generated ids, prompt tokens reused)."""
    start = time.perf_counter()
    first, ids = None, []
    stream = ae.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    async for chunk in stream:
        first = first or time.perf_counter()
        ids.extend(chunk.token_ids)
    return first - start, ids, chunk.reused_tokens


def build(rad: RadFile) -> Engine:
    cfg = Config(max_model_len=4096, max_num_seqs=2, max_num_batched_tokens=4096)
    return Engine.build(rad, cfg, Card.from_mib(4096))


async def main_async(history: int) -> dict:
    rad = RadFile.open(ensure_default_model())
    warm_engine = AsyncEngine(build(rad))
    task = asyncio.create_task(warm_engine.run())
    tok = warm_engine.tokenizer
    text = TOPIC * max(1, history // len(tok.encode(TOPIC)))
    turn1 = [{"role": "user", "content": text + "\nSummarise the log in one sentence."}]
    p1 = tok.encode(tok.apply_chat_template(turn1))
    t1, reply, _ = await ttft(warm_engine, p1, 32)
    turn2 = turn1 + [{"role": "assistant", "content": tok.decode(reply)},
                     {"role": "user", "content": "Which day did the boat come?"}]
    p2 = tok.encode(tok.apply_chat_template(turn2))
    warm, warm_ids, reused = await ttft(warm_engine, p2, 16)
    task.cancel()
    cold_engine = AsyncEngine(build(rad))
    task = asyncio.create_task(cold_engine.run())
    cold, cold_ids, _ = await ttft(cold_engine, p2, 16)
    task.cancel()
    return {"history_tokens": len(p1), "turn2_prompt_tokens": len(p2), "turn1_ttft_s": t1, "warm_ttft_s": warm,
            "cold_ttft_s": cold, "speedup": cold / warm, "same_tokens": warm_ids == cold_ids,
            "warm_reused_tokens": reused}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    result = asyncio.run(main_async(args.history))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result.update(date=str(date.today()), commit=commit, device=f"CPU {platform.processor() or platform.machine()}, "
                  f"{torch.get_num_threads()} torch threads", model="SmolLM2-135M-Instruct (fp32 from Q4_1 GGUF)")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{result['date']}-cpu-prefix-ttft-{commit}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    md = (f"# Second-turn TTFT vs cold ({result['date']}, {result['device']}, commit {commit})\n\n"
          f"| history tokens | turn-2 prompt | reused | cold TTFT | warm TTFT | speedup (target >= 10x) "
          f"| same tokens |\n|---|---|---|---|---|---|---|\n"
          f"| {result['history_tokens']} | {result['turn2_prompt_tokens']} | {result['warm_reused_tokens']} "
          f"| {result['cold_ttft_s'] * 1e3:.0f} ms "
          f"| {result['warm_ttft_s'] * 1e3:.0f} ms | {result['speedup']:.1f}x | {result['same_tokens']} |\n")
    stem.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
