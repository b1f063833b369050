"""Compact experts through the expert tiers (issue 20's device rows): bf16, fp8 and int4 at the same slot bytes.

    python tools/bench_compact_tiers.py --out OUT [--quick] [--formats bf16,fp8,int4]
        # -> OUT/compact_tiers.json, OUT/compact_tiers.md

One run, one synthetic Qwen3-30B-A3B-shaped model per format (tools/make_synthetic.py: the same seed,
so every format holds the same random weights rounded, and routes every token alike; Zipf 1.0), its
experts in `--quantize experts=fp8` (fp8_b128) or `experts=int4` (q4_0), attention and the rest bf16:

1. ceilings: pinned host-to-device copies (the overflow's link) and a device copy (HBM);
2. for each format, every expert homed in the host pool and the card given the slot bytes of 10% and
   25% of bf16's experts (`--expert-slots` = that many bf16 slots' bytes over the format's slot: a
   compact card holds more experts in the same memory, as at the same `--gpu-memory-mib`): decode at
   concurrency 1, tok/s, hit rate and overflow bytes a token; the issue's targets where bf16 is
   overflow-bound: fp8 at least 1.8x bf16's tok/s, int4 at least 3x;
3. for each format, every expert in a slot: decode at concurrency 1 and 32 against the bytes floor
   (each step's bytes: the dense weights read once, embedding table aside, plus each expert looked up
   in the step once, its compact extent; over the measured HBM copy rate): the issue's target is fp8's
   share of its floor at least bf16's share of bf16's.

Steps are timed as tools/bench_tiers.py times them (its `decode`: the wall clock around `engine.step()`);
each section has a soft deadline and a hard alarm, and the JSON and the table are rewritten after each.
Without CUDA (`--quick`, the CPU): width / 8, f32 in place of bf16, 2 layers: it proves the code runs.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

from radianced.config import Config  # noqa: E402
from radianced.engine.engine import Engine  # noqa: E402
from radianced.model.rad import RadFile  # noqa: E402
from radianced.sizing import ModelFacts, slot_bytes  # noqa: E402
from radianced.tiers.placement import routed_experts  # noqa: E402
from tools import bench_tiers, gpu_bench  # noqa: E402
from tools.bench_tiers import _f, decode, host_pool_mib, run_totals, teardown  # noqa: E402
from tools.make_synthetic import make_synthetic  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
FORMATS = {"bf16": None, "fp8": "experts=fp8", "int4": "experts=int4"}  # -> make_synthetic's quantize
SHARES = (0.10, 0.25)  # of bf16's experts' slot bytes
RESIDENT_C = (1, 32)


@dataclass(frozen=True)
class Preset:
    layers: int
    narrow: int
    vocab: int | None
    dtype: str
    gpu_memory_mib: int
    warm: int
    steps: int
    budgets: dict  # section kind -> seconds (a model, a coverage point, the first one (its kernels are built
    # there: 45 s were too few on the H200), the resident runs)


FULL = Preset(layers=4, narrow=1, vocab=None, dtype="bf16", gpu_memory_mib=16384, warm=48, steps=96,
              budgets={"ceilings": 25, "model": 60, "slots": 25, "first_slots": 90, "resident": 35})
QUICK = Preset(layers=2, narrow=8, vocab=2048, dtype="f32", gpu_memory_mib=2048, warm=4, steps=6,
               budgets={"ceilings": 30, "model": 60, "slots": 60, "first_slots": 60, "resident": 60})


def engine_for(rad: RadFile, p: Preset, device: str, **flags) -> Engine:
    """As the daemon builds it: room for 32 sequences and their 16-token prompts in one step."""
    cfg = Config(max_model_len=1024, max_num_seqs=max(RESIDENT_C), max_num_batched_tokens=1024,
                 gpu_memory_mib=p.gpu_memory_mib, **flags)
    return Engine.build(rad, cfg, device=device)


def section_ceilings(p: Preset, device: str, deadline: float) -> dict:
    out = {"hbm_copy": gpu_bench.ceiling_copy(device, (2 * GiB) if p is FULL else 64 * MiB)}
    try:
        out["host_links"] = gpu_bench.ceiling_host_links(GiB)
    except gpu_bench.Skip as e:
        out["host_links"] = {"skipped": str(e)}
    return out


def section_model(p: Preset, fmt: str, folder: Path, device: str, deadline: float) -> dict:
    path = folder / f"radianced-compact-{fmt}-{p.layers}l.rad"
    t0 = time.perf_counter()
    make_synthetic(path, layers=p.layers, zipf=1.0, dtype=p.dtype, vocab=p.vocab, narrow=p.narrow, device=device,
                   quantize=FORMATS[fmt], progress=False)
    rad = RadFile.open(path)
    facts = ModelFacts.from_header(rad.header)
    experts = {e.dtype for e in rad.header.experts}
    dense = sum(t.nbytes for t in rad.header.tensors if t.name != "model.embed_tokens.weight")
    rad.close()
    return {"path": str(path), "bytes": path.stat().st_size, "seconds": time.perf_counter() - t0,
            "expert_format": "/".join(sorted(experts)), "extent_bytes": facts.expert_extent_bytes,
            "slot_bytes": slot_bytes(facts.expert_extent_bytes), "dense_bytes": dense,
            "routed_experts": len(routed_experts(rad.header))}


def section_slots(rad: RadFile, p: Preset, device: str, slots: int, deadline: float) -> dict:
    engine = engine_for(rad, p, device, host_pool_mib=host_pool_mib(rad), expert_slots=slots)
    out = {"expert_slots": slots, "extent_bytes": engine.experts.extent_bytes}
    try:
        out["run"] = decode(engine, device, 1, p.warm, p.steps, deadline)
    finally:
        teardown(engine)
    return out


def section_resident(rad: RadFile, p: Preset, device: str, deadline: float) -> dict:
    engine = engine_for(rad, p, device, placement="resident")
    out = {"extent_bytes": engine.experts.extent_bytes, "runs": []}
    try:
        for i, c in enumerate(RESIDENT_C):
            share = (deadline - time.perf_counter()) / (len(RESIDENT_C) - i)
            out["runs"].append(decode(engine, device, c, p.warm, p.steps, time.perf_counter() + share))
    finally:
        teardown(engine)
    return out


def run_section(results: dict, out: Path, name: str, budget: float, fn, *args) -> dict:
    """bench_tiers' section runner (a soft deadline, a hard alarm), writing compact_tiers.json / .md."""
    return bench_tiers.run_section(results, out, name, budget, fn, *args, stem="compact_tiers", report=render)


