"""Issue 22's CPU measurements of speculative decoding, on the default model (SmolLM2-135M), in one run.

    python tools/bench_spec.py --out DIR [--tokens 128] [--threads 2]

1. Forced drafts (the engine, `Engine.build` on the CPU as the daemon builds it): a greedy
   run without drafts is replayed with 4 drafts per step taken from it, all right (100%),
   every other one wrong at its second draft (about 50%: one accepted), or all wrong (0%). Per
   case: the median step time over `--rounds` interleaved rounds, tokens per step, ms per token.
   A verify step's cost over a plain step (the all-wrong case: 5 tokens, one kept) gives the cost
   model's r (engine/speculation.py): c(4) = (1 + 5r) / (1 + r) at batch 1.
2. Served (the daemon through HTTP, streamed greedy chat completions at batch 1): an
   input-grounded prompt (repeat a text shipped with Python, the Zen of Python, with one change)
   and a free-writing prompt, with `--speculative 4` (n-gram, adaptive) and without, daemons
   alternating for `--rounds` rounds: the median decode tok/s (tokens after the first over the
   time after the first), and the request's drafted and accepted counts from /metrics.

Writes DIR/bench_spec.json and DIR/bench_spec.md.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import io
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radianced.bench.client import chat_body, stream_request  # noqa: E402
from radianced.bench.daemon_process import ChildDaemon  # noqa: E402
from radianced.card import Card  # noqa: E402
from radianced.config import Config  # noqa: E402
from radianced.engine.drafting import DraftPlanner  # noqa: E402
from radianced.engine.engine import Engine  # noqa: E402
from radianced.engine.request import Request  # noqa: E402
from radianced.engine.sampling_params import SamplingParams  # noqa: E402
from radianced.engine.speculation import DraftPolicy  # noqa: E402
from radianced.model.default import ensure_default_model  # noqa: E402
from radianced.model.rad import RadFile  # noqa: E402
from radianced.model.tokenizer import Tokenizer  # noqa: E402

DRAFTS = 4


def zen() -> str:
    """The Zen of Python as the `this` module ships it (rot13 in its source; importing it prints it)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


def grounded_prompt() -> str:
    return ("Repeat the following text exactly, but write 'Python' in capital letters:\n\n" + zen())


FREE_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


# -- 1. forced drafts ------------------------------------------------------------


class Replay:
    """A drafter (`DraftPolicy.propose`) replaying a known greedy output: `out[i]` is output token i.
    `wrong`: "none"; "half", every other proposal's second draft changed; "all", every first. A changed
    draft is the next id of the `vocab`, never the right one."""

    def __init__(self, prompt: tuple[int, ...], out: list[int], wrong: str, vocab: int):
        self.prompt, self.out, self.wrong, self.vocab, self.calls = prompt, out, wrong, vocab, 0

    def __call__(self, seq, n):
        done = len(seq.token_ids) - len(self.prompt)
        drafts = list(self.out[done:done + n])
        self.calls += 1
        if drafts and self.wrong == "all":
            drafts[0] = (drafts[0] + 1) % self.vocab
        elif len(drafts) > 1 and self.wrong == "half" and self.calls % 2 == 0:
            drafts[1] = (drafts[1] + 1) % self.vocab
        return tuple(drafts)


def forced(rad: RadFile, prompt: list[int], tokens: int, rounds: int) -> list[dict]:
    """Per case, the median step time over every timed step of `rounds` interleaved rounds (a shared
    machine's bursts land on some steps of some cases, not on one case's whole run)."""
    cfg = Config(max_num_seqs=1, max_model_len=4096)
    engine = Engine.build(rad, cfg, Card.from_mib(4096), "cpu")
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)

    def run(rid: str, policy: DraftPolicy | None) -> tuple[list[int], list[float]]:
        engine.scheduler.drafting = None if policy is None else DraftPlanner(policy, engine.scheduler.allocator)
        engine.add(Request(rid, tuple(prompt), params))
        engine.step()  # the prefill and the first token, not timed
        out, times = [], []
        while engine.scheduler.has_unfinished:
            t0 = time.perf_counter()
            out += [t for ev in engine.step() for t in ev.token_ids]
            times.append(time.perf_counter() - t0)
        return out, times

    run("warm", None)
    base, _ = run("base", None)
    cases = {"no drafts": None, "4 drafts, 100% right": "none", "4 drafts, every other step 1 right": "half",
             "4 drafts, 0% right": "all"}
    times: dict[str, list[float]] = {name: [] for name in cases}
    steps: dict[str, int] = {}
    for r in range(rounds):
        for name, wrong in cases.items():
            replay = Replay(tuple(prompt), [0] + base, wrong, rad.model.vocab_size)  # [0]: the prefill's token
            policy = None if wrong is None else DraftPolicy(DRAFTS, 0.0, adaptive=False, propose=replay)
            out, t = run(f"{name} {r}", policy)
            assert out == base, f"{name}: the replayed run differs from the plain one"
            times[name] += t
            steps[name] = len(t)
    rows = []
    for name in cases:
        step = statistics.median(times[name])
        rows.append({"case": name, "steps": steps[name], "tokens": len(base), "ms_per_step": 1e3 * step,
                     "ms_per_token": 1e3 * step * steps[name] / len(base)})
    return rows


# -- 2. served -----------------------------------------------------------------------


