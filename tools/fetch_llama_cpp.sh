#!/usr/bin/env bash
# llama.cpp's source for issue 24's peer rows, pruned to what a CPU + CUDA build of llama-bench needs:
# .llama-cpp/llama.cpp.tar.xz (git-ignored; carry that file alone to the device, which cannot reach PyPI).
#
#   bash tools/fetch_llama_cpp.sh          # then: tools/build_llama_cpp.sh on the device (or here, CPU only)
#
# The source is the copy llama-cpp-python's sdist vendors (PyPI is reachable from here, GitHub is not).
# Whole, that sdist is 77 MB, over a device call's 64 MiB of carried files; its docs, vocabulary GGUFs,
# examples, tests, web UI and the backends other than CPU and CUDA are left out (about 6 MB compressed).
set -euo pipefail
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
out=.llama-cpp
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download "llama-cpp-python==$version" --no-deps --no-binary :all: -d "$tmp" -q
tar xzf "$tmp/llama_cpp_python-$version.tar.gz" -C "$tmp"
src="$tmp/llama_cpp_python-$version/vendor/llama.cpp"
rm -rf "$src"/{.git,docs,models,media,examples,tests,benches,tools/ui}  # .git: the sdist's submodule link
for backend in "$src"/ggml/src/ggml-*/; do
  case $(basename "$backend") in ggml-cpu|ggml-cuda) ;; *) rm -rf "$backend" ;; esac
done
mkdir -p "$out"
tar cJf "$out/llama.cpp.tar.xz" -C "$(dirname "$src")" llama.cpp
echo "$out/llama.cpp.tar.xz: llama.cpp from llama-cpp-python $version, $(du -h "$out/llama.cpp.tar.xz" | cut -f1)"
