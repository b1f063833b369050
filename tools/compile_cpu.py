"""Does torch.compile (inductor, CPU) pay on the host backend's decode step? (issue 23)

    python tools/compile_cpu.py --out DIR [--models default,q4_1,tiny] [--batches 1,8] [--rounds 5]
                                [--steps 8] [--variants ops,layer,model]

For each model (the default SmolLM2-135M fp32 .rad, its Q4_1 conversion, the tiny
families converted from transformers) a worker process per inductor cache state builds
the engine as the daemon does (`Engine.build`, 2 torch threads) and, for each variant,
installs torch.compile(dynamic=True) around one piece of the eager model, without
changing radianced/:

- ops:   the host backend's ops one by one (`ops.rms_norm`, `linear`, `silu_mlp` rebound to compiled
         `kernels/cpu.py` functions, and inside `rotary_paged_attention` its `rotary_qk` and
         `paged_attention`);
- layer: each decoder layer's `__call__` (one compiled function shared by the layers);
- model: `CausalLM.forward` whole.

In each the KV cache write (`cpu.write_kv`) runs eager (dynamo-disabled): see KV_WRITE below.
The first worker runs with an empty inductor cache (cold: the compile times only); the
second with the cache the first left (warm) measures everything: the first step's
seconds per variant and batch (compile + step), the graphs and graph breaks (dynamo's
counters, `torch._dynamo.explain` of one decode layer), step times eager against
compiled as medians of interleaved rounds (variant order rotated per round) of
`--steps` `Engine.step()` calls each, the new graphs over 20 random batches (1..8
sequences, prompt lengths 1..600), fp32 logits and greedy tokens over 64 steps compiled
against eager (a fresh engine each), and RSS (VmRSS) after each stage. Writes
DIR/compile_cpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radianced.card import Card  # noqa: E402
from radianced.config import Config  # noqa: E402
from radianced.engine.engine import Engine  # noqa: E402
from radianced.engine.request import Request  # noqa: E402
from radianced.engine.sampling_params import SamplingParams  # noqa: E402
from radianced.kernels import cpu, ops  # noqa: E402
from radianced.model.rad import RadFile  # noqa: E402

CACHE = Path.home() / ".cache/radianced"
MODELS = {"default": CACHE / "smollm2-135m-instruct.rad", "q4_1": CACHE / "smollm2-135m-instruct-q4_1.rad"}
TINY = ("llama", "qwen3_moe", "qwen3_next")
CPU_OPS = ("rms_norm", "linear", "silu_mlp")  # bound through ops; the attention's pieces through cpu's globals:
ATTENTION_PIECES = ("rotary_qk", "paged_attention")  # cpu.rotary_paged_attention stays eager around them
# KV_WRITE: compiled, `write_kv`'s index_put_ into the k and v caches (two views of one arena page tensor) is a
# mutation of aliased graph inputs. With it compiled (this tool's first run, q4_1, the ops variant) the b1 step
# took 1,128 ms against 34 ms eager; AOTAutograd's synthetic base for aliased mutated inputs (a copy of their
# whole storage) is the likely cause, not profiled. So every variant leaves it eager.
WRITE_KV = cpu.write_kv
_EAGER_WRITE_KV = torch._dynamo.disable(WRITE_KV)
EAGER = {n: getattr(cpu, n) for n in CPU_OPS + ATTENTION_PIECES}
PROMPT = 200  # prompt tokens of the timed sequences (the lead's profile: /tmp/prof_cpu.py)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def graphs() -> int:
    """Graphs dynamo has compiled in this process so far (each recompile is one more)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class Variant:
    """One way of compiling the eager model; `on(engine)` installs it, `off(engine)` restores eager.
    The compiled callables are made once per variant, so rounds reuse dynamo's cache."""

    def __init__(self, name: str):
        self.name = name
        self._ops = ({n: torch.compile(getattr(cpu, n), dynamic=True) for n in CPU_OPS + ATTENTION_PIECES}
                     if name == "ops" else {})
        self._fn, self._layer_fns = None, {}

    def on(self, engine: Engine) -> None:
        model = engine.runner.model
        cpu.write_kv = _EAGER_WRITE_KV  # the KV write stays eager in every variant (KV_WRITE says why)
        if self.name == "ops":
            for n, f in self._ops.items():
                setattr(ops if n in CPU_OPS else cpu, n, f)
        elif self.name == "layer":  # one compiled __call__ per layer class (Qwen3-Next has two)
            fns = self._layer_fns
            for kind in {type(layer) for layer in model.layers} - fns.keys():
                fns[kind] = torch.compile(kind.__call__, dynamic=True)
            model.layers = [_Bound(fns[type(layer)], layer) for layer in model.layers]
        elif self.name == "model":
            if self._fn is None:
                self._fn = torch.compile(type(model).forward, dynamic=True)
            fn = self._fn
            model.forward = lambda batch, cache, hidden=False: fn(model, batch, cache, hidden)

    def off(self, engine: Engine) -> None:
        model = engine.runner.model
        cpu.write_kv = WRITE_KV
        if self.name == "ops":
            for n in self._ops:
                setattr(ops if n in CPU_OPS else cpu, n, EAGER[n])
        elif self.name == "layer":
            model.layers = [b.layer for b in model.layers]
        elif self.name == "model":
            model.__dict__.pop("forward")


