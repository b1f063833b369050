"""The measurements of one device run, and its report. `tools/gpu_check` drives it.

    python tools/gpu_bench.py run --out OUT [--quick]   # env, ceilings, budget, decode -> OUT/bench.json
    python tools/gpu_bench.py report --out OUT          # + tests, serve runs -> OUT/results.{json,md}; prints it
    python tools/gpu_bench.py fingerprint               # the code fingerprint the report carries

Every figure is measured in the run that reports it; a benchmark's floor uses
the ceilings measured in the same run (DESIGN.md "Benchmarks", METHOD.md):

- ceilings: HBM device-to-device copy (bytes read + written), bf16 matmul
  8192^3, pinned and pageable host-to-device (and pinned device-to-host), and
  O_DIRECT reads of a file written for the purpose (no page cache; nothing
  dropped system-wide);
- budget (in a fresh process, as a daemon starts): a scaled-up tiny qwen3_moe
  planned with `budget.plan` against the card `mem_get_info` reports, its arena
  allocated from the receipt, experts and KV placed in arena pages, the model
  loaded: allocated bytes against the receipt, peak reserved after a full
  `--max-num-batched-tokens` prefill; twice, with the embedding table on the
  card (section "budget") and pinned in host RAM ("budget_embeddings_ram");
- decode: a few Qwen3-30B-A3B-shaped layers with random bf16 weights made on
  the device, every expert resident, the reference ops (the "before" number for
  the Triton kernels): step time against (bytes of active weights + KV) / HBM.

Sections run one after another; one failing records its error and the rest
still run. bench.json is rewritten after every section, so a run cut short
keeps what it measured. Without CUDA (`--quick`, a dry run of this code on a
CPU) the CUDA-only parts are skipped and the rest run at small sizes: those
numbers describe the CPU and prove only that the code runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import hashlib
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BLOCK_TOKENS = 16
# The budget section, once per --embedding-placement ("budget" keeps its name across runs' results).
BUDGET_SECTIONS = {"budget": "vram", "budget_embeddings_ram": "ram"}


class Skip(Exception):
    """A section that cannot run here (e.g. needs CUDA); recorded, not an error."""


# -- small helpers -----------------------------------------------------------------


def _cuda() -> bool:
    return torch.cuda.is_available()


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, device, warmup: int = 3, reps: int = 10) -> dict:
    """Seconds per call: CUDA events around each call on the device, perf_counter on the CPU.

    Warm-up calls first (compilation, handles, caches). Returns median, min, max and all times.
    """
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "reps": reps,
            "warmup": warmup, "timer": "cuda events" if cuda else "perf_counter", "times_s": times}


def _allocated(device) -> int | None:
    return torch.cuda.memory_allocated() if torch.device(device).type == "cuda" else None


def _free_cuda() -> None:
    gc.collect()
    if _cuda():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def commit() -> dict:
    """The commit the tree came from: $RADIANCED_COMMIT, else `git rev-parse HEAD`, else unknown.

    The device gets a copy of the working tree without .git, so the lead passes
    RADIANCED_COMMIT; the fingerprint identifies the code either way.
    """
    env = os.environ.get("RADIANCED_COMMIT", "").strip()
    if env:
        return {"commit": env, "source": "RADIANCED_COMMIT"}
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            return {"commit": out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else ""), "source": "git"}
    except (OSError, subprocess.SubprocessError):
        pass
    return {"commit": "unknown", "source": "none (no .git and RADIANCED_COMMIT unset)"}


def fingerprint() -> str:
    """sha256 over the code that runs (path and bytes of radianced/, tools/, tests/ sources and
    pyproject.toml), first 16 hex digits: the same tree gives the same value here and on the device."""
    h = hashlib.sha256()
    files = [ROOT / "pyproject.toml"]
    for top in ("radianced", "tools", "tests"):
        for p in (ROOT / top).rglob("*"):
            if p.is_file() and "__pycache__" not in p.parts and (p.suffix in (".py", ".sh") or p.name == "gpu_check"):
                files.append(p)
    for p in sorted(files):
        h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


# -- env -----------------------------------------------------------------------------

SMI_FIELDS = ("name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,"
              "pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max,"
              "power.draw,power.limit,temperature.gpu,persistence_mode,compute_mode")


def nvidia_smi() -> dict:
    """Read-only query of the card's state (nothing is set)."""
    if shutil.which("nvidia-smi") is None:
        return {"error": "nvidia-smi not found"}
    for fields in (SMI_FIELDS, "name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem"):
        r = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        if r.returncode == 0:
            rows = [dict(zip(fields.split(","), (v.strip() for v in line.split(","))))
                    for line in r.stdout.strip().splitlines()]
            return {"gpus": rows}
    return {"error": (r.stderr or r.stdout).strip()[:500]}


