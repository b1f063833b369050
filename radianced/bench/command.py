"""`radiancectl bench run`: flags, the daemon to measure, the run, and its outputs.

    radiancectl bench run --url http://127.0.0.1:8000 [--quick | --full] [--out DIR]
    radiancectl bench run --start [--quick | --full] -- <radianced flags>

With --url the daemon's --max-num-seqs and --max-queue are given here too (the
overload row sends their sum plus 32 requests and expects exactly 32 429s);
with --start they are read from the daemon's own flags. The run writes
`bench.json` (every sample), `bench.md` (the table) and the PNG plots into
--out, prints the table, and exits 1 when a consistency check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from radianced.config import Config, ConfigError

DEFAULTS = Config()


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", metavar="ACTION", required=True)
    run = sub.add_parser("run", help="run the serving workloads against a daemon and write the report",
                         description="Run the serving workloads against a daemon over HTTP and write the report.")
    where = run.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running daemon, e.g. http://127.0.0.1:8000")
    where.add_argument("--start", action="store_true", help="start a daemon with the flags after `--`, stop it after")
    mode = run.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="every workload, sized down (about a minute on a CPU)")
    mode.add_argument("--full", action="store_true", help="add the stability pass (at least 10 minutes)")
    run.add_argument("--stability-s", type=float, default=600.0, help="length of the --full stability pass")
    run.add_argument("--out", help="folder for bench.json, bench.md and the plots (default: bench-<UTC time>)")
    run.add_argument("--api-key-file", metavar="PATH", help="a file holding the daemon's API key (default: "
                     "$RADIANCED_API_KEY, or with --start the key the daemon's own flags give it)")
    run.add_argument("--max-num-seqs", type=int, default=DEFAULTS.max_num_seqs,
                     help=f"with --url: the daemon's --max-num-seqs (default {DEFAULTS.max_num_seqs})")
    run.add_argument("--max-queue", type=int, default=DEFAULTS.max_queue,
                     help=f"with --url: the daemon's --max-queue (default {DEFAULTS.max_queue})")
    run.add_argument("--workloads", type=workload_names, metavar="NAME,...",
                     help="run only these, in their usual order (default: all): decode, prefill, sweep, overload, "
                          "multi-turn, stability (--full), quality")
    run.add_argument("daemon_args", nargs=argparse.REMAINDER, help="with --start: `--` then radianced's flags")


def workload_names(text: str) -> frozenset[str]:
    """An argparse type: a comma-separated list of `bench run` workloads (the error names the unknown ones)."""
    from radianced.bench.workloads import WORKLOADS

    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(names - WORKLOADS.keys())
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown workload(s) {', '.join(unknown) or '(none given)'}; choose from "
                                         f"{', '.join(WORKLOADS)}")
    return names


def run(args: argparse.Namespace) -> int:
    """`bench run`: start the daemon if asked, measure, write the outputs; 1 when a check failed, 2 when
    the daemon could not be started or reached."""
    from radianced.bench.daemon_process import ChildDaemon, DaemonStartError, daemon_config
    from radianced.server.api_key import ApiKeyError

    daemon_args = args.daemon_args[1:] if args.daemon_args[:1] == ["--"] else args.daemon_args
    if daemon_args and not args.start:
        raise ConfigError(f"daemon flags ({' '.join(daemon_args)}) go with --start only")
    cfg = daemon_config(daemon_args) if args.start else None
    try:
        key = api_key(args.api_key_file, cfg, dict(os.environ))
        child = ChildDaemon.start(daemon_args) if args.start else None
    except (ApiKeyError, DaemonStartError) as e:
        print(f"radiancectl bench: {e}", file=sys.stderr)
        return 2
    try:
        if child is not None:
            report = _reach(args, child.url, key, (cfg.max_num_seqs, cfg.max_queue), child.proc.pid)
        else:
            report = _reach(args, args.url.rstrip("/"), key, (args.max_num_seqs, args.max_queue), None)
    finally:
        if child is not None:
            child.stop()
    if report is None:
        return 2
    _write(report, Path(args.out or time.strftime("bench-%Y%m%d-%H%M%S", time.gmtime())))
    return 0 if report.passed else 1


def _reach(args: argparse.Namespace, url: str, key: str | None, limits: tuple[int, int], pid: int | None):
    """The run's Report, or None after one message on stderr when the daemon cannot be reached or refuses."""
    import httpx

    try:
        return asyncio.run(_measure(args, url, key, limits, pid))
    except httpx.HTTPStatusError as e:
        print(f"radiancectl bench: {url} answered {e.response.status_code} to {e.request.url.path} "
              f"({e.response.text[:200].strip()}); with an API key set, pass --api-key-file", file=sys.stderr)
    except httpx.TransportError as e:
        print(f"radiancectl bench: cannot reach the daemon at {url}: {e or type(e).__name__}; is it running "
              "there? (or use --start)", file=sys.stderr)
    return None


