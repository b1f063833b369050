"""Issue 24's peer row: transformers + accelerate offload against radianced, the same weights, the same card budget.

    python tools/bench_peer_offload.py --out DIR [--layers 24] [--card-gib 24] [--tokens 24] [--quick] \
        [--time-limit 390] [--systems ours,theirs,llama_cpp] [--llama-bench PATH]

One random bf16 model of Qwen3-30B-A3B's real widths, `--layers` deep, is made once
by transformers (`from_config` of a `Qwen3MoeConfig`, every matrix then drawn from a
seeded normal with std 0.02, the router's too, norms 1: routing is near uniform),
saved as a Hugging Face safetensors folder and converted to `.rad` by the project's
own converter (`radianced.model.convert_hf`), so both systems serve the same weights.
The random numbers are drawn on the GPU where there is one (29 GiB at 24 layers: seconds
there, minutes on a CPU); the weights reach each system from the files, as a user's would.

- radianced: `Engine.build(rad, Config(gpu_memory_mib=card budget, host_pool_mib=
  every expert))`, as the daemon builds it; the experts that do not fit the card's
  slots are read from the pinned host pool. Measured: TTFT, decode tok/s (`Engine.step`,
  one after another), the slots' hit rate and the overflow bytes read per token.
- llama.cpp (`--systems ...,llama_cpp`): llama-bench on the same weights as a GGUF, the routed experts of
  as few layers as the card budget needs kept in host RAM (`--n-cpu-moe`): tools/peer_llama_cpp.py.
- transformers + accelerate: `from_pretrained(folder, device_map="auto", max_memory={0:
  card budget, "cpu": the rest}, dtype=bfloat16)`, the offload people reach for; a
  greedy loop over its DynamicCache. Measured: load time, where accelerate put the model
  (bytes and decoder layers per device), TTFT, decode tok/s.

Both decode the same fixed prompts greedily: b1 one prompt, b8 eight others (no
prefix-cache hits between the runs); each system first decodes a warm-up prompt.
Their tokens are compared position by position (bf16 on a GPU: not expected equal
throughout; the count is reported, not asserted). radianced runs first, then gives the
card back before transformers loads.

Writes DIR/peer_offload.json (every number, rewritten after each section) and
DIR/peer_offload.md (the table, re-rendered after each section; printed last). A
section past `--time-limit` is skipped and a decode loop stops there (it keeps the
steps it timed). `--quick`, or no CUDA: width / 16, 2 layers, a 4,096-token vocabulary
on the CPU, where radianced gets half the experts' slots (`--expert-slots`) and
accelerate half the model's bytes of CPU memory (the rest offloaded to disk): it proves
the code paths, nothing about speed.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

from tools import gpu_bench  # noqa: E402
from tools.make_synthetic import _tokenizer_json, shape_config  # noqa: E402
from tools.peer_llama_cpp import section_llama_cpp  # noqa: E402
from tools.peer_report import render  # noqa: E402
from tools.peer_transformers import greedy, hf_config, load_offloaded  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
SHAPE = "qwen3-30b-a3b"
SEED = 0


@dataclass(frozen=True)
class Sizes:
    """What one run builds and measures (the device's sizes, or the CPU dry run's)."""

    quick: bool
    device: str
    layers: int
    narrow: int
    vocab: int | None
    card_mib: int
    prompt: int  # tokens of each prompt
    tokens: int  # greedy tokens generated per sequence
    batches: tuple[int, ...] = (1, 8)

    @classmethod
    def pick(cls, args) -> Sizes:
        if args.quick or not torch.cuda.is_available():
            return cls(True, "cpu", 2, 16, 4096, 0, 16, 16)
        return cls(False, "cuda", args.layers, 1, None, args.card_gib * 1024, 64, args.tokens)


class Run:
    """What the sections share: sizes, deadline, files, prompts, the results and where they go."""

    def __init__(self, sizes: Sizes, out: Path, deadline: float):
        self.sizes, self.out, self.deadline = sizes, out, deadline
        self.results: dict = {"quick": sizes.quick, "sizes": asdict(sizes)}
        self.hf_dir = self.rad_path = None
        self.tmp: list[tempfile.TemporaryDirectory] = []
        self.prompts: dict[str, list[list[int]]] = {}

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise gpu_bench.Skip("past --time-limit; skipped so the run ends in time")

    def past_deadline(self) -> bool:
        return time.monotonic() > self.deadline

    def section(self, name: str, fn, *args) -> dict:
        """gpu_bench's section runner (errors recorded, JSON rewritten); then the table re-rendered."""
        res = gpu_bench._section(self.results, self.out / "peer_offload.json", name, fn, *args)
        gpu_bench._free_cuda()
        (self.out / "peer_offload.md").write_text(render(self.results))
        return res