def section_env(out: Path) -> dict:
    env = {
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": sys.version.split()[0], "platform": platform.platform(), "kernel": platform.release(),
        "cpus": os.cpu_count(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": _cuda(), **commit(), "fingerprint": fingerprint(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }
    for mod in ("triton", "transformers", "tokenizers", "msgspec", "xxhash", "numpy"):
        try:
            m = __import__(mod)
            env[mod] = f"{getattr(m, '__version__', getattr(m, 'VERSION', '?'))} ({Path(m.__file__).parent})"
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            env[mod] = f"not importable: {type(e).__name__}: {e}"
    try:
        with open("/proc/meminfo") as f:
            env["mem_total_kib"] = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    except (OSError, StopIteration, ValueError):
        pass
    if _cuda():
        p = torch.cuda.get_device_properties(0)
        env["device"] = p.name
        env["capability"] = f"{p.major}.{p.minor}"
        env["sms"] = p.multi_processor_count
        env["device_memory_bytes"] = p.total_memory
        env["l2_bytes"] = getattr(p, "L2_cache_size", None)
        env["device_count"] = torch.cuda.device_count()
    else:
        env["device"] = f"CPU only ({platform.processor() or platform.machine()})"
    env["nvidia_smi_start"] = nvidia_smi()
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True, timeout=60)
        (out / "nvidia-smi.txt").write_text(r.stdout + r.stderr)
    return env


# -- ceilings ----------------------------------------------------------------------------


def ceiling_copy(device, nbytes: int) -> dict:
    """Device-to-device copy of random bytes; bandwidth counts bytes read plus bytes written."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), device, warmup=3, reps=20)
    assert torch.equal(dst, src), "copy result differs from its source"
    del src, dst
    return {"bytes": nbytes, "moved_bytes": 2 * nbytes, **t, "bytes_per_s": 2 * nbytes / t["median_s"],
            "best_bytes_per_s": 2 * nbytes / t["min_s"]}


def ceiling_matmul(device, n: int) -> dict:
    """bf16 [n, n] @ [n, n] on random data; FLOP = 2 n^3; first 64 rows checked against fp32."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn((n, n), generator=g, device=device, dtype=torch.bfloat16)
    b = torch.randn((n, n), generator=g, device=device, dtype=torch.bfloat16)
    c = torch.empty((n, n), device=device, dtype=torch.bfloat16)
    c.fill_(float("nan"))  # poison: every element must be written
    t = timeit(lambda: torch.matmul(a, b, out=c), device, warmup=3, reps=20)
    ref = a[:64].float() @ b.float()
    err = float((c[:64].float() - ref).norm() / ref.norm())
    assert torch.isfinite(c).all() and err < 1e-2, f"bf16 matmul wrong: rel err {err:.2e}"
    del a, b, c, ref
    return {"n": n, "flop": 2 * n ** 3, **t, "flop_per_s": 2 * n ** 3 / t["median_s"],
            "best_flop_per_s": 2 * n ** 3 / t["min_s"], "rel_err_fp32": err}


def ceiling_host_links(nbytes: int) -> dict:
    """Pinned host -> device (non_blocking), pinned device -> host, pageable host -> device."""
    if not _cuda():
        raise Skip("needs CUDA")
    dev = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    dev2 = torch.empty_like(dev)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(dev)
    torch.cuda.synchronize()
    out = {"bytes": nbytes}
    t = timeit(lambda: dev2.copy_(pinned, non_blocking=True), "cuda", warmup=2, reps=10)
    assert torch.equal(dev2, dev), "pinned H2D result differs"
    out["pinned_h2d"] = {**t, "bytes_per_s": nbytes / t["median_s"], "best_bytes_per_s": nbytes / t["min_s"]}
    t = timeit(lambda: pinned.copy_(dev, non_blocking=True), "cuda", warmup=2, reps=10)
    out["pinned_d2h"] = {**t, "bytes_per_s": nbytes / t["median_s"], "best_bytes_per_s": nbytes / t["min_s"]}
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.copy_(pinned)
    dev2.zero_()
    t = timeit(lambda: dev2.copy_(pageable), "cuda", warmup=1, reps=5)
    assert torch.equal(dev2, dev), "pageable H2D result differs"
    out["pageable_h2d"] = {**t, "bytes_per_s": nbytes / t["median_s"], "best_bytes_per_s": nbytes / t["min_s"]}
    del dev, dev2, pinned, pageable
    return out


def _mount_of(path: Path) -> dict:
    """The /proc/mounts entry holding `path`: the longest mount point that contains it."""
    best = {"mount": "", "fstype": "?", "source": "?"}
    try:
        real = str(path.resolve())
        with open("/proc/mounts") as f:
            for line in f:
                src, mnt, fstype = line.split()[:3]
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best["mount"]):
                    best = {"mount": mnt, "fstype": fstype, "source": src}
    except OSError:
        pass
    return best


def ceiling_disk(nbytes: int, chunk: int = 8 * MiB, threads: tuple[int, ...] = (1, 4)) -> dict:
    """O_DIRECT write then O_DIRECT reads of one file (page cache bypassed both ways).

    Every 4 KiB block carries its own index in its first 8 bytes (no two blocks
    alike, so no deduplication can help), and every chunk read is checked.
    Reads: each of k threads reads its own contiguous part in `chunk`-sized
    preadv calls on its own descriptor (k = 1 is queue depth one).
    """
    import numpy as np

    if not hasattr(os, "O_DIRECT"):
        raise Skip("no O_DIRECT on this platform")
    nbytes -= nbytes % (chunk * max(threads))
    candidates = [os.environ.get("RADIANCED_DISK_DIR"), "/var/tmp", "/tmp", str(ROOT)]
    tried = []
    for d in filter(None, candidates):
        d = Path(d)
        if not d.is_dir() or shutil.disk_usage(d).free < nbytes + GiB:
            tried.append(f"{d}: missing or under {(nbytes + GiB) / GiB:.1f} GiB free")
            continue
        fstype = _mount_of(d)["fstype"]
        if fstype in ("tmpfs", "ramfs", "devtmpfs"):
            tried.append(f"{d}: {fstype} is memory, not a disk")
            continue
        path = d / f"radianced-odirect-{os.getpid()}.bin"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        except OSError as e:
            tried.append(f"{d}: {e.strerror}")
            continue
        try:
            return {"dir": str(d), **_mount_of(d), "bytes": nbytes, "chunk_bytes": chunk, "tried_before": tried,
                    **_disk_run(fd, path, nbytes, chunk, threads, np)}
        finally:
            path.unlink(missing_ok=True)
    raise Skip("no folder takes O_DIRECT with enough room: " + "; ".join(tried))


