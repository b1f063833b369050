"""Expert tiers on the device: decode through slots, host pool and disk tier, against measured ceilings.

    python tools/bench_tiers.py run --out OUT [--quick]   # -> OUT/tiers.json, OUT/tiers.md, OUT/tiers.log
    python tools/bench_tiers.py report --out OUT          # re-render OUT/tiers.md from OUT/tiers.json

Issue 7's "Prove it" device rows (bench/README.md, "Expert tiers"). One run:

1. ceilings: pinned host-to-device copy and O_DIRECT disk reads (tools/gpu_bench.py's
   `ceiling_host_links` and `ceiling_disk`; the latter also picks the folder, a local disk that
   takes O_DIRECT, where the model file is written);
2. a synthetic Qwen3-30B-A3B-shaped `.rad` (tools/make_synthetic.py: real per-layer shapes, random
   weights, a Zipf-skewed router), a few of the 48 layers so it fits the disk, RAM and time;
3. engines built with `Engine.build` as the daemon builds them, every expert's home in the host
   pool (`--host-pool-mib` holds them all) and `--expert-slots` = 100%, 25%, 10% and 50% of the
   experts: decode tok/s, slot hit rate and the overflow read rate (miss bytes per second) at
   concurrency 1 after a warm-up; at 100% and 25% also concurrency 2, 4 and 8;
4. the disk tier: `--host-pool-mib 0 --weights-disk-tier --expert-slots` small: the slab's disk
   bytes per second.

Every request has the same prompts and sampling seeds at every point (temperature 1, so the tokens,
and with them the routing, spread over the vocabulary as the router was fitted for). A step is timed
with the wall clock around `engine.step()` (it ends with the sampled tokens on the host, and the
between-step slot refills are synchronous copies), and the slab's counters are read around it.

Each section has a time budget: measurement loops stop at its soft deadline, and a hard alarm
(the budget plus a grace) ends a section that hangs. tiers.json is rewritten, and tiers.md
re-rendered, after every section, so a run cut short keeps what it measured. Without CUDA
(`--quick`, a dry run on a CPU) the sizes are tiny and the ratios empty: it proves the code runs.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

from radianced.config import Config  # noqa: E402
from radianced.engine.engine import Engine  # noqa: E402
from radianced.engine.request import Request  # noqa: E402
from radianced.engine.sampling_params import SamplingParams  # noqa: E402
from radianced.model.rad import RadFile  # noqa: E402
from radianced.sizing import ModelFacts, slot_bytes  # noqa: E402
from radianced.tiers.placement import routed_experts  # noqa: E402
from tools import gpu_bench  # noqa: E402
from tools.make_synthetic import make_synthetic, zipf_targets  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
PROMPT_TOKENS = 16
GRACE_S = 20  # past a section's budget before its alarm fires
COVERAGE = (1.0, 0.25, 0.10, 0.50)  # slot coverage points, in the order they run (most needed first)
CONCURRENCY = (1, 2, 4, 8)  # at 100% (the all-resident step time) and 25% coverage
DISK_CONCURRENCY = (1, 4)


@dataclass(frozen=True)
class Preset:
    layers: int
    narrow: int  # make_synthetic's width divisor
    vocab: int | None
    dtype: str
    zipf: float
    gpu_memory_mib: int
    warm: int  # decode steps before measuring (slots settle)
    steps: int  # decode steps measured (fewer if the section's deadline comes first)
    disk_warm: int
    disk_steps: int
    disk_slots: float  # --expert-slots of the disk-tier run, as a share of the experts
    h2d_bytes: int
    disk_bytes: int
    budgets: dict  # section -> seconds


FULL = Preset(layers=4, narrow=1, vocab=None, dtype="bf16", zipf=1.0, gpu_memory_mib=16384, warm=64, steps=128,
              disk_warm=4, disk_steps=32, disk_slots=1 / 32, h2d_bytes=GiB, disk_bytes=GiB,
              budgets={"ceilings": 25, "model": 50, "slots_100": 80, "slots_25": 40, "disk": 40, "slots_10": 25,
                       "slots_50": 25})
QUICK = Preset(layers=2, narrow=16, vocab=2048, dtype="f32", zipf=1.0, gpu_memory_mib=1024, warm=6, steps=8,
               disk_warm=2, disk_steps=4, disk_slots=1 / 32, h2d_bytes=64 * MiB, disk_bytes=256 * MiB,
               budgets={"ceilings": 60, "model": 60, "slots_100": 60, "slots_25": 60, "slots_10": 60, "disk": 60,
                        "slots_50": 60})


class SectionTimeout(Exception):
    """A section ran past its budget plus the grace."""


# -- engines and decoding ---------------------------------------------------------------------


def engine_for(rad: RadFile, p: Preset, device: str, **flags) -> Engine:
    """An engine over `rad` as the daemon builds it, with these flags (Config fields)."""
    cfg = Config(max_model_len=1024, max_num_seqs=max(CONCURRENCY), max_num_batched_tokens=256,
                 gpu_memory_mib=p.gpu_memory_mib, **flags)
    return Engine.build(rad, cfg, device=device)


def host_pool_mib(rad: RadFile) -> int:
    """A host pool that holds every routed expert (one slot-sized row each)."""
    facts = ModelFacts.from_header(rad.header)
    return -(-len(routed_experts(rad.header)) * slot_bytes(facts.expert_extent_bytes) // MiB) + 1


def _counters(engine: Engine) -> tuple[int, ...]:
    s = engine.experts.stats
    return s.total_lookups, s.total_hits, sum(s.routed.values()), s.refills, s.disk_reads, s.disk_bytes


def _step(engine: Engine, device: str) -> tuple[float, int, tuple[int, ...]]:
    """One engine step: (seconds, tokens sampled, slab counter deltas)."""
    before = _counters(engine)
    t0 = time.perf_counter()
    events = engine.step()
    gpu_bench._sync(device)
    dt = time.perf_counter() - t0
    for ev in events:
        if ev.error:
            raise RuntimeError(f"request {ev.request_id} failed: {ev.error}")
    return dt, sum(len(ev.token_ids) for ev in events), tuple(b - a for a, b in zip(before, _counters(engine)))


def decode(engine: Engine, device: str, c: int, warm: int, steps: int, deadline: float, seed: int = 0) -> dict:
    """c requests with the same prompts and seeds at every point: prefill, `warm` decode steps, then up to
    `steps` measured ones (the warm-up stops early past half the time left to `deadline`, measuring
    at `deadline`). Returns the per-step records; the requests are cancelled at the end."""
    vocab = engine.runner.vocab_size
    g = torch.Generator().manual_seed(seed)
    for i in range(c):
        prompt = torch.randint(0, vocab, (PROMPT_TOKENS,), generator=g).tolist()
        params = SamplingParams(temperature=1.0, max_tokens=warm + steps + 2, ignore_eos=True, seed=seed + i)
        engine.add(Request(f"c{c}-{i}", tuple(prompt), params))
    try:
        t0 = time.perf_counter()
        _, first, _ = _step(engine, device)
        if first != c:
            raise RuntimeError(f"the prefill step sampled {first} tokens for {c} requests (raise "
                               f"--max-num-batched-tokens)")
        warm_until = t0 + (deadline - t0) / 2
        warmed = 0
        while warmed < warm and time.perf_counter() < warm_until:
            _step(engine, device)
            warmed += 1
        records = []
        while len(records) < steps and (len(records) < 2 or time.perf_counter() < deadline):
            dt, tokens, d = _step(engine, device)
            records.append({"s": dt, "tokens": tokens, "lookups": d[0], "hits": d[1], "routed": d[2],
                            "refills": d[3], "disk_reads": d[4], "disk_bytes": d[5]})
    finally:
        engine.scheduler.abort_all()
    secs = sum(r["s"] for r in records)
    print(f"   c={c}: {len(records)} steps after {warmed} warm-up, {sum(r['tokens'] for r in records) / secs:.1f} tok/s",
          flush=True)
    return {"concurrency": c, "warm_steps": warmed, "steps": records}


def teardown(engine: Engine) -> None:
    """Before an engine goes (its device memory is freed once the section returns): close its expert
    loader and host pool (the pool's CUDA registration must go before its mapping does)."""
    engine.close()


def section_slots(rad: RadFile, p: Preset, device: str, share: float, deadline: float) -> dict:
    """Every expert in the host pool, `share` of them in slots: decode at c=1 (and 2, 4, 8 at 100%/25%)."""
    experts = len(routed_experts(rad.header))
    slots = round(share * experts)
    t0 = time.perf_counter()
    engine = engine_for(rad, p, device, host_pool_mib=host_pool_mib(rad), expert_slots=slots)
    out = {"share": share, "expert_slots": slots, "experts": experts, "build_s": time.perf_counter() - t0,
           "receipt": _receipt(engine), "extent_bytes": engine.experts.extent_bytes, "runs": []}
    try:
        levels = CONCURRENCY if share in (1.0, 0.25) else (1,)
        out["runs"] = runs(engine, device, levels, p.warm, p.steps, deadline)
        out["slots_at_end"] = engine.experts.num_slots
    finally:
        teardown(engine)
    return out


def runs(engine: Engine, device: str, levels, warm: int, steps: int, deadline: float) -> list[dict]:
    """`decode` at each concurrency, the time left to `deadline` shared equally among those not run yet."""
    out = []
    for i, c in enumerate(levels):
        share_of_rest = (deadline - time.perf_counter()) / (len(levels) - i)
        out.append(decode(engine, device, c, warm, steps, time.perf_counter() + share_of_rest))
    return out


def section_disk(rad: RadFile, p: Preset, device: str, deadline: float) -> dict:
    """No host pool, the disk tier on, few slots: what the disk tier reads per second while decoding."""
    experts = len(routed_experts(rad.header))
    slots = max(1, round(p.disk_slots * experts))
    t0 = time.perf_counter()
    engine = engine_for(rad, p, device, host_pool_mib=0, weights_disk_tier=True, expert_slots=slots)
    out = {"expert_slots": slots, "experts": experts, "build_s": time.perf_counter() - t0,
           "receipt": _receipt(engine), "extent_bytes": engine.experts.extent_bytes, "model": str(rad.path)}
    try:
        engine.experts.drain_disk_latencies()
        out["runs"] = runs(engine, device, DISK_CONCURRENCY, p.disk_warm, p.disk_steps, deadline)
        out["read_latency_s"] = _quantiles(engine.experts.drain_disk_latencies())
        out["slots_at_end"] = engine.experts.num_slots
    finally:
        teardown(engine)
    return out


def _receipt(engine: Engine) -> dict:
    r = engine.receipt
    return {"mode": r.mode, "expert_slots": r.expert_slots, "experts_pinned": r.experts_pinned,
            "experts_host": r.experts_host, "experts_disk": r.experts_disk, "page_bytes": r.page_bytes,
            "arena_pages": r.arena_pages, "disk_buffer_pages": r.disk_buffer_pages, "lines": r.lines()}


def _quantiles(xs: list[float]) -> dict | None:
    if not xs:
        return None
    xs = sorted(xs)
    return {"n": len(xs), "median": statistics.median(xs), "p90": xs[int(0.9 * (len(xs) - 1))], "max": xs[-1]}


# -- model and ceilings -------------------------------------------------------------------------


def section_model(p: Preset, folder: Path, device: str) -> dict:
    """The synthetic .rad in `folder` (the disk the O_DIRECT ceiling measured)."""
    path = folder / f"radianced-tiers-{p.layers}l.rad"
    t0 = time.perf_counter()
    make_synthetic(path, layers=p.layers, zipf=p.zipf, dtype=p.dtype, vocab=p.vocab, narrow=p.narrow, device=device)
    rad = RadFile.open(path)
    m = rad.model
    return {"path": str(path), "bytes": path.stat().st_size, "seconds": time.perf_counter() - t0,
            "layers": p.layers, "of_layers": 48, "narrow": p.narrow, "dtype": p.dtype, "zipf": p.zipf,
            "hidden": m.hidden_size, "num_experts": m.num_experts, "top_k": m.num_experts_per_tok,
            "moe_intermediate": m.moe_intermediate_size, "vocab": m.vocab_size,
            "routed_experts": len(routed_experts(rad.header)),
            "extent_bytes": ModelFacts.from_header(rad.header).expert_extent_bytes}


def ideal_hit_rate(model: dict, share: float) -> float:
    """Batch 1: the hit rate if the slots held the most popular experts of the router's fitted target
    (make_synthetic's Zipf shares, the same in every layer)."""
    e, k, layers = model["num_experts"], model["top_k"], model["layers"]
    p = zipf_targets(e, k, model["zipf"], torch.arange(1, e + 1)).double()
    top = p.repeat(layers).sort(descending=True).values[:round(share * e * layers)]
    return float(top.sum() / (k * layers))


# -- sections with budgets ----------------------------------------------------------------------


def _alarm(signum, frame):
    raise SectionTimeout("past the section's budget plus the grace; what it measured so far is lost")


def run_section(results: dict, out: Path, name: str, budget: float, fn, *args, stem: str = "tiers",
                report=None) -> dict:
    """gpu_bench's section runner (records errors, rewrites OUT/STEM.json) under a soft deadline passed
    to `fn` as its last argument and a hard alarm at the budget plus the grace; re-renders OUT/STEM.md
    with `report` (default: this tool's `render`)."""
    deadline = time.perf_counter() + budget
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, budget + GRACE_S)
    try:
        res = gpu_bench._section(results, out / f"{stem}.json", name, fn, *args, deadline)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    gpu_bench._free_cuda()  # the section's engine is gone with its frame
    res["budget_s"] = budget
    gpu_bench._write_json(out / f"{stem}.json", results)
    (out / f"{stem}.md").write_text((report or render)(results))
    return res