# -- the model, once, in both formats ------------------------------------------------------------


def pick_dir(need: int, candidates, taken: dict[int, int] | None = None) -> Path:
    """The first existing folder of `candidates` with `need` bytes free (plus 2 GiB), after `taken`
    (filesystem id -> bytes this run will write there)."""
    taken = taken or {}
    for d in filter(None, candidates):
        p = Path(d)
        if p.is_dir() and shutil.disk_usage(p).free - taken.get(p.stat().st_dev, 0) > need + 2 * GiB:
            return p
    raise RuntimeError(f"no folder among {', '.join(filter(None, candidates))} has {need / GiB:.1f} GiB free; "
                       f"set RADIANCED_DISK_DIR to a folder that has, or pass fewer --layers")


def section_model(run: Run) -> dict:
    """Random weights in transformers -> a safetensors folder (tmpfs if it has room) -> `.rad` on disk."""
    from transformers import AutoModelForCausalLM

    from radianced.model.convert_hf import convert_hf
    from radianced.model.tiny import _use_hub_spelling

    s = run.sizes
    m = shape_config(SHAPE, s.layers, s.narrow, s.vocab)
    gen_device = "cuda" if torch.cuda.is_available() and not s.quick else "cpu"
    t0 = time.perf_counter()
    with torch.device(gen_device):
        model = AutoModelForCausalLM.from_config(hf_config(m), dtype=torch.bfloat16).eval()
    g = torch.Generator(device=gen_device).manual_seed(SEED)
    with torch.no_grad():  # init leaves the router at zero (every token the same experts)
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02, generator=g)
            else:
                p.fill_(1.0)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    disk = os.environ.get("RADIANCED_DISK_DIR")
    hf_root = pick_dir(nbytes, (disk, "/dev/shm", "/var/tmp", "/tmp"))
    rad_root = pick_dir(nbytes, (disk, "/var/tmp", "/tmp"), {hf_root.stat().st_dev: nbytes})
    run.tmp = [tempfile.TemporaryDirectory(prefix="radianced-peer-hf-", dir=hf_root),
               tempfile.TemporaryDirectory(prefix="radianced-peer-rad-", dir=rad_root)]
    run.hf_dir, run.rad_path = Path(run.tmp[0].name), Path(run.tmp[1].name) / "model.rad"
    made = time.perf_counter()
    model.save_pretrained(run.hf_dir, max_shard_size="4GB")  # shard by shard through host RAM
    del model
    gpu_bench._free_cuda()
    _use_hub_spelling(run.hf_dir / "config.json")
    (run.hf_dir / "tokenizer.json").write_text(_tokenizer_json(m.vocab_size))
    saved = time.perf_counter()
    convert_hf(run.hf_dir, run.rad_path)
    g = torch.Generator().manual_seed(SEED + 1)
    for name, n in (("warm", 1), ("b1", 1), ("b8", 8)):  # b1 and b8: different prompts, no prefix hits
        run.prompts[name] = torch.randint(0, m.vocab_size - 3, (n, s.prompt), generator=g).tolist()
    return {"layers": s.layers, "real_layers": 48, "narrow": s.narrow, "vocab": m.vocab_size,
            "parameters_bytes": nbytes, "random_on": gen_device, "made_s": made - t0, "saved_s": saved - made,
            "converted_s": time.perf_counter() - saved, "hf_dir": str(run.hf_dir), "rad": str(run.rad_path),
            "hf_bytes": sum(f.stat().st_size for f in run.hf_dir.iterdir()), "rad_bytes": run.rad_path.stat().st_size,
            "prompts": run.prompts}


# -- radianced -------------------------------------------------------------------------------------