def _disk_run(fd: int, path: Path, nbytes: int, chunk: int, threads, np) -> dict:
    blocks_per_chunk = chunk // 4096
    buf = mmap.mmap(-1, chunk)  # page aligned, as O_DIRECT needs
    words = np.frombuffer(buf, dtype=np.uint64)
    words[:] = np.random.default_rng(0).integers(0, 2 ** 63, size=words.size, dtype=np.uint64)
    marks = np.arange(blocks_per_chunk, dtype=np.uint64)
    t0 = time.perf_counter()
    try:
        for i in range(nbytes // chunk):
            words[::512] = marks + i * blocks_per_chunk  # block index in the first word of each 4 KiB
            if os.pwritev(fd, [buf], i * chunk) != chunk:
                raise OSError("short O_DIRECT write")
        os.fsync(fd)
    finally:
        os.close(fd)
    write_s = time.perf_counter() - t0
    out = {"write_s": write_s, "write_bytes_per_s": nbytes / write_s, "reads": {}}
    for k in threads:
        part = nbytes // k
        bad, errors = [0] * k, []

        def reader(t: int, part=part, bad=bad, errors=errors) -> None:
            try:
                rfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                rbuf = mmap.mmap(-1, chunk)
                rwords = np.frombuffer(rbuf, dtype=np.uint64)
                try:
                    for off in range(t * part, (t + 1) * part, chunk):
                        if os.preadv(rfd, [rbuf], off) != chunk:
                            raise OSError(f"short O_DIRECT read at {off}")
                        first = off // 4096
                        if rwords[0] != first or rwords[-512] != first + blocks_per_chunk - 1:
                            bad[t] += 1
                finally:
                    os.close(rfd)
                    del rwords
                    rbuf.close()
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"{type(e).__name__}: {e}")

        workers = [threading.Thread(target=reader, args=(t,)) for t in range(k)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        secs = time.perf_counter() - t0
        if errors:
            raise OSError("; ".join(errors))
        if sum(bad):
            raise AssertionError(f"{sum(bad)} chunks read back wrong with {k} threads")
        out["reads"][str(k)] = {"threads": k, "seconds": secs, "bytes_per_s": nbytes / secs}
    del words
    buf.close()
    out["best_read_bytes_per_s"] = max(r["bytes_per_s"] for r in out["reads"].values())
    return out


# -- budget vs reality (issue 4) ----------------------------------------------------------


def section_budget(device, quick: bool, tmp: Path, embedding_placement: str) -> dict:
    """Plan a scaled-up tiny qwen3_moe on this card, allocate what the receipt says, and measure; the
    embedding table on the card (`vram`) or pinned in host RAM and read in the step (`ram`)."""
    from radianced.arena import EXPERTS, KV, Arena
    from radianced.budget import plan
    from radianced.card import Card, detect_card
    from radianced.config import Config
    from radianced.kernels import ops
    from radianced.kv.cache import KVCache
    from radianced.model.batch import ForwardBatch
    from radianced.model.convert import convert
    from radianced.model.experts import ResidentExperts
    from radianced.model.loader import load_model
    from radianced.model.rad import RadFile
    from radianced.model.tiny import make_tiny
    from radianced.sizing import ModelFacts

    backend = ops.select(device)  # the product path: Triton attention/MoE on CUDA, the reference elsewhere
    if quick:
        shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
                     num_experts_per_tok=4, moe_intermediate_size=128, num_hidden_layers=2)
        spare_mib, tokens = 1024, 256
    else:
        shape = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64,
                     num_experts_per_tok=8, moe_intermediate_size=512, num_hidden_layers=2)
        spare_mib, tokens = 8192, 2048
    t0 = time.perf_counter()
    src = make_tiny("qwen3_moe", tmp / "budget_hf", initializer_range=0.02, **shape)
    dst = tmp / "budget.rad"
    convert(src, dst, dtype="bf16")
    shutil.rmtree(src)
    out: dict = {"model": {"family": "qwen3_moe", **shape, "dtype": "bf16"}, "make_seconds": time.perf_counter() - t0}
    rad = RadFile.open(dst)
    m = rad.model
    facts = ModelFacts.from_header(rad.header)
    dtype = torch.bfloat16

    _free_cuda()
    if torch.device(device).type == "cuda":
        torch.zeros(1, device=device)  # the context exists before the card is read
        free, total = torch.cuda.mem_get_info()
        card = Card(total, free, cuda=True)
    else:
        card = detect_card("cpu")
    in_use_mib = -(-(card.total_bytes - card.free_bytes) // MiB)
    # --gpu-memory-mib: radianced may use what is in use now plus `spare_mib`; the rest of the card
    # stays free, so going past the receipt shows up as a number instead of an out-of-memory error.
    cfg = Config(placement="resident", embedding_placement=embedding_placement, gpu_memory_mib=in_use_mib + spare_mib,
                 max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=tokens)
    receipt = plan(card, facts, cfg)
    budget_total = receipt.card_free - receipt.headroom  # weights + workspace + state + elastic
    out["flags"] = {"placement": "resident", "embedding_placement": embedding_placement,
                    "gpu_memory_mib": cfg.gpu_memory_mib,
                    "max_model_len": 4096, "max_num_seqs": 4, "max_num_batched_tokens": tokens}
    out["receipt"] = receipt.lines()
    out["backend"] = backend
    out["receipt_bytes"] = {"card_total": receipt.card_total, "card_free": receipt.card_free,
                            "headroom": receipt.headroom, "weights": receipt.weights_bytes,
                            "workspace": receipt.workspace_bytes, "state": receipt.state_bytes,
                            "elastic": receipt.elastic, "arena": receipt.arena_bytes,
                            "arena_alloc": receipt.arena_alloc_bytes, "page": receipt.page_bytes,
                            "budget_total": budget_total}

    base = _allocated(device)
    arena = Arena.from_receipt(receipt, device)
    _sync(device)
    arena_alloc = (_allocated(device) - base) if base is not None else arena.storage.untyped_storage().nbytes()
    assert arena.storage.numel() == receipt.arena_alloc_bytes
    # whole pages in whole allocator units: a page is dropped where rounding up would cross the line,
    # so the allocation sits less than one page plus one unit under it
    slack = receipt.page_bytes + receipt.alloc_granule
    within = 0 <= receipt.elastic - arena_alloc < slack
    out["arena"] = {"allocated_bytes": arena_alloc, "elastic_bytes": receipt.elastic,
                    "elastic_minus_allocated": receipt.elastic - arena_alloc, "within_one_page": within,
                    "slack_bytes": slack}
    checks = out["checks_failed"] = []  # asserted, but every measurement is still taken and recorded
    if not within:
        checks.append(f"arena allocation {arena_alloc} B is not within one page and one allocator unit "
                      f"({slack} B) under the elastic line {receipt.elastic} B")

    # Every routed expert in its own arena page; the table maps (layer, expert) to that page.
    inter, hidden = m.moe_intermediate_size, m.hidden_size
    lease = arena.lease(EXPERTS, facts.expert_count)
    slab = arena.paged_view(dtype, (3 * inter * hidden,))
    entries = sorted(rad.header.experts, key=lambda e: (e.layer, e.expert))
    pages: dict[int, list[int]] = {}
    for e, page in zip(entries, lease.pages):
        gate, up, down = rad.expert(e.layer, e.expert, verify=True)
        slab[page].copy_(torch.cat((gate.flatten(), up.flatten(), down.flatten())))
        assert e.expert == len(pages.setdefault(e.layer, []))
        pages[e.layer].append(page)
    experts = ResidentExperts(slab, {layer: torch.tensor(p, dtype=torch.int64, device=device)
                                     for layer, p in pages.items()})
    model = load_model(rad, device=device, dtype=dtype, experts=experts, embedding_placement=embedding_placement)
    _sync(device)
    expected = receipt.weights_bytes + receipt.arena_alloc_bytes
    host_charged = sum(p.bytes for p in receipt.host_weights if p.name == "embeddings")
    # on the CPU nothing moves (host RAM is the card there): the comparison is a CUDA one
    out["weights_placed"] = {"device_bytes": model.placed.device_bytes, "host_bytes": model.placed.host_bytes,
                             "receipt_card_bytes": receipt.weights_bytes, "receipt_host_bytes": host_charged}
    if base is not None and (model.placed.device_bytes, model.placed.host_bytes) != (receipt.weights_bytes,
                                                                                      host_charged):
        checks.append(f"the loader placed {model.placed} where the receipt charges {receipt.weights_bytes} B to "
                      f"the card and {host_charged} B of embeddings to host RAM")
    if base is not None:
        startup = _allocated(device) - base
        out["startup"] = {"allocated_bytes": startup, "receipt_weights_plus_arena": expected,
                          "gap_bytes": startup - expected, "within_1_mib": abs(startup - expected) <= MiB,
                          "reserved_bytes": torch.cuda.memory_reserved()}

    # KV blocks in the remaining arena pages, as the receipt's resident split leaves them.
    group = receipt.groups[0]
    per_page = receipt.blocks_per_page(group)
    kv_lease = arena.lease(KV, receipt.kv_start_pages)
    storage = arena.paged_view(dtype, (per_page, len(m.full_attention_layers), 2, BLOCK_TOKENS,
                                       m.num_key_value_heads, m.head_dim))
    cache = KVCache(storage, m.full_attention_layers)
    free_blocks = [p * per_page + i for p in kv_lease.pages for i in range(per_page)]
    g = torch.Generator().manual_seed(0)
    out["prefill"] = {}
    for seqs in (1, cfg.max_num_seqs):
        n = tokens // seqs
        prompts = [torch.randint(0, m.vocab_size, (n,), generator=g).tolist() for _ in range(seqs)]
        blocks = -(-n // BLOCK_TOKENS)
        tables = [free_blocks[s * blocks:(s + 1) * blocks] for s in range(seqs)]
        batch = ForwardBatch.build(prompts, [0] * seqs, tables, BLOCK_TOKENS, device=device)
        key = f"{seqs}x{n}"
        if base is not None:
            _free_cuda()  # the previous step's cached blocks do not count against this one
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                logits = model.forward(batch, cache)
            _sync(device)
            secs = time.perf_counter() - t0
        except torch.OutOfMemoryError as e:
            out["prefill"][key] = {"error": f"out of memory: {e}"[:400]}
            _free_cuda()
            continue
        if not (logits.shape == (seqs, m.vocab_size) and torch.isfinite(logits).all()):
            checks.append(f"prefill {key}: logits of shape {list(logits.shape)} or not finite")
        row = {"seqs": seqs, "tokens_each": n, "seconds_first_call": secs}
        if base is not None:
            free_now, _ = torch.cuda.mem_get_info()
            peak_res, peak_alloc = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
            row.update({"peak_reserved_bytes": peak_res, "budget_total_bytes": budget_total,
                        "peak_reserved_minus_budget": peak_res - budget_total,
                        "within_receipt": peak_res <= budget_total,
                        "step_peak_allocated_bytes": peak_alloc - before,
                        "receipt_workspace_bytes": receipt.workspace_bytes,
                        # the whole card as the driver sees it (CUDA context, libraries' own memory included),
                        # beyond what was in use when the card was read
                        "card_used_beyond_plan_bytes": card.free_bytes - free_now})
        out["prefill"][key] = row
        del logits
    # The arena-placed model computes what the plain loader's model computes (same weights, own slab
    # and KV): a wrong page in the expert table or the KV view would show here.
    plain = load_model(rad, device=device, dtype=dtype)
    plain_cache = KVCache.allocate(m, num_blocks=-(-256 // BLOCK_TOKENS), block_size=BLOCK_TOKENS,
                                   num_state_slots=0, dtype=dtype, device=device)
    prompt = [torch.randint(0, m.vocab_size, (256,), generator=g).tolist()]
    with torch.inference_mode():
        ours = model.forward(ForwardBatch.build(prompt, [0], [free_blocks[:16]], BLOCK_TOKENS, device=device),
                             cache)
        ref = plain.forward(ForwardBatch.build(prompt, [0], [list(range(16))], BLOCK_TOKENS, device=device),
                            plain_cache)
    err = float((ours - ref).abs().max() / ref.abs().max())
    out["arena_model_vs_plain_loader_rel_err"] = err
    if not err < 1e-2:
        checks.append(f"the arena-placed model's logits differ from the plain loader's by {err:.2e} of max|logit|")
    del model, experts, slab, storage, cache, arena, plain, plain_cache
    rad.close()
    _free_cuda()
    return out


def section_budget_fresh(device, quick: bool, tmp: Path, embedding_placement: str) -> dict:
    """`section_budget` in a fresh process, so that the card it reads and the memory it counts
    start as a daemon's would: nothing of the ceilings' allocations, handles or caches."""
    result = tmp / f"budget_{embedding_placement}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "budget-child", "--result", str(result),
           "--tmp", str(tmp), "--embedding-placement", embedding_placement] + (["--quick"] if quick else [])
    r = subprocess.run(cmd, timeout=180)
    if not result.exists():
        raise RuntimeError(f"the budget process exited {r.returncode} without a result")
    res = json.loads(result.read_text())
    if "child_traceback" in res:
        raise RuntimeError("in the budget process:\n" + res["child_traceback"])
    res["process"] = "fresh (pid differs from the other sections)"
    return res


def cmd_budget_child(args) -> int:
    device = "cuda" if _cuda() else "cpu"
    try:
        res = section_budget(device, args.quick or device == "cpu", Path(args.tmp), args.embedding_placement)
    except Exception:  # noqa: BLE001 - handed to the parent, which records it
        res = {"child_traceback": traceback.format_exc(limit=12)}
    _write_json(Path(args.result), res)
    return 0


# -- decode step at Qwen3-30B-A3B shapes (reference ops) ------------------------------------


def qwen3_30b_a3b(layers: int, quick: bool):
    """Qwen3-30B-A3B's per-layer shapes (REFERENCE.md) with `layers` decoder layers."""
    from radianced.model.config import ModelConfig

    if quick:
        return ModelConfig(family="qwen3_moe", vocab_size=4096, hidden_size=256, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
                           rope_theta=1e6, max_position_embeddings=4096, num_experts=16, num_experts_per_tok=4,
                           moe_intermediate_size=128, norm_topk_prob=True)
    return ModelConfig(family="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
                       rope_theta=1e6, max_position_embeddings=40960, intermediate_size=6144, num_experts=128,
                       num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)


class _Experts:
    """Every expert resident in one slab; optionally counts the distinct experts routed per layer."""

    host = None  # no host pool: every table entry is a slab row
    stages_experts = False  # prepare only counts

    def __init__(self, slab: torch.Tensor, tables: dict[int, torch.Tensor]):
        self.slab, self._tables, self.counts = slab, tables, None

    def table(self, layer: int) -> torch.Tensor:
        return self._tables[layer]

    def prepare(self, layer: int, expert_ids: torch.Tensor) -> None:
        if self.counts is not None:
            self.counts[layer] = int(torch.unique(expert_ids).numel())


def section_decode(device, quick: bool, hbm_bytes_per_s: float | None, matmul_flop_per_s: float | None) -> dict:
    from radianced.kv.cache import KVCache
    from radianced.model.batch import ForwardBatch
    from radianced.model.hf_plan import expected_layer
    from radianced.model.loader import build_model

    layers, ctx = (2, 128) if quick else (4, 1024)
    cfg = qwen3_30b_a3b(layers, quick)
    H, V, E, I = cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.moe_intermediate_size
    dtype, elem = torch.bfloat16, 2
    g = torch.Generator(device=device).manual_seed(0)
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    layer_elems = 0
    for i in range(layers):
        items = expected_layer(cfg, f"model.layers.{i}.", cfg.layer_type(i), cfg.is_moe_layer(i))
        shapes.update(items)
        layer_elems += sum(math.prod(s) for _, s in items)

    def weights(name: str) -> torch.Tensor:
        shape = shapes[name]
        if len(shape) == 1:  # norms: near 1, never exactly
            return (1 + 0.1 * torch.randn(shape, generator=g, device=device)).to(dtype)
        return torch.randn(shape, generator=g, device=device, dtype=dtype) * shape[-1] ** -0.5

    slab = torch.empty((layers * E, 3 * I * H), device=device, dtype=dtype)
    slab[:, :2 * I * H].normal_(0, H ** -0.5, generator=g)  # gate | up: [I, H] each
    slab[:, 2 * I * H:].normal_(0, I ** -0.5, generator=g)  # down: [H, I]
    experts = _Experts(slab, {i: torch.arange(i * E, (i + 1) * E, device=device) for i in range(layers)})
    model = build_model(cfg, weights, experts)

    batches = (1, 8)
    blocks_each = -(-(ctx + 1) // BLOCK_TOKENS)
    cache = KVCache.allocate(cfg, num_blocks=max(batches) * blocks_each, block_size=BLOCK_TOKENS,
                             num_state_slots=0, dtype=dtype, device=device)
    cache.storage.normal_(generator=g)  # a context of random K and V, never zeros
    _sync(device)
    out = {"synthetic": True, "model": "Qwen3-30B-A3B per-layer shapes, random bf16 weights made on the device",
           "layers": layers, "context": ctx, "experts_resident": True, "ops": "reference (torch), before Triton",
           "weights_bytes_on_device": (slab.numel() + layer_elems + 2 * V * H + H) * elem,
           "hbm_bytes_per_s": hbm_bytes_per_s, "matmul_flop_per_s": matmul_flop_per_s, "batches": {}}
    kv_layer_token = 2 * cfg.num_key_value_heads * cfg.head_dim * elem
    hq, d = cfg.num_attention_heads, cfg.head_dim
    attn_params = sum(math.prod(shapes[f"model.layers.0.self_attn.{n}_proj.weight"]) for n in "qkvo")
    gen = torch.Generator().manual_seed(1)
    for B in batches:
        tables = [list(range(b * blocks_each, (b + 1) * blocks_each)) for b in range(B)]
        toks = [[int(torch.randint(0, V, (1,), generator=gen))] for _ in range(B)]
        batch = ForwardBatch.build(toks, [ctx] * B, tables, BLOCK_TOKENS, device=device)

        def layers_only(batch=batch):
            x = model.embed(batch.input_ids)
            rope = model.rotary.at(batch.positions)
            for layer in model.layers:
                x = layer(x, rope, batch, cache)
            return x

        with torch.inference_mode():
            experts.counts = {}
            logits = model.forward(batch, cache)  # one untimed step counts the distinct routed experts
            distinct, experts.counts = experts.counts, None
            if not (logits.shape == (B, V) and torch.isfinite(logits).all()):
                raise AssertionError(f"decode b{B}: logits of shape {list(logits.shape)} or not finite")
            t_full = timeit(lambda: model.forward(batch, cache), device, warmup=3, reps=10)
            t_layers = timeit(layers_only, device, warmup=3, reps=10)
        # bytes a step must move at least: each weight read once, K and V of the context read once
        expert_bytes = sum(distinct.values()) * 3 * I * H * elem
        kv_bytes = layers * B * ((ctx + 1) + 1) * kv_layer_token  # read ctx+1 tokens, write the new one
        layer_bytes = layer_elems * elem + expert_bytes + kv_bytes + B * H * elem  # + the embedding rows
        full_bytes = layer_bytes + (V * H + H) * elem  # + lm_head and final norm
        flop_layers = layers * B * 2 * (attn_params + cfg.num_experts_per_tok * 3 * I * H + E * H) \
            + layers * B * 4 * (ctx + 1) * hq * d
        flop_full = flop_layers + B * 2 * V * H
        row = {"batch": B, "distinct_experts_per_layer": distinct}
        for name, t, nbytes, flop in (("layers", t_layers, layer_bytes, flop_layers),
                                      ("full", t_full, full_bytes, flop_full)):
            floors = {}
            if hbm_bytes_per_s:
                floors["bytes"] = nbytes / hbm_bytes_per_s
            if matmul_flop_per_s:
                floors["flop"] = flop / matmul_flop_per_s
            floor = max(floors.values()) if floors else None
            row[name] = {**t, "min_bytes": nbytes, "flop": flop, "floor_s": floor, "floors_s": floors,
                         "floor_kind": max(floors, key=floors.get) if floors else None,
                         "ratio_floor_over_time": floor / t["median_s"] if floor else None}
        out["batches"][str(B)] = row
    del model, experts, slab, cache
    _free_cuda()
    return out


# -- run ----------------------------------------------------------------------------------


def _section(results: dict, path: Path, name: str, fn, *args) -> dict:
    print(f"== {name}", flush=True)
    t0 = time.perf_counter()
    try:
        res = fn(*args)
        res = {"status": "failed" if res.get("checks_failed") else "ok", **res}
    except Skip as e:
        res = {"status": "skipped", "why": str(e)}
    except Exception as e:  # noqa: BLE001 - one section's failure must not stop the others
        res = {"status": "error", "error": f"{type(e).__name__}: {e}"[:2000],
               "traceback": traceback.format_exc(limit=12)}
        print(res["traceback"], flush=True)
    try:
        if _cuda():
            torch.cuda.synchronize()  # surface an asynchronous CUDA error in the section that caused it
    except Exception as e:  # noqa: BLE001
        res.setdefault("error", f"after the section: {type(e).__name__}: {e}")
        res["status"] = "error"
    res["seconds"] = time.perf_counter() - t0
    results[name] = res
    _write_json(path, results)
    why = res.get("error") or res.get("why") or "; ".join(res.get("checks_failed") or [])
    print(f"   {res['status']} in {res['seconds']:.1f} s" + (f": {why}" if res["status"] != "ok" else ""), flush=True)
    return res


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True, default=str))
    tmp.replace(path)


def cmd_run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if _cuda() else "cpu"
    quick = args.quick or device == "cpu"
    path = out / "bench.json"
    results: dict = {"quick": quick, "device_type": device}
    _write_json(path, results)
    _section(results, path, "env", section_env, out)
    ceil: dict = {}
    results["ceilings"] = ceil
    copy_bytes = 64 * MiB if quick else 2 * GiB
    _section(ceil, path, "hbm_copy", ceiling_copy, device, copy_bytes)
    _section(ceil, path, "matmul_bf16", ceiling_matmul, device, 256 if quick else 8192)
    _section(ceil, path, "host_links", ceiling_host_links, 64 * MiB if quick else GiB)
    if _cuda():  # clocks and PCIe link state right after the card was busy (idle links train down)
        results["env"]["nvidia_smi_after_host_links"] = nvidia_smi()
    _section(ceil, path, "disk_odirect", ceiling_disk, 256 * MiB if quick else 2 * GiB)
    with tempfile.TemporaryDirectory(prefix="radianced-bench-") as tmp:
        for name, embeddings in BUDGET_SECTIONS.items():
            _section(results, path, name, section_budget_fresh, device, quick, Path(tmp), embeddings)
    # the floors use the copy and matmul rates measured above, on the same device
    _section(results, path, "decode_reference", section_decode, device, quick,
             ceil["hbm_copy"].get("bytes_per_s"), ceil["matmul_bf16"].get("flop_per_s"))
    bad = [k for k, v in {**ceil, **results}.items()
           if isinstance(v, dict) and v.get("status") in ("error", "failed")]
    print("sections with errors or failed checks: " + (", ".join(bad) if bad else "none"), flush=True)
    return 1 if bad else 0


# -- report ------------------------------------------------------------------------------------


def _junit(path: Path) -> dict:
    if not path.exists():
        return {"error": "no junit file (pytest did not finish)"}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed"] = [f"{c.get('classname', '')}::{c.get('name')}" for c in root.iter("testcase")
                        if c.find("failure") is not None or c.find("error") is not None]
    return counts


