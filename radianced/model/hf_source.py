"""A Hugging Face model folder as a conversion source: its metadata files and its safetensors shards.

`read_folder` reads what describes the model (config.json, the tokenizer, the
chat template, generation_config.json); `Shards` indexes every tensor of the
safetensors files from their headers alone and reads one tensor (or one part of
one) at a time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from radianced.model.config import ModelConfig, UnsupportedModel
from radianced.model.convert import ConvertError

REMAP_BYTES = 64 << 20  # unmap the shards after serving this much, so the pages read leave our RSS

# safetensors dtype strings -> torch
ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


# -- the folder ----------------------------------------------------------------


@dataclass(frozen=True)
class HFFolder:
    """What a Hugging Face folder says about its model, weights aside.

    path: the folder.
    hf_config: config.json as read.
    model: the `ModelConfig` built from it (num_mtp_layers as config.json says).
    tokenizer_json: tokenizer.json's text.
    chat_template: the chat template (see `_chat_template`), or None.
    generation: generation_config.json, or {} without one.
    """

    path: Path
    hf_config: dict
    model: ModelConfig
    tokenizer_json: str
    chat_template: str | None
    generation: dict


def read_folder(path: Path) -> HFFolder:
    """config.json, tokenizer.json, the chat template and generation_config.json; no weights."""
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ConvertError(f"{path}: config.json is missing; is this a Hugging Face model folder?")
    hf = _read_json(cfg_path)
    if "quantization_config" in hf and not _block_fp8(hf["quantization_config"]):
        method = hf["quantization_config"].get("quant_method", "?")
        raise ConvertError(f"{cfg_path}: quantized checkpoints ({method}) are not supported, except block-scaled "
                           f"FP8 (quant_method fp8, weight_block_size [128, 128]); convert the bf16 release of this model")
    try:
        model = ModelConfig.from_hf(hf)
    except UnsupportedModel as e:
        raise ConvertError(f"{cfg_path}: {e}") from None
    except KeyError as e:
        raise ConvertError(f"{cfg_path}: required field {e.args[0]!r} is missing") from None
    tok_path = path / "tokenizer.json"
    if not tok_path.is_file():
        raise ConvertError(f"{path}: tokenizer.json is missing; radianced needs the fast tokenizer file "
                           f"(AutoTokenizer.from_pretrained(folder).save_pretrained(folder) writes it)")
    gen_path = path / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.is_file() else {}
    return HFFolder(path, hf, model, tok_path.read_text(encoding="utf-8"), _chat_template(path), generation)


def _block_fp8(q: dict) -> bool:
    """Whether a quantization_config is Hugging Face's block-scaled FP8 in 128 x 128 blocks (kept as fp8_b128)."""
    return (q.get("quant_method") == "fp8" and list(q.get("weight_block_size") or []) == [128, 128]
            and q.get("fmt", "e4m3") == "e4m3")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path}: cannot read it as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConvertError(f"{path}: expected a JSON object")
    return data


def _chat_template(path: Path) -> str | None:
    """chat_template.jinja wins (transformers 5 writes it); else tokenizer_config.json's chat_template."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tc_path = path / "tokenizer_config.json"
    if not tc_path.is_file():
        return None
    template = _read_json(tc_path).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


# -- the safetensors files ------------------------------------------------------


@dataclass(frozen=True)
class SourceTensor:
    """Where one checkpoint tensor is, from its shard's header.

    file: the safetensors file holding it.
    shape: its shape.
    dtype: its safetensors dtype string, e.g. "BF16" (a key of ST_DTYPES if a float).
    """

    file: Path
    shape: tuple[int, ...]
    dtype: str


class Shards:
    """Every tensor in the folder's safetensors files, read one at a time.

    Opening a shard maps it; pages read through the mapping count in our RSS
    until it is unmapped, so the open shards are dropped (and reopened when
    next needed) each time REMAP_BYTES have been read.
    """

    def __init__(self, folder: Path):
        self.folder = folder
        self.tensors: dict[str, SourceTensor] = {}
        for file in self._files(folder):
            try:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():
                        sl = f.get_slice(name)
                        if name in self.tensors:
                            raise ConvertError(f"{folder}: tensor {name} is in both {self.tensors[name].file.name} "
                                               f"and {file.name}")
                        self.tensors[name] = SourceTensor(file, tuple(sl.get_shape()), sl.get_dtype())
            except (SafetensorError, OSError) as e:
                raise ConvertError(f"{file}: not a readable safetensors file ({e}); download it again") from None
        self._open: dict[Path, object] = {}
        self._served = 0  # bytes read since the shards were last unmapped

    @staticmethod
    def _files(folder: Path) -> list[Path]:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_json(index).get("weight_map") or {}
            files = [folder / n for n in sorted(set(weight_map.values()))]
            for f in files:
                if not f.is_file():
                    raise ConvertError(f"{index} lists {f.name}, which is missing from {folder}")
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ConvertError(f"{folder}: no *.safetensors files; radianced converts safetensors checkpoints")
        return files

    def where(self, name: str) -> str:
        return f"{self.tensors[name].file}"

    def read(self, name: str, index: int | slice | None = None) -> torch.Tensor:
        """The tensor `name`, or `name[index]` (only that part is read)."""
        src = self.tensors[name]
        f = self._open.get(src.file)
        if f is None:
            f = self._open[src.file] = safe_open(src.file, framework="pt")
        t = f.get_tensor(name) if index is None else f.get_slice(name)[index]
        self._served += t.numel() * t.element_size()
        return t

    def release_if_due(self) -> None:
        """Unmap the shards once REMAP_BYTES were read; call between tensors, once their reads are dropped."""
        if self._served >= REMAP_BYTES:
            self._open.clear()
            self._served = 0

    def close(self) -> None:
        self._open.clear()

