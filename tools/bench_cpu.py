"""Issue 23's CPU benchmark: radianced through HTTP against transformers on the same weights, on
this machine, in one run, each against the bytes floor measured in the same run.

    python tools/bench_cpu.py --out DIR [--threads 1,2] [--tokens 128] [--concurrency 1,2,4,8]

For each torch thread count (RADIANCED_CPU_THREADS for the daemon, torch.set_num_threads here):
- the machine's memory read bandwidth: the best of five sums over a 512 MiB fp32 buffer
  (bytes / time); each b1 floor is that over the bytes a token reads (every weight once):
  transformers' fp32 parameter bytes (tied embeddings once), and radianced's as the host
  backend holds the default model (`served_bytes`: the GGUF's blocks, the tied Q8_0 lm_head, no
  embedding table: a token gathers one row);
- radianced (`python -m radianced.cli` on the default model, SmolLM2-135M from its bundled GGUF
  with its Q4_1 / Q8_0 blocks kept: model/default.py) through HTTP: c = 1, 2, 4, 8 concurrent streamed greedy completions of `--tokens` tokens
  (ignore_eos) on distinct prompts; aggregate tok/s (tokens / wall), per-request decode tok/s
  (1 / TPOT), TTFT; the RSS of the daemon and its HTTP front at idle and its peak under load (psutil, every
  50 ms, during one more pass at the largest c: sampled during the timed rows it took 10-15% of their tok/s);
  /health's worst latency while a 1,500-token prompt prefills (the event loop's responsiveness);
- transformers `generate` (fp32, the same GGUF, greedy, `--tokens` new tokens, min_new_tokens
  the same) at batch 1 and 8 on one 40-token prompt, run after the daemon has stopped, in a
  process of its own with OpenMP's settings as given (the daemon applies its own defaults:
  daemon.py; transformers is fastest with OpenMP's: on this shared 2-core machine 19.7 tok/s
  at b1 with 2 threads against 11.9 with OMP_WAIT_POLICY=PASSIVE).

- with `--llama-bench PATH` (llama.cpp's llama-bench: `tools/fetch_llama_cpp.sh` takes its source from
  llama-cpp-python's sdist on PyPI, `tools/build_llama_cpp.sh` builds it, about 4 minutes on this machine, so it is
  optional), llama.cpp on the same GGUF with as many threads: a 40-token prompt, and `--tokens` decoded at batch
  1 from an empty context (its own Q8_1 activations for the Q4_1 dot products). Left out without the flag.

Writes DIR/bench_cpu.json and DIR/bench_cpu.md (the table, printed last).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import torch

from radianced.bench.client import completion_body, stream_request
from radianced.bench.daemon_process import ChildDaemon, tree_rss_mib
from radianced.bench.workloads import prompt_ids
from radianced.kernels.compact import CompactWeight, RowStack
from radianced.model.default import bundled_gguf, ensure_default_model
from radianced.model.loader import load_model
from radianced.model.rad import RadFile

PROMPT_TOKENS = 40
LONG_PROMPT_TOKENS = 1500  # the prefill /health is timed against
BANDWIDTH_BYTES = 512 * 2**20


def read_bandwidth(threads: int) -> float:
    """GB/s of `x.sum()` over a buffer far larger than the caches: the best of five."""
    torch.set_num_threads(threads)
    x = torch.ones(BANDWIDTH_BYTES // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return BANDWIDTH_BYTES / best / 1e9


def served_bytes(model_path: Path) -> int:
    """Bytes of weights one decode token reads in the host backend's model of `model_path`: each matrix
    and norm of the layers and the head once, in the form the loader made (a compact weight's blocks, a
    dense one's elements); the embedding table is not counted (one row a token; a tied head counts)."""
    with RadFile.open(model_path) as rad:
        model = load_model(rad)
        seen: dict[int, int] = {}
        for obj in [*model.layers, model.norm, model.lm_head]:
            _count(obj, seen)
    return sum(seen.values())


def _count(obj, seen: dict[int, int]) -> None:
    if isinstance(obj, torch.Tensor):
        seen[id(obj)] = obj.numel() * obj.element_size()
    elif isinstance(obj, CompactWeight):
        seen[id(obj)] = obj.nbytes
    elif isinstance(obj, RowStack):
        for p in obj.parts:
            _count(p, seen)
    elif hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            _count(v, seen)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class RssWatch:
    """The peak RSS (MiB) of a process and its children, sampled every 50 ms on a thread until `stop`."""

    def __init__(self, pid: int):
        self.proc, self.peak, self._stop = psutil.Process(pid), 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, tree_rss_mib(self.proc))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