class _Bound:
    """A decoder layer called through the shared compiled `__call__`."""

    def __init__(self, fn, layer):
        self.fn, self.layer = fn, layer

    def __call__(self, x, rope, batch, cache):
        return self.fn(self.layer, x, rope, batch, cache)


def build(rad: RadFile) -> Engine:
    cfg = Config(max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=512)
    return Engine.build(rad, cfg, Card.from_mib(1024))


def add(engine: Engine, batch: int, tag: str, lengths=None, max_tokens: int = 4000) -> None:
    vocab = engine.runner.model.cfg.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        n = PROMPT if lengths is None else lengths[i]
        engine.add(Request(f"{tag}{i}", tuple((100 + i + j) % (vocab - 3) for j in range(n)), params))


def drain(engine: Engine) -> None:
    while engine.scheduler.has_unfinished:
        engine.step()


def timed(engine: Engine, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        out.append(time.perf_counter() - t)
    return out


def first_steps(engine: Engine, variants: list[Variant], batch: int) -> dict:
    """Seconds of each variant's first decode step at `batch` (its compile, cold or from the cache),
    and the graphs it made; the prompts are prefilled eagerly first."""
    add(engine, batch, f"w{batch}-")
    while engine.scheduler.waiting or any(len(s.token_ids) == s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    eager = statistics.median(timed(engine, 5))
    out = {"eager_step_s": eager}
    for v in variants:
        g = graphs()
        v.on(engine)
        t = time.perf_counter()
        engine.step()
        first = time.perf_counter() - t
        second = statistics.median(timed(engine, 2))
        v.off(engine)
        out[v.name] = {"first_step_s": first, "then_step_s": second, "graphs": graphs() - g, "rss_mib": rss_mib()}
    return out


def rounds(engine: Engine, variants: list[Variant], rounds_: int, steps: int) -> dict:
    """Median step seconds per variant (and eager) over interleaved rounds, order rotated per round."""
    names = ["eager"] + [v.name for v in variants]
    by = {n: [] for n in names}
    g = graphs()
    for r in range(rounds_):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            v = next((v for v in variants if v.name == n), None)
            if v:
                v.on(engine)
            by[n] += timed(engine, steps)
            if v:
                v.off(engine)
    return {"median_ms": {n: 1e3 * statistics.median(t) for n, t in by.items()},
            "graphs_during_rounds": graphs() - g}


def random_batches(engine: Engine, v: Variant, n: int = 20, seed: int = 0) -> dict:
    """New graphs while serving n random batches (1..8 sequences, prompts of 1..600 tokens, 3 tokens)."""
    rng = random.Random(seed)
    g, t = graphs(), time.perf_counter()
    v.on(engine)
    for i in range(n):
        b = rng.randint(1, 8)
        add(engine, b, f"rnd{i}-", [rng.randint(1, 600) for _ in range(b)], max_tokens=3)
        drain(engine)
    v.off(engine)
    return {"batches": n, "new_graphs": graphs() - g, "seconds": time.perf_counter() - t}


def exactness(rad: RadFile, v: Variant | None, batch: int, steps: int = 64) -> dict:
    """Greedy tokens and fp32 logits of `steps` steps on a fresh engine, `v` compiled (None: eager)."""
    engine = build(rad)
    model = engine.runner.model
    if v is not None:
        v.on(engine)
    inner, logits = model.forward, []

    def record(batch_, cache, hidden=False):
        out = inner(batch_, cache, hidden)
        logits.append((out[0] if hidden else out).float().clone())
        return out

    model.forward = record  # an instance attribute over the class's forward (or over the model variant's)
    add(engine, batch, "x", [17 + 5 * i for i in range(batch)], max_tokens=steps)
    tokens: dict[str, list[int]] = {}
    while engine.scheduler.has_unfinished:
        for ev in engine.step():
            tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
    model.forward = inner
    if v is not None:
        v.off(engine)
    return {"tokens": tokens, "logits": logits}


def compare(a: dict, b: dict) -> dict:
    rel = max(float((x - y).abs().max() / x.abs().max()) for x, y in zip(a["logits"], b["logits"]) if x.numel())
    return {"tokens_identical": a["tokens"] == b["tokens"], "max_rel_err_logits": rel,
            "steps": len(a["logits"])}


def explain(engine: Engine) -> dict:
    """Graphs and breaks of one decoder layer's call at a b1 decode step (dynamo's explain)."""
    layer, seen = engine.runner.model.layers[0], {}

    def grab(x, rope, batch, cache):
        if "r" not in seen:
            e = torch._dynamo.explain(type(layer).__call__)(layer, x, rope, batch, cache)
            seen["r"] = {"graphs": e.graph_count, "breaks": e.graph_break_count,
                         "reasons": sorted({str(r.reason).splitlines()[0][:200] for r in e.break_reasons})}
        return type(layer).__call__(layer, x, rope, batch, cache)

    engine.runner.model.layers[0] = grab
    add(engine, 1, "explain", max_tokens=2)
    with torch.inference_mode():
        drain(engine)
    engine.runner.model.layers[0] = layer
    return seen["r"]


def tiny_rads(tmp: Path) -> dict[str, RadFile]:
    from radianced.model.convert import convert
    from radianced.model.tiny import make_tiny
    out = {}
    for family in TINY:
        src = make_tiny(family, tmp / family)
        convert(src, src / "model.rad")
        out[family] = RadFile.open(src / "model.rad")
    return out


def worker(args) -> None:
    """Measure every model of --models; the result is written to --worker after each stage (a run cut
    short keeps what it measured)."""
    torch.set_num_threads(2)
    torch._dynamo.config.recompile_limit = 512  # 30 layers each a constant of its own (its cache index)
    torch._dynamo.config.accumulated_recompile_limit = 4096
    res: dict = {"rss_start_mib": rss_mib()}

    def save(res_: dict) -> None:
        args.worker.write_text(json.dumps(res_, indent=1))

    names = args.variants.split(",")
    for m in args.models.split(","):
        if m == "tiny":
            res["tiny"] = tiny_exactness(names)
            save(res)
            continue
        rad = RadFile.open(MODELS[m])
        variants = [Variant(n) for n in names]
        engine = build(rad)
        r = res[m] = {"rss_built_mib": rss_mib()}
        for b in map(int, args.batches.split(",")):
            r[f"first_b{b}"] = first_steps(engine, variants, b)
            save(res)
            if args.cold:
                drain_quick(engine)
                continue
            r[f"rounds_b{b}"] = rounds(engine, variants, args.rounds, args.steps)
            save(res)
            drain_quick(engine)
        if args.cold:
            continue
        r["explain_layer_b1"] = explain(engine)
        r["random_batches"] = {v.name: random_batches(engine, v, args.random) for v in variants if args.random}
        r["rss_after_mib"] = rss_mib()
        save(res)
        base = exactness(rad, None, 8)
        r["exact_b8"] = {v.name: compare(base, exactness(rad, v, 8)) for v in variants}
        save(res)


def drain_quick(engine: Engine) -> None:
    """Finish the running sequences (abort them: the timed ones ask for thousands of tokens)."""
    engine.scheduler.abort_all()


def tiny_exactness(names: list[str]) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for family, rad in tiny_rads(Path(d)).items():
            base = exactness(rad, None, 4)
            out[family] = {n: compare(base, exactness(rad, Variant(n), 4)) for n in names}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--models", default="default,q4_1,tiny")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--variants", default="ops,layer,model")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--random", type=int, default=20, help="random batches served per variant (0: none)")
    p.add_argument("--cold", action="store_true", help="(worker) first steps only")
    p.add_argument("--worker", type=Path, help="(worker) write the result here")
    p.add_argument("--report", type=Path, help="print the tables of a compile_cpu.json and exit")
    args = p.parse_args()
    if args.report:
        report(json.loads(args.report.read_text()))
        return
    if args.worker:
        worker(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"torch": torch.__version__, "load_before": os.getloadavg(), "argv": sys.argv[1:]}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for phase in ("cold", "warm"):
            out = args.out / f"worker-{phase}.json"
            models = ",".join(m for m in args.models.split(",") if m != "tiny" or phase == "warm")
            cmd = [sys.executable, __file__, "--out", str(args.out), "--worker", str(out), "--models", models,
                   "--batches", args.batches, "--variants", args.variants, "--rounds", str(args.rounds),
                   "--steps", str(args.steps), "--random", str(args.random)] + (["--cold"] if phase == "cold" else [])
            t = time.perf_counter()
            rc = subprocess.run(cmd, env=env).returncode  # a failed worker keeps the stages it saved
            result[phase] = {"seconds": time.perf_counter() - t, "rc": rc,
                             **(json.loads(out.read_text()) if out.exists() else {})}
    result["load_after"] = os.getloadavg()
    (args.out / "compile_cpu.json").write_text(json.dumps(result, indent=1))
    report(result)


def report(result: dict) -> None:
    """Markdown tables of the run: step medians, first steps (compile), exactness, graphs and RSS."""
    cold, warm = result["cold"], result["warm"]
    print("| model | batch | variant | step ms (median) | vs eager | first step s, cold | first step s, warm "
          "| graphs made (cold) |")
    print("|---|---|---|---|---|---|---|---|")
    for m, r in ((m, r) for m, r in warm.items() if isinstance(r, dict) and m != "tiny"):
        for key in [k for k in r if k.startswith("rounds_")]:
            b = key.split("_")[1]
            med = r[key]["median_ms"]
            print(f"| {m} | {b} | eager | {med['eager']:.1f} | 1.00x | | | |")
            for n, x in med.items():
                if n == "eager":
                    continue
                c, w = cold.get(m, {}).get(f"first_{b}", {}).get(n, {}), r[f"first_{b}"][n]
                print(f"| {m} | {b} | {n} | {x:.1f} | {med['eager'] / x:.2f}x | {c.get('first_step_s', float('nan')):.1f} "
                      f"| {w['first_step_s']:.1f} | {c.get('graphs', '')} |")
    print("\n| model | variant | greedy tokens identical (64 steps) | max rel err, fp32 logits |")
    print("|---|---|---|---|")
    rows = [(m, r["exact_b8"]) for m, r in warm.items() if isinstance(r, dict) and "exact_b8" in r]
    rows += list(warm.get("tiny", {}).items())
    for m, ex in rows:
        for n, e in ex.items():
            print(f"| {m} | {n} | {e['tokens_identical']} | {e['max_rel_err_logits']:.2e} |")
    for m, r in warm.items():
        if isinstance(r, dict) and "random_batches" in r:
            print(f"\n{m}: random batches {r['random_batches']}; explain (layer 0, b1) {r.get('explain_layer_b1')}; "
                  f"RSS MiB built {r['rss_built_mib']:.0f}, after all variants {r['rss_after_mib']:.0f}")


if __name__ == "__main__":
    main()
