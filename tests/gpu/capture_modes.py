"""Decode graphs captured in a fresh process serve every sampling mode as eager decoding does.

    python -m tests.gpu.capture_modes FAMILY [--device cuda]

Run as a script (tests/gpu/test_capture.py starts it, and tools/gpu_check repeats
it): a tiny FAMILY model is converted, then for every sampling mode an engine is
built twice in this one process, with `--enforce-eager` and with the decode
graphs it captures (`--deterministic`: both compute the same bits), and serves
the same three requests with the daemon's pipelined rounds. Before each build a
dead reference cycle pins host memory (as an unclosed engine's host pool does),
so a collection inside a capture would unpin it there: what invalidated a
capture on the H200 twice (engine/graphs.py `_no_collection`). Prints one JSON
object: per mode, the graph run's tokens equal the eager run's.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch

from radianced.card import Card
from radianced.config import Config
from radianced.engine.engine import Engine
from radianced.engine.request import Request
from radianced.engine.sampling_params import SamplingParams
from radianced.kernels.pinned import register_pinned
from radianced.model.convert import convert
from radianced.model.rad import RadFile
from radianced.model.tiny import make_tiny

MODES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8, seed=7),
    "top_p_top_k": dict(temperature=1.0, top_p=0.9, top_k=20, seed=11),
    "penalties": dict(temperature=0.0, repetition_penalty=3.0, frequency_penalty=0.5, presence_penalty=0.2),
    "logprobs": dict(temperature=0.0, logprobs=5),
}
EXPERTS = dict(host_pool_mib=1, expert_slots=6)  # experts split between slots and the host pool


class _Owner:
    """Something that pins host memory for as long as it lives (tiers/host.py's finalizer unpins)."""


def pinned_cycle(nbytes: int = 1 << 20) -> _Owner:
    """A reference cycle that pins host memory until it is collected (its finalizer calls
    cudaHostUnregister): drop the returned reference and it is garbage only the cyclic collector
    frees. Pin it outside any capture: registering is itself no capturable call."""
    owner = _Owner()
    owner.me = owner
    memory = torch.zeros(nbytes, dtype=torch.uint8)
    owner.unpin = register_pinned(owner, memory, memory)
    return owner


def dead_pinned_cycle() -> None:
    """Leave such garbage behind (as an unclosed engine does)."""
    pinned_cycle()


def serve(engine: Engine, mode: dict, prompts: list[list[int]], max_tokens: int = 16) -> dict[str, list]:
    """Tokens (and logprobs, where asked) per request, through the daemon's pipelined rounds."""
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **mode)
        engine.add(Request(f"r{i}", tuple(p), params, frozenset()))
    out: dict[str, list] = {}
    while engine.scheduler.has_unfinished:
        for ev in engine.step(ahead=True):
            out.setdefault(ev.request_id, []).append([list(ev.token_ids), ev.logprobs])
    engine.step()  # what the last round left in flight
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family", choices=("llama", "qwen3_moe", "qwen3_next"))
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    flags = {} if args.family == "llama" else EXPERTS
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = make_tiny(args.family, Path(tmp) / args.family)
        convert(src, src / "model.rad")
        rad = RadFile.open(src / "model.rad")
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(0, rad.model.vocab_size - 3, (n,), generator=g).tolist() for n in (5, 17, 40)]
        for name, mode in MODES.items():
            runs = {}
            for eager in (True, False):
                if args.device == "cuda":
                    dead_pinned_cycle()
                cfg = Config(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, deterministic=True,
                             enforce_eager=eager, **flags)
                engine = Engine.build(rad, cfg, Card.from_mib(1024), args.device)
                if not eager and args.device == "cuda" and engine.runner.graphs is None:
                    raise AssertionError("no decode graphs were captured")
                runs[eager] = serve(engine, mode, prompts)
                engine.close()
                del engine
                gc.collect()
            result[name] = {"equal": runs[True] == runs[False], "eager": runs[True], "graphs": runs[False]}
        rad.close()
    print(json.dumps({"family": args.family, "modes": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
