#!/usr/bin/env bash
# Download, here, the wheels tools/gpu_check installs on the device machine, which
# has no package index. Run from anywhere; writes <repo>/.whl/ and .whl-lite/ (git-ignored; carry one).
#
# The device image (Python 3.12.3, x86-64) already holds torch, numpy, xxhash,
# safetensors, tokenizers, jinja2, tqdm, psutil, pytest and an older transformers
# (/work/.library/device/KINDS.md). What it lacks or holds at another version:
#   msgspec       not in the image; radianced imports it everywhere (config, .rad header)
#   transformers  the image has 5.17.0; make_tiny and the CPU tests use the pinned 5.24.0
#   regex         transformers checks regex>=2025.10.22 at import; the image's version is unknown
#   fla-core      the Gated DeltaNet chunked prefill (kernels/deltanet.py; the `gpu` extra, not in .venv).
#                 Pinned: 0.6.0 has grouped value heads (Hv > Hk) and chunk_size, knows triton 3.6 to 3.8,
#                 needs torch>=2.7 and einops (in the image); pure Python
#   liburing      the disk reader (tiers/disk.py, imported by the engine). Pinned 2024.5.3 (the newer wheels need
#                 AVX-512); PyPI has no cp312 wheel of it, so it is built here from its sdist by a Python 3.12
#                 (PY312; default python3.12, else pyenv's), with dynamic_import, its pure-Python dependency
# Versions follow this checkout's .venv, so the device runs what the CPU tests run (fla-core: pinned here).
#   starlette, uvicorn  the daemon's HTTP (server/): not in the image, so the daemon itself can serve there
#                 (their needs anyio, h11 and click are in the image; uvloop is too)
#   accelerate    tools/bench_peer_offload.py's peer (transformers' device_map="auto" offload); the image has
#                 1.15.0, the CPU tests run this checkout's; pure Python, its needs are in the image
#   openai        the HTTP tests' SDK client (tests/server, gpu_check's `http` part), with what it needs at
#                 this checkout's versions (the image's anyio and typing-extensions may be older; httpx2,
#                 httpcore2, truststore, pydantic, pydantic-core, jiter, annotated-types, typing-inspection
#                 and sniffio may be missing); pytest-asyncio runs their async tests
#   gguf          the SmolLM2 GPU test converts the real model's GGUF there (carried in two parts: it is
#                 94 MiB, one call carries 64 MiB; see bench/README.md); pure Python, its needs are in the image
#   matplotlib, rich  `radiancectl bench run` (gpu_check's `serve` part) draws its PNGs with matplotlib and shows
#                 progress with rich (on a terminal only); neither is in the image, nor are matplotlib's contourpy,
#                 cycler, fonttools, kiwisolver, pillow, pyparsing, python-dateutil (4.x: it needs tzdata, not six)
#                 or rich's markdown-it-py, mdurl, pygments (packaging is: transformers needs it). ~26 MiB
#   py-spy        tools/gil_sample.py samples which thread holds the GIL during bench_served's burst (a binary:
#                 the install puts it in $SITE/bin, which gpu_check puts on PATH)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi
version() { $PY -c "import importlib.metadata as m; print(m.version('$1'))"; }
WANT=("msgspec==$(version msgspec)" "transformers==$(version transformers)" "regex==$(version regex)"
      "fla-core==0.6.0" "gguf==$(version gguf)" "starlette==$(version starlette)" "uvicorn==$(version uvicorn)"
      "accelerate==$(version accelerate)" "py-spy==$(version py-spy)")
for p in openai httpx2 httpcore2 truststore anyio idna pydantic pydantic-core jiter annotated-types \
    typing-inspection typing-extensions sniffio pytest-asyncio matplotlib contourpy cycler fonttools kiwisolver \
    pillow pyparsing python-dateutil tzdata rich markdown-it-py mdurl pygments; do WANT+=("$p==$(version $p)"); done
rm -rf .whl
mkdir -p .whl
for spec in "${WANT[@]}"; do
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done
if [ -z "${PY312:-}" ]; then  # python3.12 on PATH, else a pyenv 3.12 (its shim fails when 3.12 is not selected)
  PY312=python3.12
  if ! python3.12 -c '' 2>/dev/null; then PY312=$(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1); fi
fi
if [ -z "$PY312" ] || ! "$PY312" -c '' 2>/dev/null; then
  echo "fetch_wheels: no Python 3.12 ($PY312) to build the liburing wheel the device needs; set PY312" >&2
  exit 1
fi
$PY312 -m pip wheel -q --no-binary liburing -w .whl "liburing==$(version liburing)"
ls -l .whl
du -sh .whl
# .whl-lite: hard links of what the daemon and the benchmarks need, without the test-only wheels (transformers,
# openai and its pydantic, accelerate, pytest-asyncio, regex): .whl (~54 MB) beside the tracked files passes the
# 64 MiB a device call carries; carry .whl-lite then (gpu_check installs from it when .whl is absent)
rm -rf .whl-lite
mkdir -p .whl-lite
for w in .whl/*.whl; do
  case $(basename "$w") in
    transformers-*|openai-*|pydantic*|jiter-*|annotated_types-*|typing_inspection-*|accelerate-*|pytest_asyncio-*|\
    regex-*|httpx2-*|httpcore2-*|truststore-*) ;;
    *) ln -f "$w" .whl-lite/ ;;
  esac
done
du -sh .whl-lite
