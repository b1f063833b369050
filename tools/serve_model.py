"""The model and the offload flags of gpu_check's `serve` part (issue 24: `radiancectl bench run` on the device).

    python tools/serve_model.py --dir DIR [--layers 8] [--narrow 1] [--vocab N] [--slot-share 0.25]

Writes DIR/radianced-serve-<layers>l[-n<narrow>].rad, a synthetic Qwen3-30B-A3B-shaped
model with Zipf 1.0 routing (tools/make_synthetic.py, as tools/bench_served.py makes
it), unless that file is already there: a warm device keeps it between calls, and
the writer renames the file into place only when it is complete. Prints two lines:
the model's path, and the flags of the offload run:

    --host-pool-mib H --expert-slots S

H holds every routed expert in the host pool (tools/bench_tiers.py's `host_pool_mib`),
so no expert is pinned on the card and each has a slot-sized home to be read from;
S = slot-share x the routed experts is how many of them the card caches. The cap is
--expert-slots rather than a small --gpu-memory-mib because the slot count then does
not depend on the rest of the receipt: under a card budget the slots are what is left
after the KV buffer, the workspace and the graph pool, which change with the commit,
the card and --max-num-seqs, and the hit-rate rows of two runs would not compare.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

from radianced.model.rad import RadFile  # noqa: E402
from radianced.tiers.placement import routed_experts  # noqa: E402
from tools.bench_tiers import host_pool_mib  # noqa: E402
from tools.make_synthetic import make_synthetic  # noqa: E402

ZIPF = 1.0  # tools/bench_served.py's skew: a few experts take most tokens, so a slot cache has something to hit


def model_path(folder: Path, layers: int, narrow: int) -> Path:
    """Where the model of these arguments lives: one file per shape, so a changed SERVE_LAYERS writes anew."""
    return folder / (f"radianced-serve-{layers}l" + (f"-n{narrow}" if narrow != 1 else "") + ".rad")


def offload_flags(rad: RadFile, slot_share: float) -> list[str]:
    """The offload run's flags for `rad` (module docstring): every expert homed in the host pool, the card
    caching `slot_share` of them (at least one)."""
    slots = max(1, round(slot_share * len(routed_experts(rad.header))))
    return ["--host-pool-mib", str(host_pool_mib(rad)), "--expert-slots", str(slots)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="folder of the model (kept for the next call)")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (the real model has 48)")
    ap.add_argument("--narrow", type=int, default=1, help="width divisor (the CPU dry run's tiny model)")
    ap.add_argument("--vocab", type=int, help="vocabulary size (default: the real model's)")
    ap.add_argument("--slot-share", type=float, default=0.25, help="share of the routed experts with a card slot")
    args = ap.parse_args(argv)
    path = model_path(args.dir, args.layers, args.narrow)
    if not path.exists():
        args.dir.mkdir(parents=True, exist_ok=True)
        make_synthetic(path, layers=args.layers, zipf=ZIPF, vocab=args.vocab, narrow=args.narrow,
                       device="cuda" if torch.cuda.is_available() else "cpu")
    else:
        print(f"serve_model: reusing {path}", file=sys.stderr)
    with RadFile.open(path) as rad:
        print(path)
        print(" ".join(offload_flags(rad, args.slot_share)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
