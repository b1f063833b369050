"""Convert a model to `.rad`: a Hugging Face folder (`convert_hf.py`) or a `.gguf` file (`gguf.py`).

`convert` picks the converter by what `src` is and imports it then: the GGUF
one pulls in gguf and numpy, and the Hugging Face one imports `ConvertError`
and `CASTS` from here. Either checks the whole source before it writes, and on
any error leaves nothing at the destination.
"""

from __future__ import annotations

from pathlib import Path

import torch

from radianced.model.config import UnsupportedModel

CASTS = {"bf16": torch.bfloat16, "fp32": torch.float32}


class ConvertError(Exception):
    """The source cannot be converted; the message names the file and tensor and what to do."""


def convert(src: str | Path, dst: str | Path, dtype: str | None = None, *, compact: bool = False,
            quantize: str | None = None) -> None:
    """Convert `src` (a Hugging Face folder or a `.gguf` file) to the `.rad` at `dst`.

    `dtype` None keeps each tensor's dtype; "bf16" or "fp32" casts every tensor.
    `compact` keeps a GGUF's quantized blocks as they are (a Hugging Face folder's
    block-scaled FP8 is always kept). `quantize` ("experts=int4,layers=fp8",
    `model/quantize.py`) requantizes the classes it names (a GGUF's blocks dequantized first).
    On any error nothing is left at `dst` (an existing file there is replaced
    only by a finished conversion).
    """
    src, dst = Path(src), Path(dst)
    if dtype is not None and dtype not in CASTS:
        raise ConvertError(f"--dtype {dtype!r} is not supported; use one of {', '.join(CASTS)} (or omit it)")
    formats = None
    if quantize is not None:
        from radianced.model.quantize import parse_quantize

        try:
            formats = parse_quantize(quantize)
        except ValueError as e:
            raise ConvertError(str(e)) from None
    if dst.is_dir():
        raise ConvertError(f"{dst} is a folder; give the path of the .rad file to write")
    if src.is_dir():
        from radianced.model.convert_hf import convert_hf

        convert_hf(src, dst, dtype, formats)
    elif src.is_file() and src.suffix.lower() == ".gguf":
        if dst.resolve() == src.resolve():
            raise ConvertError(f"{dst}: the output would overwrite the source")
        from radianced.model.gguf import convert_gguf

        try:
            convert_gguf(src, dst, dtype, compact, formats)
        except (UnsupportedModel, ValueError) as e:  # gguf.py's refusals and GGUFReader's parse errors
            raise ConvertError(f"{src}: {e}") from None
    elif not src.exists():
        raise ConvertError(f"{src}: no such file or folder")
    else:
        raise ConvertError(f"{src}: not a Hugging Face model folder nor a .gguf file")
