"""Write a tiny random Hugging Face checkpoint (weights, config, tokenizer) for tests.

    python tools/make_tiny.py qwen3_next /tmp/tiny --seed 1 \
        --layer-types full_attention linear_attention linear_attention
    python tools/make_tiny.py qwen3_moe /tmp/tiny --set attention_bias=true --set num_hidden_layers=2

The work is done by `radianced.model.tiny.make_tiny`; this is its command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from radianced.model.tiny import FAMILIES, make_tiny  # noqa: E402


def _override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set wants KEY=VALUE (VALUE as JSON), got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare string


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--layer-types", nargs="+", choices=("linear_attention", "full_attention"), metavar="TYPE",
        help="qwen3_next only: one of linear_attention / full_attention per layer (sets the layer count)",
    )
    parser.add_argument("--set", type=_override, action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, VALUE parsed as JSON (repeatable)")
    args = parser.parse_args(argv)
    overrides = dict(args.set)
    if args.layer_types:
        if args.family != "qwen3_next":
            parser.error("--layer-types applies to qwen3_next only")
        overrides["layer_types"] = args.layer_types
    out = make_tiny(args.family, args.out_dir, seed=args.seed, **overrides)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