async def _concurrent(url: str, c: int, tokens: int, seed: str) -> dict:
    """c streamed greedy completions at once; aggregate and per-request rates."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        bodies = [completion_body(prompt_ids(PROMPT_TOKENS, f"{seed}-{i}"), tokens) for i in range(c)]
        start = time.perf_counter()
        samples = await asyncio.gather(*(stream_request(http, "/v1/completions", b) for b in bodies))
        wall = time.perf_counter() - start
    bad = [s.error for s in samples if not s.ok]
    if bad:
        raise RuntimeError(f"c={c}: {len(bad)} requests failed: {bad[0]}")
    total = sum(s.tokens_received for s in samples)
    tpots = [s.tpot_s for s in samples if s.tpot_s]
    return {"c": c, "tokens": total, "wall_s": wall, "aggregate_tok_s": total / wall,
            "per_request_tok_s": len(tpots) / sum(tpots), "ttft_ms": 1000 * sum(s.ttft_s for s in samples) / c}


async def _health_during_prefill(url: str) -> float:
    """The worst /health latency (ms) while one long prompt prefills (max_tokens 1)."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as http, \
            httpx.AsyncClient(base_url=url, timeout=60) as probe:
        body = completion_body(prompt_ids(LONG_PROMPT_TOKENS, "long"), 1)
        task = asyncio.create_task(stream_request(http, "/v1/completions", body))
        worst = 0.0
        await asyncio.sleep(0.05)
        while not task.done():
            t = time.perf_counter()
            assert (await probe.get("/health")).status_code == 200
            worst = max(worst, time.perf_counter() - t)
            await asyncio.sleep(0.01)
        await task
    return 1000 * worst


def bench_daemon(model: Path, threads: int, tokens: int, concurrency: list[int]) -> dict:
    os.environ["RADIANCED_CPU_THREADS"] = str(threads)
    daemon = ChildDaemon.start(["--model", str(model)])
    try:
        asyncio.run(_concurrent(daemon.url, 1, 8, "warm"))
        time.sleep(1.0)
        idle = tree_rss_mib(psutil.Process(daemon.proc.pid))
        rows = [asyncio.run(_concurrent(daemon.url, c, tokens, f"t{threads}c{c}")) for c in concurrency]
        # the peak under load from a pass of its own: sampling during the timed rows took 10-15% of their tok/s
        # on the 2-core machine (its thread steals a core's time from the step's OpenMP team)
        watch = RssWatch(daemon.proc.pid)
        asyncio.run(_concurrent(daemon.url, max(concurrency), tokens, f"t{threads}rss"))
        peak = watch.stop()
        health = asyncio.run(_health_during_prefill(daemon.url))
    finally:
        daemon.stop()
    return {"threads": threads, "rows": rows, "rss_idle_mib": idle, "rss_peak_mib": peak,
            "health_worst_ms_during_prefill": health}