def _tests_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _g(x: dict | None, *keys):
    for k in keys:
        if not isinstance(x, dict):
            return None
        x = x.get(k)
    return x


def _rate(v: float | None, unit: str = "B/s") -> str:
    if v is None:
        return "-"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= scale:
            return f"{v / scale:.3g} {prefix}{unit}"
    return f"{v:.3g} {unit}"


def _mib(v) -> str:
    return "-" if v is None else f"{v / MiB:,.2f} MiB"


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.3f} ms"


def _status(sec: dict | None) -> str | None:
    if not isinstance(sec, dict) or "status" not in sec:
        return "not run"
    if sec.get("status") == "ok":
        return None
    why = sec.get("error") or sec.get("why") or "; ".join(sec.get("checks_failed") or [])
    return f"{sec.get('status')}: {why[:120]}"


def report_rows(bench: dict, junit: dict, tests: list[dict], rcs: dict) -> list[tuple[str, str, str, str, str]]:
    """(row, measured, floor or reference from the same run, ratio, note)."""
    rows = []
    c = bench.get("ceilings", {})
    cp = c.get("hbm_copy", {})
    rows.append((f"device copy {_mib(cp.get('bytes'))} (read+write)", _rate(cp.get("bytes_per_s")), "", "",
                 _status(cp) or f"ceiling; best {_rate(cp.get('best_bytes_per_s'))}"))
    mm = c.get("matmul_bf16", {})
    rows.append((f"bf16 matmul {mm.get('n', '?')}^3", _rate(mm.get("flop_per_s"), "FLOP/s"), "", "",
                 _status(mm) or f"ceiling; best {_rate(mm.get('best_flop_per_s'), 'FLOP/s')}"))
    hl = c.get("host_links", {})
    pin = _g(hl, "pinned_h2d", "bytes_per_s")
    rows.append((f"pinned H2D {_mib(hl.get('bytes'))}", _rate(pin), "", "",
                 _status(hl) or f"ceiling; best {_rate(_g(hl, 'pinned_h2d', 'best_bytes_per_s'))}"))
    if hl.get("status") == "ok":
        rows.append(("pinned D2H", _rate(_g(hl, "pinned_d2h", "bytes_per_s")), "", "", ""))
        pg = _g(hl, "pageable_h2d", "bytes_per_s")
        rows.append(("pageable H2D", _rate(pg), f"pinned {_rate(pin)}", f"{pg / pin:.2f}" if pg and pin else "-", ""))
    dk = c.get("disk_odirect", {})
    reads = dk.get("reads", {})
    rows.append((f"O_DIRECT read {_mib(dk.get('bytes'))} ({dk.get('fstype', '?')} at {dk.get('dir', '?')})",
                 " / ".join(f"{_rate(r['bytes_per_s'])} x{k}" for k, r in reads.items()) or "-", "", "",
                 _status(dk) or f"ceiling {_rate(dk.get('best_read_bytes_per_s'))}; "
                                f"write {_rate(dk.get('write_bytes_per_s'))}"))

    # correctness
    t_note = f"pytest rc {rcs.get('pytest')}" if rcs.get("pytest") not in (None, 0) else ""
    if "error" in junit:
        rows.append(("tests -m gpu", "-", "", "", f"{junit['error']}; {t_note}"))
    else:
        rows.append(("tests -m gpu", f"{junit['passed']} passed, {junit['failures'] + junit['errors']} failed, "
                     f"{junit['skipped']} skipped", "", "",
                     ("FAILED: " + ", ".join(junit["failed"])[:200]) if junit["failed"] else t_note))
    gather = sorted((r for r in tests if r.get("test") == "embedding_gather"), key=lambda r: r["tokens"])
    if gather:  # tests/gpu/test_embedding_placement.py: --embedding-placement ram's lookup against vram's
        rows.append(("embedding lookup, table pinned in host RAM (graph replay, bf16, H 2048)",
                     " / ".join(f"{r['tokens']} tok {r['host_table_us']:.1f} us" for r in gather),
                     "table on the card: " + " / ".join(f"{r['card_table_us']:.1f} us" for r in gather), "", ""))
    tests = [r for r in tests if "family" in r]  # the family tests' rows; kernel tests record other rows
    by = {}
    for r in tests:
        by.setdefault(r["test"], {})[r["family"]] = r
    fams = ("llama", "qwen3_moe", "qwen3_next")
    if tests:
        free = by.get("fp32_free_running", {})
        rows.append(("fp32 greedy tokens = CPU, 3 seqs x 32 steps",
                     " / ".join(f"{f}: {'yes' if free.get(f, {}).get('tokens_equal') else ('no' if f in free else '-')}"
                                for f in fams), "CPU fp32", "", "device: " + ",".join(sorted({r['device'] for r in tests if 'device' in r}))))
        graphs = by.get("decode_graphs", {})
        if graphs:
            rows.append(("decode CUDA graphs (tokens = eager, checked): step time eager -> graph",
                         " / ".join(f"{f}: {_ms(r['eager_step_s'])} -> {_ms(r['graph_step_s'])}"
                                    for f, r in sorted(graphs.items())), "", "", "tiny models, batch 3 in bucket 4"))
        tf = by.get("fp32_teacher_forced", {})
        rows.append(("fp32 logits vs CPU (teacher-forced), worst rel err",
                     " / ".join(f"{f}: {tf[f]['worst_rel_err']:.1e}" if f in tf else f"{f}: -" for f in fams),
                     "tolerance 1e-4", "", ""))
        bf = by.get("bf16_top1", {})
        rows.append(("bf16 top-1 agreement with CPU fp32",
                     " / ".join(f"{f}: {bf[f]['agreement']:.1%}" if f in bf else f"{f}: -" for f in fams),
                     "target 95% (asserted 90%)", "",
                     "worst rel err " + " / ".join(f"{bf[f]['worst_rel_err']:.2f}" for f in fams if f in bf)))

    for name, embeddings in BUDGET_SECTIONS.items():
        rows += _budget_rows(bench.get(name, {}), f"embeddings {embeddings}")

    d = bench.get("decode_reference", {})
    if d.get("status") == "ok":
        for B, row in d.get("batches", {}).items():
            for part, label in (("layers", f"{d['layers']} layers"), ("full", f"{d['layers']} layers + lm_head")):
                r = row[part]
                ratio = r.get("ratio_floor_over_time")
                rows.append((f"decode b{B}, {label}, ctx {d['context']} (reference ops, BEFORE Triton; synthetic)",
                             _ms(r["median_s"]), f"{_ms(r['floor_s'])} ({r.get('floor_kind') or '-'})",
                             f"{ratio:.1%}" if ratio else "-",
                             f"{_mib(r['min_bytes'])} moved at least; spread {_ms(r['min_s'])}..{_ms(r['max_s'])}"))
    else:
        rows.append(("decode (reference ops)", "-", "", "", _status(d) or ""))
    return rows