def _spec_counts(metrics: str) -> tuple[float, float]:
    found = dict(re.findall(r"^(radiance_spec_(?:draft|accepted)_tokens_total) (\S+)$", metrics, re.M))
    return (float(found.get("radiance_spec_draft_tokens_total", 0)),
            float(found.get("radiance_spec_accepted_tokens_total", 0)))


async def _prompts(url: str, prompts: dict[str, str], tokens: int, concurrency: int = 1) -> dict[str, dict]:
    """Each prompt `concurrency` times at once, after a warm-up request: decode tok/s (tokens after each
    request's first over the time from the first request's first token to the last request's end: at c = 1 the
    request's own), TTFT (the median request's), and the requests' drafted and accepted counts (the /metrics
    delta)."""
    out = {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await stream_request(http, "/v1/chat/completions", chat_body([{"role": "user", "content": "Hi"}], 8))
        for name, prompt in prompts.items():
            before = _spec_counts((await http.get("/metrics")).text)
            body = chat_body([{"role": "user", "content": prompt}], tokens)
            t0 = time.perf_counter()
            got = await asyncio.gather(*(stream_request(http, "/v1/chat/completions", body)
                                         for _ in range(concurrency)))
            after = _spec_counts((await http.get("/metrics")).text)
            assert all(s.ok for s in got), [s.error for s in got if not s.ok]
            first = min(s.ttft_s for s in got)
            decode_s = max(s.e2e_s for s in got) - first
            decoded = sum(s.tokens_received - 1 for s in got)
            out[name] = {"tokens": sum(s.tokens_received for s in got), "concurrency": concurrency,
                         "ttft_ms": 1e3 * statistics.median(s.ttft_s for s in got),
                         "decode_tok_s": decoded / decode_s if decode_s > 0 else 0.0,
                         "drafted": after[0] - before[0], "accepted": after[1] - before[1],
                         "text_head": "".join(got[0].pieces)[:120], "wall_s": time.perf_counter() - t0}
    return out


def served(model: Path, tokens: int, rounds: int, concurrency: int = 1) -> list[dict]:
    """Both prompts through a daemon without and with --speculative 4 (`concurrency` requests of each at
    once), `rounds` times alternating; the median of each (prompt, speculative) over the rounds."""
    prompts = {"input-grounded": grounded_prompt(), "free writing": FREE_PROMPT}
    runs: dict[tuple[str, int], list[dict]] = {}
    for _ in range(rounds):
        for spec in (0, DRAFTS):
            daemon = ChildDaemon.start(["--model", str(model), "--speculative", str(spec)])
            try:
                for name, row in asyncio.run(_prompts(daemon.url, prompts, tokens, concurrency)).items():
                    runs.setdefault((name, spec), []).append(row)
            finally:
                daemon.stop()
    rows = []
    for (name, spec), got in runs.items():
        mid = sorted(got, key=lambda r: r["decode_tok_s"])[len(got) // 2]
        rows.append({"prompt": name, "speculative": spec, **mid,
                     "decode_tok_s_all": [r["decode_tok_s"] for r in got]})
    return rows


def markdown(result: dict) -> str:
    lines = [f"# Speculative decoding on the CPU ({result['machine']}, {result['date']}, {result['threads']} threads)",
             "", "## Forced drafts (engine, batch 1, greedy)", "",
             "| case | steps | tokens | ms/step | ms/token | step vs plain |", "|---|---|---|---|---|---|"]
    plain = result["forced"][0]["ms_per_step"]
    for r in result["forced"]:
        lines.append(f"| {r['case']} | {r['steps']} | {r['tokens']} | {r['ms_per_step']:.1f} | "
                     f"{r['ms_per_token']:.1f} | {r['ms_per_step'] / plain:.2f}x |")
    lines += ["", f"Cost model: a 5-token step costs c = {result['verify_cost']:.2f} plain steps, so r = "
              f"{result['r']:.2f} (c = (1 + 5r) / (1 + r)).", "",
              f"## Served (HTTP, chat, greedy, {result.get('concurrency', 1)} request(s) of each prompt at once)", "",
              "| prompt | --speculative | tokens | TTFT ms | decode tok/s | accepted / drafted | vs off |",
              "|---|---|---|---|---|---|---|"]
    off = {r["prompt"]: r["decode_tok_s"] for r in result["served"] if r["speculative"] == 0}
    for r in result["served"]:
        acc = f"{r['accepted']:.0f} / {r['drafted']:.0f}" if r["speculative"] else "-"
        lines.append(f"| {r['prompt']} | {r['speculative']} | {r['tokens']} | {r['ttft_ms']:.0f} | "
                     f"{r['decode_tok_s']:.1f} | {acc} | {r['decode_tok_s'] / off[r['prompt']]:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repeats; medians are reported")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="served: this many requests of each prompt at once (aggregate decode tok/s): does the "
                         "adaptive policy draft less as the batch grows, and lose nothing where drafts do not pay?")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["RADIANCED_CPU_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    model = ensure_default_model()
    rad = RadFile.open(model)
    tok = Tokenizer.from_header(rad.header)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": grounded_prompt()}],
                                                add_generation_prompt=True))
    rows = forced(rad, prompt, args.tokens, args.rounds)
    c = rows[-1]["ms_per_step"] / rows[0]["ms_per_step"]  # all wrong: the verify step's cost, one token
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} cores",
              "threads": args.threads, "forced": rows, "verify_cost": c, "r": (c - 1) / (5 - c),
              "concurrency": args.concurrency, "served": served(model, args.tokens, args.rounds, args.concurrency)}
    (args.out / "bench_spec.json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    (args.out / "bench_spec.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