def _ceilings(p: Preset, deadline: float) -> dict:
    out = {}
    for name, fn, arg in (("host_links", gpu_bench.ceiling_host_links, p.h2d_bytes),
                          ("disk_odirect", gpu_bench.ceiling_disk, p.disk_bytes)):
        try:
            out[name] = {"status": "ok", **fn(arg)}
        except gpu_bench.Skip as e:
            out[name] = {"status": "skipped", "why": str(e)}
    return out


def cmd_run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    p = QUICK if args.quick or device == "cpu" else FULL
    logging.basicConfig(filename=out / "tiers.log", level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    results: dict = {"quick": p is QUICK, "device_type": device, "preset": {k: v for k, v in vars(p).items()}}
    gpu_bench._section(results, out / "tiers.json", "env", gpu_bench.section_env, out)
    run_section(results, out, "ceilings", p.budgets["ceilings"], _ceilings, p)
    disk = results["ceilings"].get("disk_odirect", {})
    folder = Path(disk["dir"]) if disk.get("status") == "ok" else Path(args.dir)
    model = run_section(results, out, "model", p.budgets["model"], lambda d: section_model(p, folder, device))
    if model["status"] != "ok":
        print("no model: the device sections cannot run", flush=True)
        return 1
    rad = RadFile.open(model["path"])
    for share in COVERAGE:
        name = f"slots_{round(share * 100)}"
        run_section(results, out, name, p.budgets[name], section_slots, rad, p, device, share)
        if share == 0.25:  # the disk tier before the least needed point
            run_section(results, out, "disk", p.budgets["disk"], section_disk, rad, p, device)
    rad.close()
    Path(model["path"]).unlink(missing_ok=True)
    print(render(results), flush=True)
    bad = [k for k, v in results.items() if isinstance(v, dict) and v.get("status") == "error"]
    return 1 if bad else 0


# -- the report ---------------------------------------------------------------------------------


def run_totals(run: dict, extent: int) -> dict:
    """Sums over a run's measured steps: tok/s, hit rate, cold experts, miss and refill bytes."""
    st = run["steps"]
    secs = sum(s["s"] for s in st)
    tokens = sum(s["tokens"] for s in st)
    lookups, hits = sum(s["lookups"] for s in st), sum(s["hits"] for s in st)
    misses = lookups - hits
    return {"steps": len(st), "seconds": secs, "tokens": tokens, "tok_s": tokens / secs if secs else None,
            "step_s": secs / len(st) if st else None, "hit_rate": hits / lookups if lookups else None,
            "cold_per_step": misses / len(st) if st else None, "miss_bytes": misses * extent,
            "overflow_bytes_per_s": misses * extent / secs if secs else None,
            "refills_per_step": sum(s["refills"] for s in st) / len(st) if st else None,
            "refill_bytes": sum(s["refills"] for s in st) * extent,
            "disk_bytes_per_s": sum(s["disk_bytes"] for s in st) / secs if secs else None,
            "disk_reads_per_step": sum(s["disk_reads"] for s in st) / len(st) if st else None}


def _run_at(sec: dict | None, c: int) -> dict | None:
    if not sec or sec.get("status") != "ok":
        return None
    return next((r for r in sec["runs"] if r["concurrency"] == c and r["steps"]), None)


def predicted(run: dict, extent: int, resident_step_s: float, h2d: float, refills: bool = False) -> float:
    """Tok/s of the routing model: each step moves its cold experts (and with `refills` the slots it
    refilled) over the link at the measured pinned H2D rate on top of the all-resident step time."""
    st = run["steps"]
    moved = sum(s["lookups"] - s["hits"] + (s["refills"] if refills else 0) for s in st) * extent
    return sum(s["tokens"] for s in st) / (moved / h2d + len(st) * resident_step_s)


def _f(v, fmt: str = "{:.1f}", none: str = "-") -> str:
    return none if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _gbs(v) -> str:
    return _f(None if v is None else v / 1e9, "{:.2f} GB/s")


def _pct(v) -> str:
    return _f(None if v is None else 100 * v, "{:.0f}%")


def rows(results: dict) -> list[tuple[str, str, str, str, str]]:
    """(row, measured, ceiling / prediction, ratio, note) for the table."""
    ceil = results.get("ceilings", {})
    h2d = gpu_bench._g(ceil, "host_links", "pinned_h2d", "bytes_per_s")
    disk = gpu_bench._g(ceil, "disk_odirect", "best_read_bytes_per_s")
    reads = gpu_bench._g(ceil, "disk_odirect", "reads") or {}
    threads = " / ".join(f"{_gbs(r['bytes_per_s'])} x{k}" for k, r in reads.items())
    out = [("pinned H2D", _gbs(h2d), "", "", "ceiling (tools/gpu_bench.py ceiling_host_links)"),
           ("O_DIRECT read", _gbs(disk), "", "", f"ceiling, the best of {threads or '-'} threads; "
            f"{gpu_bench._g(ceil, 'disk_odirect', 'fstype')} at {gpu_bench._g(ceil, 'disk_odirect', 'dir')}")]
    model = results.get("model", {})
    if model.get("status") == "ok":
        out.append(("model", f"{model['layers']} of {model['of_layers']} layers, {model['routed_experts']} experts of "
                    f"{model['extent_bytes'] / MiB:.2f} MiB", "", "",
                    "synthetic Qwen3-30B-A3B shapes"
                    + (f" (width / {model['narrow']})" if model["narrow"] != 1 else "") + f", zipf {model['zipf']}, "
                    f"{model['bytes'] / GiB:.2f} GiB file"))
    resident = {c: run_totals(r, results["slots_100"]["extent_bytes"]) for c in CONCURRENCY
                if (r := _run_at(results.get("slots_100"), c))}
    for share in sorted(COVERAGE, reverse=True):
        out += _coverage_row(results, share, h2d, resident.get(1), model)
    out += _concurrency_rows(results, h2d, resident)
    out += _disk_rows(results, disk)
    for name, sec in results.items():
        if isinstance(sec, dict) and sec.get("status") in ("error", "skipped"):
            out.append((f"section {name}", sec["status"], "", "", (sec.get("error") or sec.get("why") or "")[:300]))
    return out


def _coverage_row(results: dict, share: float, h2d, resident1: dict | None, model: dict) -> list:
    sec = results.get(f"slots_{round(share * 100)}")
    run = _run_at(sec, 1)
    if run is None:
        return []
    t = run_totals(run, sec["extent_bytes"])
    ideal = ideal_hit_rate(model, share) if model.get("status") == "ok" else None
    rate = t["overflow_bytes_per_s"]
    extra = linked = None
    if resident1 and t["step_s"] and t["step_s"] > resident1["step_s"]:
        beyond = t["seconds"] - t["steps"] * resident1["step_s"]  # the step time past the all-resident step
        extra, linked = t["miss_bytes"] / beyond, (t["miss_bytes"] + t["refill_bytes"]) / beyond
    name = f"decode c=1, slots {round(share * 100)}% ({sec['expert_slots']}/{sec['experts']})"
    return [(name, f"{_f(t['tok_s'])} tok/s, hit {_pct(t['hit_rate'])}", f"ideal hit {_pct(ideal)}", "",
             f"{_f(t['step_s'] and t['step_s'] * 1e3, '{:.2f}')} ms/step, {t['steps']} steps after "
             f"{run['warm_steps']} warm-up; {_f(t['cold_per_step'])} cold experts and "
             f"{_f(t['refills_per_step'])} refills per step"),
            (f"  overflow read rate, slots {round(share * 100)}%", _gbs(rate), f"pinned H2D {_gbs(h2d)}",
             _pct(rate / h2d) if rate is not None and h2d else "",
             f"over the step time beyond the all-resident step: {_gbs(extra)} = "
             f"{_pct(extra / h2d) if extra and h2d else '-'} of H2D; misses and refill copies together: "
             f"{_gbs(linked)} = {_pct(linked / h2d) if linked and h2d else '-'}")]


def _concurrency_rows(results: dict, h2d, resident: dict) -> list:
    sec = results.get("slots_25")
    base = run_totals(r, sec["extent_bytes"]) if (r := _run_at(sec, 1)) else None
    out = []
    for c in CONCURRENCY:
        run = _run_at(sec, c)
        if run is None:
            continue
        t = run_totals(run, sec["extent_bytes"])
        res = resident.get(c)
        pred = predicted(run, sec["extent_bytes"], res["step_s"], h2d) if res and h2d else None
        pred_r = predicted(run, sec["extent_bytes"], res["step_s"], h2d, refills=True) if res and h2d else None
        below = base and t["tok_s"] < base["tok_s"]
        out.append((f"aggregate c={c}, slots 25%", f"{_f(t['tok_s'])} tok/s",
                    f"predicted {_f(pred)} tok/s", _f(pred and t["tok_s"] / pred, "{:.2f}"),
                    f"all-resident {_f(res and res['tok_s'])} tok/s; {_f(t['cold_per_step'])} cold experts/step, "
                    f"hit {_pct(t['hit_rate'])}; with refills predicted {_f(pred_r)}"
                    + ("; BELOW c=1" if below else "")))
    return out


def _disk_rows(results: dict, disk) -> list:
    sec = results.get("disk")
    out = []
    for c in DISK_CONCURRENCY:
        run = _run_at(sec, c)
        if run is None:
            continue
        t = run_totals(run, sec["extent_bytes"])
        rate = t["disk_bytes_per_s"]
        out.append((f"disk tier c={c}, slots {sec['expert_slots']}/{sec['experts']}, no host pool", _gbs(rate),
                    f"O_DIRECT {_gbs(disk)}", _pct(rate / disk) if rate is not None and disk else "",
                    f"{_f(t['tok_s'], '{:.2f}')} tok/s, {_f(t['disk_reads_per_step'])} expert reads/step, "
                    f"hit {_pct(t['hit_rate'])}"))
    lat = sec.get("read_latency_s") if out else None
    if lat:
        out.append(("  disk read latency (both runs)", f"median {lat['median'] * 1e3:.1f} ms", "", "",
                    f"p90 {lat['p90'] * 1e3:.1f} ms, max {lat['max'] * 1e3:.1f} ms over {lat['n']} reads, "
                    f"submission to completion"))
    return out


def render(results: dict) -> str:
    env = results.get("env", {})
    title = (f"## radianced bench_tiers: {env.get('date_utc', '?')}, {env.get('device', '?')}, "
             f"commit {env.get('commit', '?')}, fingerprint {env.get('fingerprint', '?')}, torch {env.get('torch', '?')}")
    lines = [title, ""]
    if results.get("quick"):
        lines += ["**Dry run (--quick or no CUDA): tiny sizes; the numbers describe this machine, not the device.**", ""]
    lines += ["| row | measured | ceiling / prediction (same run) | ratio | note |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows(results)]
    return "\n".join(lines) + "\n"


def cmd_report(args) -> int:
    import json

    results = json.loads((Path(args.out) / "tiers.json").read_text())
    text = render(results)
    (Path(args.out) / "tiers.md").write_text(text)
    print(text)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure; write OUT/tiers.json, tiers.md, tiers.log")
    r.add_argument("--out", required=True)
    r.add_argument("--quick", action="store_true", help="tiny sizes (a dry run of the code)")
    r.add_argument("--dir", default="/var/tmp", help="folder for the model if the O_DIRECT ceiling found none")
    s = sub.add_parser("report", help="re-render OUT/tiers.md from OUT/tiers.json")
    s.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    return cmd_run(args) if args.cmd == "run" else cmd_report(args)


if __name__ == "__main__":
    raise SystemExit(main())