SERVE_RUNS = ("resident", "offload")  # gpu_check's `serve` part: OUT/serve-<run>.bench.json, `bench run`'s report


def serve_rows(out: Path) -> list[tuple[str, str, str, str, str]]:
    """The rows of gpu_check's `serve` part (issue 24: the HTTP rows first): per run, its checks, then one
    row per workload of `radiancectl bench run --quick` (radianced/bench/report.py wrote the JSON)."""
    rows = []
    for run in SERVE_RUNS:
        path = out / f"serve-{run}.bench.json"
        if not path.exists():
            continue
        doc = json.loads(path.read_text())
        failed = [k for k, v in doc["checks"].items() if v is False]
        rows.append((f"HTTP bench run --quick, {run}: checks", "FAILED: " + ", ".join(failed) if failed else "all pass",
                     "", "", f"{doc['meta'].get('model')}, energy {doc['meta'].get('energy')}"))
        for w in doc["workloads"]:
            s, d, e = w["summary"], w["server"], w["energy"]
            tok_s = "-" if s["output_tok_s"] is None else f"{s['output_tok_s']:.1f} tok/s"
            hit = "-" if d["hit_rate"] is None else f"hit {d['hit_rate']:.1%}, overflow {_mib(d['overflow_bytes'])}"
            joules = f"{e['joules_per_token']:.3f} J/tok" if isinstance(e, dict) and e.get("joules_per_token") else ""
            client = "latencies client-bound (bench/loop_lag.py)" if (w.get("client_lag") or {}).get("client_bound") \
                else ""
            name = w["name"] if "c=" in w["name"] else f"{w['name']} (c={w['concurrency']})"
            rows.append((f"HTTP {run}: {name}",
                         f"{tok_s}; TTFT p50 {_ms(s['ttft']['p50'])}; ITL p50 {_ms(s['itl']['p50'])}", "", "",
                         "; ".join(x for x in (f"{s['ok']}/{s['requests']} ok", hit, joules, client) if x)))
    return rows


