"""`radianced` (alias `radiance`): one-shot greedy chat on the CPU.

Until the daemon lands this loads a `.rad` (default: the bundled SmolLM2,
prepared on first run), renders one user message through the model's chat
template, and prints the greedy answer.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from radianced.engine.greedy import greedy_generate
from radianced.model.batch import KVCache
from radianced.model.default import ensure_default_model
from radianced.model.loader import load_model
from radianced.model.rad import RadError, RadFile
from radianced.model.tokenizer import Tokenizer

DEFAULT_QUESTION = "What is the capital of France?"
BLOCK_SIZE = 16


def answer(rad: RadFile, question: str, max_tokens: int) -> tuple[str, int]:
    """Greedy chat answer to one user message; returns (text, tokens generated)."""
    tok = Tokenizer.from_header(rad.header)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]))
    model = load_model(rad)
    blocks = -(-(len(prompt) + max_tokens) // BLOCK_SIZE)
    cache = KVCache.allocate(rad.model, blocks, BLOCK_SIZE, num_state_slots=1, dtype=model.embed.weight.dtype)
    out = greedy_generate(model, cache, [prompt], max_tokens, stop_ids=tok.eos_token_ids).tokens[0]
    return tok.decode(out), len(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radianced", description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="the .rad to serve (default: bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--prompt", default=DEFAULT_QUESTION, help="the user message to answer")
    ap.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    args = ap.parse_args(argv)
    if args.max_tokens < 1:
        ap.error("--max-tokens must be at least 1")
    path = args.model or ensure_default_model()
    try:
        with RadFile.open(path) as rad:
            t0 = time.perf_counter()
            text, n = answer(rad, args.prompt, args.max_tokens)
    except (RadError, FileNotFoundError) as e:
        print(f"radianced: {e}", file=sys.stderr)
        return 1
    dt = time.perf_counter() - t0
    print(f"> {args.prompt}\n{text}")
    print(f"({n} tokens in {dt:.2f} s on {torch.get_num_threads()} CPU threads, model {path})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