def bench_transformers(threads: int, tokens: int) -> dict:
    """transformers `generate` on the bundled GGUF (fp32) at batch 1 and 8: tok/s and the model's bytes."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    gguf = bundled_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once
    prompt = torch.tensor([prompt_ids(PROMPT_TOKENS, "hf")])
    out = {"weight_bytes": weight_bytes}
    for b in (1, 8):
        ids = prompt.repeat(b, 1)
        kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=0)
        with torch.inference_mode():
            model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
            t = time.perf_counter()
            model.generate(ids, **kw)
        out[f"b{b}_tok_s"] = b * tokens / (time.perf_counter() - t)
    return out


def transformers_subprocess(threads: int, tokens: int) -> dict:
    """`bench_transformers` in a child process: its own threads and memory, OpenMP's settings as given."""
    out = subprocess.run([sys.executable, __file__, "--transformers-only", "--threads", str(threads),
                          "--tokens", str(tokens), "--out", "-"], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def llama_bench(binary: Path, threads: int, tokens: int) -> dict:
    """llama.cpp's own rates on the bundled GGUF through its llama-bench (tools/peer_llama_cpp.py), on `threads`
    threads, 3 repetitions: a prompt of PROMPT_TOKENS tokens, and `tokens` decoded at batch 1 from an empty
    context (llama-bench's decode test)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ as a package, run from a checkout
    from tools.peer_llama_cpp import run_llama_bench

    out = run_llama_bench(binary, bundled_gguf(), 0, PROMPT_TOKENS, tokens, 3, 900, gpu=False, threads=threads)
    return {"b1_tok_s": out["decode_tok_s"], "prompt_tok_s": out["prompt_tok_s"], "threads": threads,
            "command": out["command"]}


def markdown(result: dict) -> str:
    lines = [f"# CPU bench {result['date']} at {result['commit']} on {result['machine']}", "",
             f"SmolLM2-135M, {result['tokens']} tokens a request, greedy, through HTTP streaming: radianced on "
             f"{result['model']} (a .rad with the GGUF's blocks kept is read in place by "
             f"the block kernels, kernels/cpu_blocks.py), transformers on the same GGUF dequantized to fp32. "
             f"OpenMP settings given: {result['openmp_env'] or 'none'} (the daemon's defaults: daemon.py).", ""]
    for run in result["runs"]:
        d, hf, bw = run["daemon"], run["transformers"], run["read_gb_s"]
        floor, hf_floor = bw * 1e9 / result["served_bytes"], bw * 1e9 / hf["weight_bytes"]
        lines += [f"## {run['threads']} torch thread(s)", "",
                  f"Read bandwidth {bw:.1f} GB/s; a token reads {result['served_bytes'] / 1e6:.0f} MB in radianced "
                  f"(b1 floor {floor:.1f} tok/s), {hf['weight_bytes'] / 1e6:.0f} MB in transformers "
                  f"(b1 floor {hf_floor:.1f} tok/s). RSS idle {d['rss_idle_mib']:.0f} MiB, peak under load "
                  f"{d['rss_peak_mib']:.0f} MiB. /health worst during a {LONG_PROMPT_TOKENS}-token prefill: "
                  f"{d['health_worst_ms_during_prefill']:.1f} ms.", "",
                  "| c | aggregate tok/s | per request tok/s | TTFT ms | transformers tok/s | ratio |",
                  "|---|---|---|---|---|---|"]
        for r in d["rows"]:
            theirs = hf.get(f"b{r['c']}_tok_s")
            hf_cell, ratio = (f"{theirs:.1f} (b{r['c']})", f"{r['aggregate_tok_s'] / theirs:.2f}x") if theirs else ("", "")
            lines.append(f"| {r['c']} | {r['aggregate_tok_s']:.1f} | {r['per_request_tok_s']:.1f} | "
                         f"{r['ttft_ms']:.0f} | {hf_cell} | {ratio} |")
        b1 = d["rows"][0]["per_request_tok_s"]
        lines += ["", f"b1 decode {b1:.1f} tok/s = {b1 / floor:.0%} of the bytes floor."]
        if (ll := run.get("llama_cpp")) is not None:
            lines.append(f"llama.cpp (llama-bench, the same GGUF, {ll['threads']} threads) b1 decode "
                         f"{ll['b1_tok_s']:.1f} tok/s from an empty context, a {PROMPT_TOKENS}-token prompt at "
                         f"{ll['prompt_tok_s']:.0f} tok/s: radianced's b1 is {b1 / ll['b1_tok_s']:.2f}x it.")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", default="1,2", help="torch thread counts to run, comma-separated")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--model", type=Path, help="the .rad to serve (default: the default model, SmolLM2 with its "
                                               "GGUF blocks kept; e.g. its fp32 conversion)")
    ap.add_argument("--llama-bench", type=Path, metavar="PATH",
                    help="llama.cpp's llama-bench (tools/build_llama_cpp.sh): run llama.cpp too")
    ap.add_argument("--transformers-only", action="store_true", help=argparse.SUPPRESS)  # the child's part
    args = ap.parse_args()
    if args.transformers_only:
        print(json.dumps(bench_transformers(int(args.threads), args.tokens)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or ensure_default_model()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    served = served_bytes(model)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "tokens": args.tokens, "model": model.name,
              "served_bytes": served,
              "openmp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_"))},
              "machine": f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
                         f"load average {os.getloadavg()[0]:.1f} at start", "runs": []}
    for threads in (int(t) for t in args.threads.split(",")):
        run = {"threads": threads, "read_gb_s": read_bandwidth(threads),
               "daemon": bench_daemon(model, threads, args.tokens, [int(c) for c in args.concurrency.split(",")]),
               "transformers": transformers_subprocess(threads, args.tokens)}
        if args.llama_bench:
            run["llama_cpp"] = llama_bench(args.llama_bench, threads, args.tokens)
        result["runs"].append(run)
        (args.out / "bench_cpu.json").write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (args.out / "bench_cpu.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
