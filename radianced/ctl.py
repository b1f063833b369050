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

from radianced.bench import command as bench
from radianced.model import quality  # imports no torch until it runs
from radianced.model.config import UnsupportedModel
from radianced.status_view import render_status


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
    p.add_argument("--compact", action="store_true",
                   help="keep a GGUF's quantized blocks (on a GPU: Q8_0, Q4_0, Q4_1; K-quants on the CPU only)")
    p.add_argument("--quantize", metavar="CLASS=SCHEME,...", help="e.g. experts=int4,layers=fp8 (model/quantize.py)")


def _convert(args: argparse.Namespace) -> int:
    from radianced.model.convert import convert
    from radianced.model.rad import RadFile

    start = time.monotonic()
    convert(args.src, args.dst, args.dtype, compact=args.compact, quantize=args.quantize)
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
    from radianced.tiers.predict import gbps, resident_step

    add_flags(p)
    p.add_argument("--pcie-gbps", type=gbps, metavar="GB/S", default=None,
                   help="host -> card link rate for the predicted tok/s (default: probed on CUDA)")
    p.add_argument("--hbm-gbps", type=gbps, metavar="GB/S", default=None,
                   help="card memory rate: adds the card's reads to the predicted tok/s")
    p.add_argument("--resident-step-ms", type=resident_step, metavar="B=MS", action="append", default=[],
                   help="a decode step of B sequences measured where every expert hits (e.g. TPOT p50 on a card "
                        "that holds them all): predicts tok/s from it, the misses moved to the link (repeatable)")


def _plan(args: argparse.Namespace) -> int:
    """The start-up receipt for a model and a card (with --tp N: each card's, and the total),
    without loading weights."""
    from radianced.budget import plan
    from radianced.config import Config
    from radianced.model.default import ensure_default_model
    from radianced.model.rad import RadFile
    from radianced.sizing import ModelFacts
    from radianced.tiers.predict import plan_lines
    from radianced.tp_plan import detect_cards, plan_cards

    cfg = Config.from_args(args)
    with RadFile.open(cfg.model or ensure_default_model()) as rad:
        facts = ModelFacts.from_header(rad.header)
        cards = detect_cards(cfg)
        if cfg.tp > 1:  # each card's receipt and the total (the predictions are one card's for now)
            print("\n".join(plan_cards(cards, facts, cfg).lines()))
            return 0
        receipt = plan(cards[0], facts, cfg)
        print("\n".join(receipt.lines()))
        for line in plan_lines(rad, receipt, pcie_gbps=args.pcie_gbps, hbm_gbps=args.hbm_gbps,
                               resident_steps=dict(args.resident_step_ms)):
            print(line)
    return 0


# -- profile --------------------------------------------------------------------


def _profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="the .rad file of a MoE model (not with --save)")
    p.add_argument("--prompts", help="a text file with one prompt per line (blank lines skipped)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--out", default=None, help="where to write the profile (default: MODEL.expert-profile.bin, "
                                               "which start-up reads to pre-fill the expert slots); with --save, "
                                               "a path the daemon allows: the model's own profile, or a file under "
                                               "its --profile-dir (a relative path is taken from there)")
    p.add_argument("--save", action="store_true",
                   help="instead of running prompts: have the running daemon add the routing it has counted "
                        "since start to its model's profile (the next start-up ranks the slots by it)")
    p.add_argument("--replace", action="store_true",
                   help="with --save: write only the daemon's counts, dropping those already in the file")
    _control_args(p)


def _profile(args: argparse.Namespace) -> int:
    """Run prompts through the model, count routing per (layer, expert), write the expert profile;
    with --save, have the running daemon write its live counts instead."""
    from radianced.config import ConfigError

    if args.save:
        if args.model or args.prompts:
            raise ConfigError("--save writes the running daemon's counts for the model it serves: "
                              "drop MODEL and --prompts (or drop --save to profile prompts offline)")
        return _profile_save(args)
    if args.replace:
        raise ConfigError("--replace goes with --save (an offline run always writes a new profile)")
    if not args.model or not args.prompts:
        raise ConfigError("give MODEL and --prompts FILE (or --save to save a running daemon's counts)")
    return _profile_prompts(args)


def _profile_prompts(args: argparse.Namespace) -> int:
    from radianced.config import ConfigError
    from radianced.engine.profiling import profile_prompts
    from radianced.model.rad import RadFile
    from radianced.tiers.profile import profile_path

    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens {args.max_tokens}: generate at least one token")
    with open(args.prompts, encoding="utf-8") as f:
        prompts = [line.rstrip("\n") for line in f if line.strip()]
    out = args.out or profile_path(args.model)
    start = time.monotonic()
    with RadFile.open(args.model) as rad:
        profile = profile_prompts(rad, prompts, args.max_tokens)
    profile.save(out)
    print(f"{out}: {len(profile)} ranked pairs from {len(prompts)} prompts, {profile.steps} steps, "
          f"in {time.monotonic() - start:.1f} s")
    return 0


