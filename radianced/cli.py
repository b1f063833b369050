"""`radianced` (alias `radiance`): the daemon. Flags -> Config -> `daemon.main`; no logic here.

With no --model it serves the bundled SmolLM2-135M-Instruct (prepared on first
run). `radianced --help` lists every flag; `radiancectl plan` prints the card
split the same flags would give.
"""

from __future__ import annotations

import argparse
import sys

from radianced.config import Config, ConfigError, add_flags

ONE_SHOT_BLOCK_SIZE = 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radianced", description=__doc__.splitlines()[0])
    add_flags(parser)
    args = parser.parse_args(argv)
    try:
        cfg = Config.from_args(args)
    except ConfigError as e:
        parser.error(str(e))  # exits 2 with the usage line
    from radianced.daemon import main as run_daemon  # after parsing: --help needs no torch

    return run_daemon(cfg)


def answer(rad, question: str, max_tokens: int) -> tuple[str, int]:
    """Greedy chat answer to one user message without the daemon; returns (text, tokens generated).

    The old one-shot path, kept for tests/model/test_smollm2.py; the daemon serves requests.
    """
    from radianced.engine.greedy import greedy_generate
    from radianced.model.batch import KVCache
    from radianced.model.loader import load_model
    from radianced.model.tokenizer import Tokenizer

    tok = Tokenizer.from_header(rad.header)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]))
    model = load_model(rad)
    blocks = -(-(len(prompt) + max_tokens) // ONE_SHOT_BLOCK_SIZE)
    cache = KVCache.allocate(rad.model, blocks, ONE_SHOT_BLOCK_SIZE, num_state_slots=1, dtype=model.embed.weight.dtype)
    out = greedy_generate(model, cache, [prompt], max_tokens, stop_ids=tok.eos_token_ids).tokens[0]
    return tok.decode(out), len(out)


if __name__ == "__main__":
    sys.exit(main())
