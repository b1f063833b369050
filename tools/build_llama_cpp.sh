#!/usr/bin/env bash
# Build llama.cpp's llama-bench from .llama-cpp/llama.cpp.tar.xz (tools/fetch_llama_cpp.sh): with CUDA for
# sm_90 where a GPU answers nvidia-smi (the device), else for the CPU. The build folder (.llama-cpp/build, git-ignored)
# is kept between device calls on a warm machine, so a build cut off by a call's limit goes on in the next.
#
#   bash tools/build_llama_cpp.sh [JOBS]    # -> .llama-cpp/build/bin/llama-bench
set -euo pipefail
root=.llama-cpp
jobs=${1:-$(nproc)}
if [ ! -f "$root/llama.cpp.tar.xz" ]; then
  echo "no $root/llama.cpp.tar.xz: run tools/fetch_llama_cpp.sh where PyPI is reachable and carry $root"
  exit 2
fi
[ -d "$root/llama.cpp" ] || tar xJf "$root/llama.cpp.tar.xz" -C "$root"
cuda=OFF  # with CUDA where a GPU answers (a CUDA toolkit without one, as on the CPU machine, is not enough)
if nvidia-smi -L >/dev/null 2>&1; then
  cuda=ON
  export PATH="/usr/local/cuda/bin:$PATH"
fi
cmake -S "$root/llama.cpp" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=$cuda \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF >"$root/cmake.log"
cmake --build "$root/build" --target llama-bench -j "$jobs"
echo "llama-bench built (CUDA $cuda): $root/build/bin/llama-bench"