def section_ours(run: Run) -> dict:
    """Engine.build at the card budget, every expert's home in the host pool; warm-up, then b1 and b8."""
    from radianced.config import Config
    from radianced.engine.engine import Engine
    from radianced.model.rad import RadFile
    from tools.bench_tiers import host_pool_mib

    run.check_time()
    s = run.sizes
    rad = RadFile.open(run.rad_path)
    experts = len(rad.header.experts)
    flags = dict(host_pool_mib=host_pool_mib(rad), max_model_len=s.prompt + s.tokens + 16,
                 max_num_seqs=max(s.batches), max_num_batched_tokens=max(s.batches) * s.prompt,
                 max_queue=2 * max(s.batches))
    flags.update(dict(expert_slots=experts // 2) if s.quick else dict(gpu_memory_mib=s.card_mib))
    _reset_peak(s.device)
    t0 = time.perf_counter()
    engine = Engine.build(rad, Config(**flags), device=s.device, sampler_seed=0)
    out = {"flags": flags, "build_s": time.perf_counter() - t0, "experts": experts,
           "expert_slots": engine.experts.num_slots, "extent_bytes": engine.experts.extent_bytes,
           "receipt": engine.receipt.lines()}
    try:
        out["warm"] = rad_generate(run, engine, run.prompts["warm"], 3, "warm")
        for b in s.batches:
            if not run.past_deadline():
                out[f"b{b}"] = rad_generate(run, engine, run.prompts[f"b{b}"], s.tokens, f"b{b}")
        out["slots_at_end"] = engine.experts.num_slots
        out["peak_allocated_bytes"] = _peak(s.device)
    finally:
        engine.close()
        rad.close()
    return out


def _counters(engine) -> tuple[int, int, int]:
    st = engine.experts.stats
    return st.total_lookups, st.total_hits, st.refills


def rad_generate(run: Run, engine, prompts: list[list[int]], tokens: int, tag: str) -> dict:
    """The prompts as greedy requests of `tokens` tokens, added at once and stepped to the end (or to the
    deadline: the rest are aborted). TTFT: until every sequence has its first token; the decode's
    tok/s, hit rate and overflow count the steps after that."""
    from radianced.engine.request import Request
    from radianced.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    got: dict[str, list[int]] = {i: [] for i in ids}
    steps, first, cut = [], None, False
    before = _counters(engine)  # reset at the first tokens: the decode's counters
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        engine.add(Request(rid, tuple(p), params))
    while engine.scheduler.has_unfinished:
        if first is not None and len(steps) >= 2 and run.past_deadline():
            engine.scheduler.abort_all()
            cut = True
            break
        ts = time.perf_counter()
        events = engine.step()
        gpu_bench._sync(run.sizes.device)
        te = time.perf_counter()
        for ev in events:
            if ev.error:
                raise RuntimeError(f"request {ev.request_id} failed: {ev.error}")
            got[ev.request_id] += ev.token_ids
        if first is not None:
            steps.append(te - ts)
        elif all(got.values()):
            first, before = te - t0, _counters(engine)
    after = _counters(engine)
    lookups, hits, refills = (a - b for a, b in zip(after, before))
    out = _decode_record(prompts, [got[i] for i in ids], first, steps, cut)
    overflow = (lookups - hits) * engine.experts.extent_bytes  # misses: read from the host pool
    out.update(lookups=lookups, hits=hits, hit_rate=hits / lookups if lookups else None, refills=refills,
               overflow_bytes=overflow, refill_bytes=refills * engine.experts.extent_bytes,
               overflow_bytes_per_token=overflow / out["decode_tokens"] if out["decode_tokens"] else None)
    return out


def _decode_record(prompts, tokens: list[list[int]], ttft: float, steps: list[float], cut: bool) -> dict:
    """One greedy run's numbers: the first token of each sequence, then `steps` timed decode steps."""
    decode_tokens = sum(len(t) for t in tokens) - len(tokens)
    seconds = sum(steps)
    return {"batch": len(prompts), "prompt_tokens": len(prompts[0]), "ttft_s": ttft, "decode_steps": len(steps),
            "decode_s": seconds, "decode_tokens": decode_tokens, "generated": sum(len(t) for t in tokens),
            "tokens_per_s": decode_tokens / seconds if seconds else None, "cut_at_deadline": cut, "step_s": steps,
            "tokens": tokens}


# -- transformers + accelerate ----------------------------------------------------------------------


def section_theirs(run: Run) -> dict:
    """from_pretrained with device_map="auto" and max_memory at the card budget; warm-up, b1, b8."""
    import psutil

    run.check_time()
    s = run.sizes
    if s.quick:  # the CPU stands in for the card: half the model in memory, the rest on disk
        max_memory = {"cpu": run.results["model"]["parameters_bytes"] // 2}
    else:
        max_memory = {0: s.card_mib * MiB, "cpu": int(psutil.virtual_memory().available * 0.8)}
    _reset_peak(s.device)
    model, out = load_offloaded(run.hf_dir, max_memory)
    device = "cuda:0" if s.device == "cuda" else "cpu"
    try:
        for name, tokens in (("warm", 3), *((f"b{b}", s.tokens) for b in s.batches)):
            if name == "warm" or not run.past_deadline():
                got, ttft, steps = greedy(model, run.prompts[name], tokens, device, run.past_deadline)
                out[name] = _decode_record(run.prompts[name], got, ttft, steps, len(got[0]) < tokens)
        out["peak_allocated_bytes"] = _peak(s.device)
    finally:
        del model
    return out


# -- both ----------------------------------------------------------------------------------------------


def section_compare(run: Run) -> dict:
    """Position-by-position agreement of the two systems' greedy tokens, per batch and sequence."""
    ours, theirs = run.results.get("ours", {}), run.results.get("theirs", {})
    out = {}
    for b in run.sizes.batches:
        a, t = ours.get(f"b{b}"), theirs.get(f"b{b}")
        if not a or not t:
            continue
        seqs = []
        for x, y in zip(a["tokens"], t["tokens"]):
            n = min(len(x), len(y))
            same = [i for i in range(n) if x[i] == y[i]]
            first_diff = next((i for i in range(n) if x[i] != y[i]), None)
            seqs.append({"compared": n, "equal": len(same), "first_difference": first_diff})
        out[f"b{b}"] = {"compared": sum(q["compared"] for q in seqs), "equal": sum(q["equal"] for q in seqs),
                        "sequences": seqs}
    if not out:
        raise gpu_bench.Skip("no batch ran on both systems")
    return out


def _reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> int | None:
    return torch.cuda.max_memory_allocated() if device == "cuda" else None


def section_env(out: Path) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    env = gpu_bench.section_env(out)
    for mod in ("accelerate", "safetensors"):
        try:
            env[mod] = version(mod)
        except PackageNotFoundError:
            env[mod] = "not installed (carry it: tools/fetch_wheels.sh)"
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--layers", type=int, default=24, help="decoder layers (of Qwen3-30B-A3B's 48; 24: ~29 GiB bf16)")
    ap.add_argument("--card-gib", type=int, default=24, help="the card budget for both systems")
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens per sequence (at least 16)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes on the CPU (automatic without CUDA)")
    ap.add_argument("--time-limit", type=float, default=390.0, help="seconds; later sections are skipped past it")
    ap.add_argument("--systems", default="ours,theirs", help="which of ours, theirs, llama_cpp run (after the model)")
    ap.add_argument("--llama-bench", type=Path, default=Path(".llama-cpp/build/bin/llama-bench"),
                    help="llama.cpp's llama-bench, for the llama_cpp system (tools/build_llama_cpp.sh)")
    args = ap.parse_args(argv)
    if args.tokens < 16 or args.layers < 1 or args.card_gib < 1:
        ap.error("--tokens must be at least 16, --layers and --card-gib at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(Sizes.pick(args), out, time.monotonic() + args.time_limit)
    # gpu_check's `timeout` ends a run past its limit with SIGTERM: exit through `finally`, so the
    # model's two copies (29 GiB at 24 layers, one of them perhaps in /dev/shm) are removed
    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run.section("env", section_env, out)
    try:
        systems = args.systems.split(",")
        if run.section("model", section_model, run)["status"] == "ok":
            if "theirs" not in systems:  # its safetensors folder (perhaps in /dev/shm) makes room for a GGUF
                run.tmp[0].cleanup()
            if "ours" in systems:
                run.section("ours", section_ours, run)
            if "theirs" in systems:
                run.section("theirs", section_theirs, run)
                run.section("compare", section_compare, run)
            if "llama_cpp" in systems:
                run.section("llama_cpp", section_llama_cpp, run, args.llama_bench, pick_dir)
    finally:
        for t in run.tmp:
            t.cleanup()
        signal.signal(signal.SIGTERM, old)
    gc.collect()
    print(render(run.results), flush=True)
    bad = [k for k, v in run.results.items() if isinstance(v, dict) and v.get("status") == "error"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