def bf16_slot_count(results: dict, share: float) -> int:
    """`share` of the experts, in bf16 slots (the first format's when bf16 did not run)."""
    model = results["model_bf16"] if results.get("model_bf16", {}).get("status") == "ok" else next(
        v for k, v in results.items() if k.startswith("model_") and v.get("status") == "ok")
    return max(1, round(share * model["routed_experts"]))


def cmd_run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    p = QUICK if args.quick or device == "cpu" else FULL
    logging.basicConfig(filename=out / "compact_tiers.log", level=logging.INFO,
                        format="%(asctime)s %(name)s %(message)s")
    formats = args.formats.split(",")
    results: dict = {"quick": p is QUICK, "device_type": device, "formats": formats, "preset": vars(p).copy()}
    gpu_bench._section(results, out / "compact_tiers.json", "env", gpu_bench.section_env, out)
    run_section(results, out, "ceilings", p.budgets["ceilings"], section_ceilings, p, device)
    bf16_slot = None
    for fmt in formats:
        model = run_section(results, out, f"model_{fmt}", p.budgets["model"], section_model, p, fmt,
                            Path(args.dir), device)
        if model["status"] != "ok":
            continue
        bf16_slot = bf16_slot or model["slot_bytes"]  # the first format run is the reference (bf16 first)
        rad = RadFile.open(model["path"])
        for share in SHARES:
            slots = min(model["routed_experts"], bf16_slot_count(results, share) * bf16_slot // model["slot_bytes"])
            name = f"slots_{fmt}_{round(share * 100)}"
            budget = p.budgets["slots" if any(k.startswith("slots_") for k in results) else "first_slots"]
            run_section(results, out, name, budget, section_slots, rad, p, device, slots)
        run_section(results, out, f"resident_{fmt}", p.budgets["resident"], section_resident, rad, p, device)
        rad.close()
        Path(model["path"]).unlink(missing_ok=True)
    print(render(results), flush=True)
    bad = [k for k, v in results.items() if isinstance(v, dict) and v.get("status") == "error"]
    return 1 if bad else 0


# -- the report ---------------------------------------------------------------------------------


def _ok(results: dict, name: str) -> dict | None:
    sec = results.get(name)
    return sec if isinstance(sec, dict) and sec.get("status") == "ok" else None


def floor_share(run: dict, extent: int, dense: int, hbm: float | None) -> tuple[float | None, float]:
    """(the run's share of its bytes floor, bytes a step): dense weights once a step plus each lookup's
    extent (a lookup counts an expert once a step and layer), over the HBM copy rate."""
    t = run_totals(run, extent)
    lookups = sum(s["lookups"] for s in run["steps"]) / max(1, len(run["steps"]))
    step_bytes = dense + lookups * extent
    return (step_bytes / hbm / t["step_s"] if hbm and t["step_s"] else None), step_bytes


def rows(results: dict) -> list[tuple[str, str, str, str, str]]:
    """(row, measured, reference (same run), ratio, note)."""
    h2d = gpu_bench._g(results.get("ceilings", {}), "host_links", "pinned_h2d", "bytes_per_s")
    hbm = gpu_bench._g(results.get("ceilings", {}), "hbm_copy", "bytes_per_s")
    out = [("pinned H2D", _f(h2d and h2d / 1e9, "{:.1f} GB/s"), "", "", "the overflow's link"),
           ("HBM copy (read+write)", _f(hbm and hbm / 1e12, "{:.2f} TB/s"), "", "", "the resident floor's rate")]
    formats = results.get("formats", [])
    base = formats[0] if formats else None
    for fmt in formats:
        model = _ok(results, f"model_{fmt}")
        if model is None:
            continue
        out.append((f"{fmt} model", f"experts {model['expert_format']}, {model['extent_bytes'] / MiB:.2f} MiB an "
                    f"extent", "", "", f"{model['routed_experts']} experts, {model['bytes'] / GiB:.2f} GiB file, "
                    f"made in {model['seconds']:.0f} s"))
        for share in SHARES:
            out += _slots_row(results, fmt, base, share, h2d)
        out += _resident_rows(results, fmt, base, model, hbm)
    for name, sec in results.items():
        if isinstance(sec, dict) and sec.get("status") in ("error", "skipped"):
            out.append((f"section {name}", sec["status"], "", "", (sec.get("error") or sec.get("why") or "")[:300]))
    return out


def _slots_row(results: dict, fmt: str, base: str | None, share: float, h2d) -> list:
    pct = round(share * 100)
    sec, ref = _ok(results, f"slots_{fmt}_{pct}"), _ok(results, f"slots_{base}_{pct}")
    if sec is None or not sec["run"]["steps"]:
        return []
    t = run_totals(sec["run"], sec["extent_bytes"])
    r = run_totals(ref["run"], ref["extent_bytes"]) if ref and ref["run"]["steps"] else None
    per_token = t["miss_bytes"] / t["tokens"] if t["tokens"] else None
    return [(f"{fmt} decode c=1, {pct}% of {base}'s slot bytes ({sec['expert_slots']} slots)",
             f"{_f(t['tok_s'])} tok/s, hit {_f(t['hit_rate'] and 100 * t['hit_rate'], '{:.0f}%')}",
             f"{base} {_f(r and r['tok_s'])} tok/s" if r else "",
             _f(r and t["tok_s"] / r["tok_s"], "{:.2f}x") if r else "",
             f"overflow {_f(per_token and per_token / MiB, '{:.1f}')} MiB a token, "
             f"{_f(t['overflow_bytes_per_s'] and h2d and 100 * t['overflow_bytes_per_s'] / h2d, '{:.0f}%')} of "
             f"pinned H2D; {t['steps']} steps")]


def _resident_rows(results: dict, fmt: str, base: str | None, model: dict, hbm) -> list:
    sec, ref = _ok(results, f"resident_{fmt}"), _ok(results, f"resident_{base}")
    if sec is None:
        return []
    out = []
    for run in sec["runs"]:
        if not run["steps"]:
            continue
        c = run["concurrency"]
        t = run_totals(run, sec["extent_bytes"])
        share, step_bytes = floor_share(run, sec["extent_bytes"], model["dense_bytes"], hbm)
        ref_run = next((x for x in ref["runs"] if x["concurrency"] == c and x["steps"]), None) if ref else None
        ref_share = floor_share(ref_run, ref["extent_bytes"], _ok(results, f"model_{base}")["dense_bytes"],
                                hbm)[0] if ref_run else None
        out.append((f"{fmt} resident decode c={c}", f"{_f(t['tok_s'])} tok/s, {_f(t['step_s'] * 1e3, '{:.3f}')} ms "
                    "a step", f"floor {_f(step_bytes / hbm * 1e3 if hbm else None, '{:.3f}')} ms "
                    f"({step_bytes / MiB:.0f} MiB a step)", _f(share and 100 * share, "{:.0f}% of floor"),
                    f"{base}: {_f(ref_share and 100 * ref_share, '{:.0f}%')} of its own floor"))
    return out


def render(results: dict) -> str:
    env = results.get("env", {})
    title = (f"## compact experts through the tiers: {env.get('device', results.get('device_type'))}, "
             f"{env.get('date_utc', '')}, commit {env.get('commit', '-')}"
             + (" (**CPU dry run: the numbers describe nothing**)" if results.get("quick") else ""))
    lines = [title, "", "| row | measured | reference (same run) | ratio | note |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows(results)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a dry run of the code)")
    ap.add_argument("--formats", default="bf16,fp8,int4", help="the first is every ratio's reference")
    ap.add_argument("--dir", default="/var/tmp", help="folder for the models")
    args = ap.parse_args(argv)
    bad = set(args.formats.split(",")) - set(FORMATS)
    if bad:
        ap.error(f"--formats: unknown {', '.join(sorted(bad))}; choose from {', '.join(FORMATS)}")
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
