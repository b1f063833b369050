"""Speculative decoding over the expert tiers (issue 22's device rows): n-gram drafts on a repetitive input.

    python tools/bench_spec_tiers.py --out OUT [--quick]   # -> OUT/spec_tiers.json, OUT/spec_tiers.md

The tiers benchmark's synthetic Qwen3-30B-A3B-shaped model (tools/bench_tiers.py's preset and
`section_model`), every expert's home in the host pool, `--expert-slots` at 10% and 25% of the experts.
At each point one greedy request on a repetitive prompt (a random 24-token phrase repeated, so n-gram
lookup finds it) decodes with `--speculative 4` (n-gram, adaptive, its cost model's r measured on the
engine first as the daemon measures it before ready, then moved by the steps served) and without: tok/s, the slab's miss
bytes per generated token (what crossed PCIe for each token the user got), and the drafts accepted.
A verify step reads each routed expert once for all its tokens, so the bytes per token fall with
acceptance. A random-weight model rarely continues its prompt, so the adaptive policy may stop drafting
early; the issue's forced-draft rows measure the verify steps at known acceptance instead: at each point,
`--speculative 4` with the drafts replayed from the plain run's greedy output (tools/bench_spec.py `Replay`),
all right (100%), every other proposal's second draft wrong (~50-70%) and every first wrong (0%), not adaptive:
tok/s, the link's bytes per generated token, and whether the greedy tokens are the plain run's.
Without CUDA (`--quick`, a dry run on a CPU) the sizes are tiny: it proves the code runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

from radianced.engine import drafting_cost  # noqa: E402
from radianced.engine.request import Request  # noqa: E402
from radianced.engine.sampling_params import SamplingParams  # noqa: E402
from radianced.engine.speculation import DraftPolicy  # noqa: E402
from radianced.model.rad import RadFile  # noqa: E402
from radianced.tiers.placement import routed_experts  # noqa: E402
from tools import gpu_bench  # noqa: E402
from tools.bench_spec import Replay  # noqa: E402
from tools.bench_tiers import FULL, QUICK, _counters, engine_for, host_pool_mib, section_model, teardown  # noqa: E402

COVERAGE = (0.10, 0.25)
DRAFTS = 4
PHRASE, REPEATS = 24, 6
FORCED = {"none": "all right", "half": "every other 2nd wrong", "all": "every 1st wrong"}  # Replay's `wrong` cases


def _prompt(vocab: int) -> list[int]:
    phrase = torch.randint(0, vocab, (PHRASE,), generator=torch.Generator().manual_seed(3)).tolist()
    return phrase * REPEATS


def _decode(engine, device: str, prompt: list[int], tokens: int) -> dict:
    """One greedy request to its end: tok/s after the prefill, the slab's miss bytes per generated token."""
    seq = engine.add(Request("r", tuple(prompt), SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)))
    out = [t for ev in engine.step() for t in ev.token_ids]  # prefill and the first token
    gpu_bench._sync(device)
    before, t0 = _counters(engine), time.perf_counter()
    while engine.scheduler.has_unfinished:
        out += [t for ev in engine.step() for t in ev.token_ids]
    gpu_bench._sync(device)
    seconds, got = time.perf_counter() - t0, len(out) - 1
    lookups, hits = (b - a for a, b in zip(before[:2], _counters(engine)[:2]))
    return {"tokens": got, "seconds": seconds, "tok_s": got / seconds,
            "miss_bytes_per_token": (lookups - hits) * engine.experts.extent_bytes / got,
            "drafted": seq.draft_stats.drafted, "accepted": seq.draft_stats.accepted, "out": out}


def _run(rad: RadFile, p, device: str, slots: int, spec: int, prompt: list[int], tokens: int,
         replay: Replay | None = None) -> dict:
    """One engine, built, warmed, measured and closed. With drafts, the cost model's r is measured first
    on this engine, as the daemon does before ready (engine/drafting_cost.py), so the adaptive policy
    decides as it would when served: over the tiers a verify step also reads its drafts' experts. With
    `replay`, every decode drafts `spec` tokens from it instead (the forced-draft rows: nothing adaptive)."""
    engine = engine_for(rad, p, device, host_pool_mib=host_pool_mib(rad), expert_slots=slots, speculative=spec)
    try:
        if replay is not None:
            engine.scheduler.drafting.policy = DraftPolicy(spec, 0.0, adaptive=False, propose=replay)
        _decode(engine, device, prompt, 8)  # warm-up: slots settle, kernels compile
        said = drafting_cost.adopt(engine, rad.model.vocab_size) if spec and replay is None else None
        if said:
            print(f"   {said}", flush=True)
        policy = engine.scheduler.drafting.policy if spec else None
        start = policy.token_cost if policy and policy.adaptive else None
        got = _decode(engine, device, prompt, tokens)
        # r before the row, and after it: the policy's, as the served steps moved it (speculation.py `ServedCost`)
        return {**got, "token_cost": start, "token_cost_after": policy.token_cost if start is not None else None}
    finally:
        teardown(engine)


