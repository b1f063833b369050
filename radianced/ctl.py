"""radiancectl: offline and control commands, one function per subcommand.

Each subcommand is a `Command` in COMMANDS: a name, a help line, a function
that adds its arguments and a function that runs it and returns the exit
status. Add a subcommand by appending one. Expected failures (bad input, a bad
file) print one message on stderr and exit non-zero; never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Callable

from radianced.model.config import UnsupportedModel


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# -- convert --------------------------------------------------------------------


def _convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a Hugging Face model folder (config.json, *.safetensors, tokenizer.json) "
                               "or a .gguf file")
    p.add_argument("dst", help="the .rad file to write (replaced only when the conversion finishes)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="cast every tensor to this dtype (default: keep the source dtypes)")


def _convert(args: argparse.Namespace) -> int:
    from radianced.model.convert import convert
    from radianced.model.rad import RadFile

    start = time.monotonic()
    convert(args.src, args.dst, args.dtype)
    with RadFile.open(args.dst) as rad:
        summary = _summary(rad)
    print(f"{args.dst}: {summary}, converted in {time.monotonic() - start:.1f} s")
    return 0


# -- verify ---------------------------------------------------------------------


def _verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="the .rad file to check")


def _verify(args: argparse.Namespace) -> int:
    from radianced.model.rad import RadFile

    start = time.monotonic()
    with RadFile.open(args.file) as rad:
        rad.verify()
        summary = _summary(rad)
    print(f"{args.file}: OK: {summary}, every checksum verified in {time.monotonic() - start:.1f} s")
    return 0


# -- plan -----------------------------------------------------------------------


def _plan_args(p: argparse.ArgumentParser) -> None:
    from radianced.config import add_flags

    add_flags(p)


def _plan(args: argparse.Namespace) -> int:
    """The start-up receipt for a model and a card, without loading weights."""
    import torch

    from radianced.arena import detect_card
    from radianced.budget import Card, ModelFacts, plan
    from radianced.config import Config
    from radianced.model.default import ensure_default_model
    from radianced.model.rad import RadFile

    cfg = Config.from_args(args)
    with RadFile.open(cfg.model or ensure_default_model()) as rad:
        facts = ModelFacts.from_header(rad.header)
    card = Card.from_mib(cfg.card_mib) if cfg.card_mib else detect_card("cuda" if torch.cuda.is_available() else "cpu")
    print("\n".join(plan(card, facts, cfg).lines()))
    return 0


def _summary(rad) -> str:
    h = rad.header
    m = rad.model
    total = sum(t.nbytes for t in h.tensors) + sum(e.nbytes for e in h.experts)
    synthetic = " (synthetic weights)" if h.synthetic else ""
    return (f"{m.family}{synthetic}, {m.num_hidden_layers} layers, {len(h.tensors)} tensors, "
            f"{len(h.experts)} expert extents, {total / 2**20:.1f} MiB")


COMMANDS: list[Command] = [
    Command("convert", "convert a Hugging Face folder or a .gguf file to .rad", _convert_args, _convert),
    Command("verify", "check a .rad file: header, extents and every checksum", _verify_args, _verify),
    Command("plan", "print the start-up receipt (the card split) for a model and a card", _plan_args, _plan),
]


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input, reported as one line; anything else is a bug and keeps its traceback."""
    from radianced.budget import PlanError
    from radianced.config import ConfigError
    from radianced.model.convert import ConvertError
    from radianced.model.rad import RadError

    return (RadError, ConvertError, UnsupportedModel, OSError, ConfigError, PlanError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radiancectl", description="radianced's offline and control commands")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except _user_errors() as e:
        print(f"radiancectl {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"radiancectl {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