def _budget_rows(b: dict, flag: str) -> list[tuple]:
    """The report's rows of one budget section (`flag` says its embedding placement)."""
    rows = [(f"budget check FAILED ({flag})", "-", "", "", check[:200]) for check in b.get("checks_failed") or []]
    if b.get("status") not in ("ok", "failed"):
        return rows + [(f"budget vs reality ({flag})", "-", "", "", _status(b) or "")]
    a = b.get("arena", {})
    rows.append((f"arena allocated vs receipt elastic line ({flag})", _mib(a.get("allocated_bytes")),
                 _mib(a.get("elastic_bytes")), "",
                 f"within one page and one allocator unit ({_mib(a.get('slack_bytes'))}): "
                 f"{'yes' if a.get('within_one_page') else 'NO'}"))
    w = b.get("weights_placed")
    if w:
        rows.append((f"weights placed on the card / in host RAM ({flag})",
                     f"{_mib(w['device_bytes'])} / {_mib(w['host_bytes'])}",
                     f"receipt {_mib(w['receipt_card_bytes'])} / {_mib(w['receipt_host_bytes'])}", "", ""))
    s = b.get("startup")
    if s:
        rows.append((f"allocated after start-up vs receipt weights + arena ({flag})", _mib(s["allocated_bytes"]),
                     _mib(s["receipt_weights_plus_arena"]), f"gap {s['gap_bytes'] / MiB:+.3f} MiB",
                     f"within 1 MiB: {'yes' if s['within_1_mib'] else 'NO'}"))
    for key, p in b.get("prefill", {}).items():
        if "error" in p:
            rows.append((f"prefill {key} ({flag})", "-", "", "", p["error"][:150]))
        elif "peak_reserved_bytes" in p:
            rows.append((f"peak reserved, prefill {key} ({b.get('backend', 'reference')} ops, {flag})",
                         _mib(p["peak_reserved_bytes"]),
                         f"receipt total {_mib(p['budget_total_bytes'])}",
                         f"{p['peak_reserved_minus_budget'] / MiB:+,.1f} MiB",
                         f"step peak {_mib(p['step_peak_allocated_bytes'])} vs workspace line "
                         f"{_mib(p['receipt_workspace_bytes'])}"))
        else:
            rows.append((f"prefill {key} ({flag})", "ran", "", "", "no CUDA: no memory figures"))
    return rows