def _release(device: str) -> None:
    """The engine is gone: give its memory back to the card, which the next engine's plan reads as free."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def point(rad: RadFile, p, device: str, share: float, tokens: int) -> dict:
    """--speculative 0 and DRAFTS at `share` of the experts in card slots (--expert-slots), on the preset's budget."""
    slots = round(share * len(routed_experts(rad.header)))
    row = {"share": share, "expert_slots": slots}
    prompt = _prompt(rad.model.vocab_size)
    for spec in (0, DRAFTS):
        got = row[f"spec{spec}"] = _run(rad, p, device, slots, spec, prompt, tokens)
        _release(device)
        print(f"   {share:.0%} slots, --speculative {spec}: {got['tok_s']:.1f} tok/s, "
              f"{got['miss_bytes_per_token'] / 2**20:.2f} MiB over the link per token", flush=True)
    plain = row["spec0"]["out"]
    for wrong, acceptance in FORCED.items():
        replay = Replay(tuple(prompt), plain, wrong, rad.model.vocab_size)
        got = row[f"forced_{wrong}"] = _run(rad, p, device, slots, DRAFTS, prompt, tokens, replay)
        got["same_tokens"] = got["out"] == plain
        _release(device)
        tokens_said = "the plain run's tokens" if got["same_tokens"] else "tokens DIFFER from the plain run's"
        print(f"   {share:.0%} slots, {DRAFTS} forced drafts, {acceptance}: {got['tok_s']:.1f} tok/s, "
              f"{got['miss_bytes_per_token'] / 2**20:.2f} MiB over the link per token, accepted "
              f"{got['accepted']} / {got['drafted']}, {tokens_said}", flush=True)
    for got in row.values():
        if isinstance(got, dict):
            got.pop("out")
    return row


def markdown(results: dict) -> str:
    lines = [f"# Speculative decoding over the expert tiers ({results['device']}, {results['date']})", "",
             "| slots | --speculative | tok/s | MiB over the link per token | accepted / drafted | speed-up "
             "| bytes per token | r before / after |", "|---|---|---|---|---|---|---|---|"]
    for row in results["points"]:
        off = row["spec0"]
        cases = [(f"spec{spec}", str(spec)) for spec in (0, DRAFTS)]
        cases += [(f"forced_{wrong}", f"{DRAFTS} forced, {acceptance}") for wrong, acceptance in FORCED.items()]
        for key, label in cases:
            r = row[key]
            same = "" if r.get("same_tokens", True) else " (tokens differ)"
            lines.append(f"| {row['share']:.0%} | {label} | {r['tok_s']:.1f} | {r['miss_bytes_per_token'] / 2**20:.2f} "
                         f"| {r['accepted']} / {r['drafted']}{same} | {r['tok_s'] / off['tok_s']:.2f}x | "
                         f"{r['miss_bytes_per_token'] / max(off['miss_bytes_per_token'], 1e-9):.2f}x | "
                         f"{_r(r)} |")
    return "\n".join(lines) + "\n"


def _r(row: dict) -> str:
    """r before the row (measured on the engine) and after it (as its steps moved it), or '' without drafts."""
    if row.get("token_cost") is None:
        return ""
    return f"{row['token_cost']:.3g} / {row['token_cost_after']:.3g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dir", default="/tmp", help="where the synthetic model is written")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    p = QUICK if args.quick or device == "cpu" else FULL
    model = section_model(p, Path(args.dir), device)
    rad = RadFile.open(model["path"])
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "date": time.strftime("%Y-%m-%d"), "model": model, "points": []}
    try:
        for share in COVERAGE:
            results["points"].append(point(rad, p, device, share, 16 if p is QUICK else args.tokens))
            (args.out / "spec_tiers.json").write_text(json.dumps(results, indent=1))
    finally:
        rad.close()
        Path(model["path"]).unlink(missing_ok=True)
    md = markdown(results)
    (args.out / "spec_tiers.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