def api_key(key_file: str | None, daemon: Config | None, environ: dict[str, str]) -> str | None:
    """The bearer key to send, by the daemon's own rules (radianced/server/api_key.py): from --api-key-file,
    else from the started daemon's flags or $RADIANCED_API_KEY; None when there is none. Raises ApiKeyError."""
    from radianced.server.api_key import load_api_key

    return load_api_key(Config(api_key_file=key_file) if key_file else daemon or Config(), environ)


async def _measure(args: argparse.Namespace, url: str, key: str | None, limits: tuple[int, int], pid: int | None):
    import httpx

    from radianced.bench.energy import EnergyMeter
    from radianced.bench.report import NOT_MEASURED, Report
    from radianced.bench.sizes import DaemonLimits, Sizes
    from radianced.bench.workloads import BenchContext, run_all

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(600.0, connect=30.0),
                                 limits=httpx.Limits(max_connections=None)) as http:
        models = (await http.get("/v1/models")).raise_for_status().json()["data"][0]
        daemon = DaemonLimits(limits[0], limits[1], models.get("max_model_len") or 4096)
        sizes = Sizes.choose(daemon, args.quick, args.full, args.stability_s)
        meter = EnergyMeter.open()
        with _Progress() as progress:
            ctx = BenchContext(http, sizes, daemon, models["id"], meter, pid, progress.update)
            rows = await run_all(ctx, args.workloads)
    mode = "quick" if args.quick else "full" if args.full else "default"
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "url": url, "model": models["id"],
            "mode": mode, "workloads": ",".join(sorted(args.workloads)) if args.workloads else "all",
            "client_commit": _commit(),
            "device": meter.device_name() if meter else "no NVIDIA GPU seen by NVML",
            "energy": "NVML" if meter else NOT_MEASURED,
            "limits": {"max_num_seqs": daemon.max_num_seqs, "max_queue": daemon.max_queue,
                       "max_model_len": daemon.max_model_len}}
    return Report(meta, tuple(rows))


def _commit() -> str | None:
    """The git commit of this radianced checkout (None when installed from a wheel)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, text=True,
                              capture_output=True, timeout=10, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _write(report, out: Path) -> None:
    from radianced.bench.plots import draw

    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report.to_json(), indent=1) + "\n", encoding="utf-8")
    markdown = report.markdown()
    (out / "bench.md").write_text(markdown, encoding="utf-8")
    plots = draw(report.rows, out)
    print(markdown)
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}" + "".join(f", {p}" for p in plots))


class _Progress:
    """A rich progress bar per workload on a terminal; nothing otherwise (logs stay clean)."""

    def __init__(self):
        self._bar = None
        self._tasks: dict[str, int] = {}

    def __enter__(self) -> _Progress:
        if sys.stdout.isatty():
            from rich.progress import Progress

            self._bar = Progress(transient=False)
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def update(self, workload: str, done: int, total: int) -> None:
        if self._bar is None:
            return
        if workload not in self._tasks:
            self._tasks[workload] = self._bar.add_task(workload, total=total)
        self._bar.update(self._tasks[workload], completed=done, total=total)