def cmd_report(args) -> int:
    out = Path(args.out)
    bench = json.loads((out / "bench.json").read_text()) if (out / "bench.json").exists() else {}
    junit = _junit(out / "pytest_junit.xml")
    tests = _tests_jsonl(out / "tests_gpu.jsonl")
    rcs = {"pytest": args.pytest_rc, "bench": args.bench_rc}
    # the bench part writes the environment; without it (other parts only) the report reads it now
    env = bench.get("env") or section_env(out)
    device_type = bench.get("device_type") or ("cuda" if _cuda() else "cpu")
    rows = serve_rows(out) + report_rows(bench, junit, tests, rcs)
    dev = env.get("device", "?")
    smi = _g(env, "nvidia_smi_start", "gpus")
    if smi:
        s = smi[0]
        busy = (_g(env, "nvidia_smi_after_host_links", "gpus") or [{}])[0]
        dev += (f", driver {s.get('driver_version')}, PCIe gen {busy.get('pcie.link.gen.current', '?')} "
                f"x{busy.get('pcie.link.width.current', '?')} after the copies "
                f"(max gen {s.get('pcie.link.gen.max', '?')} x{s.get('pcie.link.width.max', '?')})")
    title = (f"radianced gpu_check: {env.get('date_utc', '?')}, {dev}, commit {env.get('commit', '?')}, "
             f"fingerprint {env.get('fingerprint', '?')}, torch {env.get('torch', '?')}")
    warn = []
    if device_type != "cuda":
        warn.append("**CPU dry run: no CUDA here. These numbers describe this CPU and only show that the code runs.**")
    if env.get("commit", "unknown").startswith("unknown"):
        warn.append("commit unknown: set RADIANCED_COMMIT (the fingerprint still identifies the code)")
    for k, v in rcs.items():
        if v not in (None, 0):
            warn.append(f"{k} exited {v}" + (" (timed out)" if v in (124, 137) else ""))
    md = [f"## {title}", ""] + [f"> {w}" for w in warn] + ([""] if warn else [])
    md += ["| row | measured | floor / reference (same run) | ratio | note |", "|---|---|---|---|---|"]
    md += ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows]
    text = "\n".join(md) + "\n"
    (out / "results.md").write_text(text)
    _write_json(out / "results.json", {"bench": bench, "tests": tests, "junit": junit, "exit_codes": rcs,
                                       "table": [dict(zip(("row", "measured", "floor", "ratio", "note"), r))
                                                 for r in rows]})
    print(text, flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--quick", action="store_true", help="small sizes (automatic without CUDA)")
    p = sub.add_parser("report")
    p.add_argument("--out", required=True)
    p.add_argument("--pytest-rc", type=int)
    p.add_argument("--bench-rc", type=int)
    sub.add_parser("fingerprint")
    c = sub.add_parser("budget-child", help="internal: the budget section in a fresh process")
    c.add_argument("--result", required=True)
    c.add_argument("--tmp", required=True)
    c.add_argument("--quick", action="store_true")
    c.add_argument("--embedding-placement", choices=tuple(BUDGET_SECTIONS.values()), required=True)
    args = ap.parse_args(argv)
    if args.cmd == "budget-child":
        return cmd_budget_child(args)
    if args.cmd == "run":
        return cmd_run(args)
    if args.cmd == "report":
        return cmd_report(args)
    print(fingerprint())
    return 0


if __name__ == "__main__":
    sys.exit(main())