def _profile_save(args: argparse.Namespace) -> int:
    """The daemon writes the file (as its user, on its host) where its rules allow; --out is sent
    as given, resolved by the daemon, not against this process's working directory."""
    from radianced.server.control import ProfileSaveResult

    ctl_args = {"replace": args.replace, "out": args.out}
    code, result = _control(args, "profile_save", ctl_args)
    if code:
        return code
    saved = _shaped(args, result, ProfileSaveResult)
    if saved is None:
        return 1
    how = "added to the counts already there" if saved.merged else "written fresh"
    print(f"{saved.path}: {saved.pairs} ranked pairs ({saved.added} routed assignments {how}; "
          f"{saved.steps} steps); the next start-up fills the expert slots in this order")
    if saved.note:
        print(f"replaced a profile that could not be merged: {saved.note}")
    return 0


# -- status, drain, cancel (the control socket) -----------------------------------


def _control_args(p: argparse.ArgumentParser) -> None:
    from radianced.server.control import default_socket_path

    p.add_argument("--control-socket", metavar="PATH", default=None,
                   help=f"the daemon's control socket (default: the daemon's default, now {default_socket_path()})")


def _status_args(p: argparse.ArgumentParser) -> None:
    _control_args(p)
    p.add_argument("--json", action="store_true", help="print the daemon's reply as JSON instead of tables")


def _cancel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", help="the request id (as returned in the API response and its log lines)")
    _control_args(p)


def _control(args: argparse.Namespace, cmd: str, ctl_args: dict | None = None):
    """(exit status, result): 0 and the result, 1 on a daemon error reply, 2 when it cannot be reached."""
    from radianced.server.control import ControlError, DaemonUnreachable, call, default_socket_path

    path = args.control_socket or default_socket_path()
    try:
        return 0, call(path, cmd, ctl_args)
    except DaemonUnreachable as e:
        where = "--control-socket" if args.control_socket else "the default path (no --control-socket given)"
        print(f"radiancectl {args.command}: {e}\n  tried {where}; the daemon may not be running, "
              "or it listens elsewhere: pass --control-socket PATH", file=sys.stderr)
        return 2, None
    except ControlError as e:
        print(f"radiancectl {args.command}: the daemon refused: {e}", file=sys.stderr)
        return 1, None


def _status(args: argparse.Namespace) -> int:
    """The daemon's state, queue, requests and receipt, as tables (or the raw reply with --json)."""
    import msgspec

    from radianced.server.control import StatusResult

    code, result = _control(args, "status")
    if code:
        return code
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(result)).decode())
        return 0
    status = _shaped(args, result, StatusResult)
    if status is None:
        return 1
    render_status(status)
    return 0


def _shaped(args: argparse.Namespace, result, type_):
    """`result` as `type_`, or None after saying on stderr that the daemon's reply has another shape."""
    import msgspec

    try:
        return msgspec.convert(result, type_)
    except msgspec.ValidationError as e:
        print(f"radiancectl {args.command}: the daemon's reply does not fit this radiancectl ({e})",
              file=sys.stderr)
        return None


def _drain(args: argparse.Namespace) -> int:
    code, _ = _control(args, "drain")
    if not code:
        print("draining: new requests get 503; requests in flight finish")
    return code


def _cancel(args: argparse.Namespace) -> int:
    from radianced.server.control import CancelResult

    code, result = _control(args, "cancel", {"id": args.id})
    if code:
        return code
    reply = _shaped(args, result, CancelResult)
    if reply is None:
        return 1
    if not reply.cancelled:
        print(f"radiancectl cancel: no request {args.id!r} in flight (finished already, or a wrong id)",
              file=sys.stderr)
        return 1
    print(f"cancelled {args.id}")
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
    Command("quality", "KL / top-1 / perplexity of a .rad against a reference .rad (Markdown)", quality.add_arguments, quality.run),
    Command("verify", "check a .rad file: header, extents and every checksum", _verify_args, _verify),
    Command("plan", "print the start-up receipt (the card split) for a model and a card (--tp N: each card's); "
            "with an expert profile, the predicted hit rate, overflow and tok/s", _plan_args, _plan),
    Command("profile", "run prompts through a MoE model and write its expert profile (slot pre-fill order); "
            "--save: the running daemon's live counts", _profile_args, _profile),
    Command("status", "the running daemon's state, queue, requests, expert hit rates and receipt", _status_args,
            _status),
    Command("drain", "stop admitting requests, finish those in flight, then exit", _control_args, _drain),
    Command("cancel", "cancel one request of the running daemon by its id", _cancel_args, _cancel),
    Command("bench", "serving benchmark over HTTP: `bench run --url URL` or `bench run --start -- FLAGS`",
            bench.add_arguments, bench.run),
]


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input, reported as one line; anything else is a bug and keeps its traceback."""
    from radianced.budget import PlanError
    from radianced.config import ConfigError
    from radianced.model.convert import ConvertError
    from radianced.model.rad_format import RadError
    from radianced.tiers.profile import ProfileError

    return (RadError, ConvertError, UnsupportedModel, OSError, ConfigError, PlanError, ProfileError)


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
