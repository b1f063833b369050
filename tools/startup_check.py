"""Issue 18's start-up check: the daemon's own build on a card filled to what it may use, per flag set.

    python tools/startup_check.py --out DIR [--layers 4] [--spare-mib 24576] [--only NAME ...]

For each flag combination (placement auto / resident / --deterministic, embedding
placement vram / ram, step graphs on / off with --enforce-eager; and placement auto
with experts on the disk tier: --weights-disk-tier, no host pool, 64 slots) a fresh process
takes the card as a user's neighbour might: it allocates a filler so that only
--spare-mib stays free, then runs the daemon's start-up itself (`Daemon._build`:
the receipt from what the card reports, the arena, the loader, the step graphs,
the warm-up of engine/warmup.py) with the flags left at their defaults otherwise,
on a synthetic Qwen3-30B-A3B of --layers layers (tools/make_synthetic.py).

Per combination: whether it started; the peak reserved by torch beyond the filler
against the receipt's total (weights + workspace + state + elastic: target, at
most that); what stays allocated in the default pool after start-up against the
receipt's lines held past it: weights + state + the arena's allocation + the
libraries line (the step thread's cuBLAS workspace), the gap in MiB (target:
within 1 MiB); the step graphs' pool, reserved, against its workspace line (the
capture stream's cuBLAS workspace is in it); whether expandable segments were on;
the seconds to build and warm up; what stayed allocated, by allocator pool and by
the line that allocated it.
Writes DIR/startup_check.json (and DIR/startup-snapshot-NAME.pickle, the allocator's
history, for a set that misses a target); prints a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 2**20
COMBOS = {f"{p}-emb_{e}-{g}": flags for p, pf in (("auto", []), ("resident", ["--placement", "resident"]),
                                                  ("deterministic", ["--deterministic"]))
          for e in ("vram", "ram") for g, gf in (("graphs", []), ("eager", ["--enforce-eager"]))
          for flags in [[*pf, "--embedding-placement", e, *gf]]}
# experts that fit neither the card's 64 slots nor a host pool of 0 MiB stay in the model file: the disk tier's two
# buffers are charged and, its steps being eager, no graph pool (the receipt says "none: ...")
COMBOS["auto-disk_tier"] = ["--weights-disk-tier", "--host-pool-mib", "0", "--expert-slots", "64"]


def child(model: str, flags: list[str], spare_mib: int, snapshot: Path) -> dict:
    """In a fresh process: fill the card to `spare_mib` free, build as the daemon does, measure. Where
    the peak passes the receipt or the allocation misses it by over 1 MiB, the allocator's history is
    dumped to `snapshot` (torch.cuda.memory._dump_snapshot: every allocation with its Python stack)."""
    import time

    import torch

    from radianced.config import Config, add_flags
    from radianced.daemon import Daemon

    parser = argparse.ArgumentParser()
    add_flags(parser)
    cfg = Config.from_args(parser.parse_args(["--model", model, *flags]))
    torch.zeros(1, device="cuda")
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(max(0, free - spare_mib * MiB), dtype=torch.uint8, device="cuda")  # none: the whole card
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    daemon = Daemon(cfg)
    t0 = time.monotonic()
    try:
        engine = daemon._build()
    except Exception as e:  # the row says why it did not start
        return {"started": False, "error": f"{type(e).__name__}: {e}"[:600]}
    seconds = time.monotonic() - t0
    torch.cuda.synchronize()
    r = engine.receipt
    state = torch.cuda.memory._snapshot()
    pools = live_by_pool(state, filler.data_ptr())
    default = pools.pop(str((0, 0)), {"live_mib": 0.0})
    libraries = sum(p.bytes for p in r.workspace if p.name in ("libraries", "allocator tails"))
    graph_line = sum(p.bytes for p in r.workspace if "graph" in p.name)
    # held past start-up: the weights (and the allocator's tails on them), the state, the arena and one cuBLAS
    # workspace (the step thread's)
    # in the default pool; the step graphs' pool (the capture stream's workspace in it) within its line
    expected = r.held_bytes + libraries
    allocated = round(default["live_mib"] * MiB)
    graph_reserved = round(sum(p["reserved_mib"] for p in pools.values()) * MiB)
    peak = torch.cuda.max_memory_reserved() - filler.numel()
    total = r.weights_bytes + r.workspace_bytes + r.state_bytes + r.elastic
    if peak > total or abs(allocated - expected) > MiB or graph_reserved > graph_line:
        torch.cuda.memory._dump_snapshot(str(snapshot))
    return {"started": True, "seconds": seconds, "receipt": daemon.receipt,
            "peak_reserved_bytes": peak, "receipt_total_bytes": total, "peak_within_receipt": peak <= total,
            "allocated_bytes": allocated, "expected_allocated_bytes": expected,
            "allocated_gap_mib": (allocated - expected) / MiB, "within_1_mib": abs(allocated - expected) <= MiB,
            "graph_pool_reserved_bytes": graph_reserved, "graph_pool_line_bytes": graph_line,
            "expandable_segments": state["allocator_settings"].get("expandable_segments"),
            "live_by_pool": {str((0, 0)): default, **pools}}


def live_by_pool(snapshot: dict, filler_ptr: int) -> dict:
    """What start-up left allocated, by allocator pool (the default pool, each graph pool) and by
    where it was allocated (the innermost radianced frame of its Python stack), MiB, largest first;
    and each pool's reserved MiB. The filler is left out."""
    pools: dict = {}
    for seg in snapshot["segments"]:
        pool = pools.setdefault(str(tuple(seg.get("segment_pool_id", (0, 0)))), {"reserved_mib": 0.0, "live": {}})
        pool["reserved_mib"] += seg["total_size"] / MiB
        for b in seg["blocks"]:
            if b.get("address") == filler_ptr:
                pool["reserved_mib"] -= b["size"] / MiB
                continue
            if b["state"] != "active_allocated":
                continue
            frames = [f for f in b.get("frames", []) if "radianced" in f.get("filename", "")]
            where = (f"{Path(frames[0]['filename']).name}:{frames[0]['line']} {frames[0]['name']}" if frames
                     else "no radianced frame")
            pool["live"][where] = pool["live"].get(where, 0.0) + b["size"] / MiB
    for pool in pools.values():
        pool["live_mib"] = sum(pool["live"].values())
        pool["live"] = dict(sorted(pool["live"].items(), key=lambda kv: -kv[1])[:25])
    return pools


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--spare-mib", type=int, default=24576)
    ap.add_argument("--only", nargs="*", choices=sorted(COMBOS))
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "NAME"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], COMBOS[args.child[1]], args.spare_mib,
                               args.out / f"startup-snapshot-{args.child[1]}.pickle")))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    from tools.make_synthetic import make_synthetic
    rows = {}
    with tempfile.TemporaryDirectory(dir="/var/tmp" if Path("/var/tmp").is_dir() else None) as d:
        model = make_synthetic(Path(d) / "m.rad", layers=args.layers, zipf=1.0, progress=False,  # on the CPU:
                               device="cuda" if torch.cuda.is_available() else "cpu")  # 212 s for 8 layers
        torch.cuda.empty_cache()  # the children fill the card: leave them what generating took
        for name in args.only or COMBOS:
            run = subprocess.run([sys.executable, __file__, "--child", str(model), name, "--spare-mib",
                                  str(args.spare_mib), "--out", str(args.out)], capture_output=True, text=True, timeout=300)
            lines = run.stdout.strip().splitlines()
            rows[name] = json.loads(lines[-1]) if run.returncode == 0 and lines else {
                "started": False, "error": f"exit {run.returncode}: {run.stderr[-600:]}"}
            r = rows[name]
            if r["started"]:
                print(f"{name:34s} started in {r['seconds']:5.1f} s; peak reserved {r['peak_reserved_bytes'] / MiB:9.1f}"
                      f" MiB of {r['receipt_total_bytes'] / MiB:9.1f} ({'ok' if r['peak_within_receipt'] else 'OVER'});"
                      f" allocated - receipt {r['allocated_gap_mib']:+.2f} MiB; graph pool reserved"
                      f" {r['graph_pool_reserved_bytes'] / MiB:.2f} of {r['graph_pool_line_bytes'] / MiB:.2f} MiB;"
                      f" expandable segments {r['expandable_segments']}", flush=True)
                for pool, p in r["live_by_pool"].items():
                    top = "; ".join(f"{where} {mib:.2f}" for where, mib in list(p["live"].items())[:8])
                    print(f"    pool {pool}: reserved {p['reserved_mib']:.2f} MiB, live {p['live_mib']:.2f}: {top}",
                          flush=True)
            else:
                print(f"{name:34s} DID NOT START: {r['error'][:300]}", flush=True)
            (args.out / "startup_check.json").write_text(json.dumps({"layers": args.layers,
                                                                     "spare_mib": args.spare_mib, "rows": rows},
                                                                    indent=1))
    return 0 if all(r["started"] and r["peak_within_receipt"] and r["within_1_mib"]
                    and r["graph_pool_reserved_bytes"] <= r["graph_pool_line_bytes"] for r in rows.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
