"""Convert a model to `.rad`: a Hugging Face folder here, a `.gguf` file in `gguf.py`.

The Hugging Face converter checks the whole folder first (config, tokenizer,
every tensor's name and shape against the config) using only the safetensors
headers, then streams: one tensor (or one expert's three pieces) is read,
optionally cast, written and dropped before the next. Large tensors go through
in row blocks of at most CHUNK_BYTES, so the converter's own memory stays near
one block whatever the model size.

Names in the `.rad` are the Hugging Face checkpoint names
(`model.layers.0.self_attn.q_proj.weight`, ...). Routed experts are never plain
tensors: each (layer, expert) becomes one `RadWriter.add_expert` extent, from
either checkpoint layout (per-expert `mlp.experts.E.{gate,up,down}_proj.weight`,
or transformers-5 fused `mlp.experts.gate_up_proj` [E, 2I, H] + `down_proj`
[E, H, I]). Qwen3-Next `mtp.*` weights are kept as plain tensors under their
names, except the MTP layers' routed experts: MTP layer j's experts are extents
at layer `num_hidden_layers + j`, so the expert tiers can serve them like any
other layer. `num_mtp_layers` in the stored config counts the MTP layers
actually present in the checkpoint.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import msgspec
import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from radianced.model.config import ModelConfig, UnsupportedModel
from radianced.model.rad import DTYPE_NAMES, RadWriter

CASTS = {"bf16": torch.bfloat16, "fp32": torch.float32}
CHUNK_BYTES = 64 << 20  # largest row block read at once
REMAP_BYTES = 64 << 20  # unmap the shards after serving this much, so the pages read leave our RSS

# safetensors dtype strings -> torch
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # a buffer some old checkpoints saved
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


class ConvertError(Exception):
    """The source cannot be converted; the message names the file and tensor and what to do."""


def convert(src: str | Path, dst: str | Path, dtype: str | None = None) -> None:
    """Convert `src` (a Hugging Face folder or a `.gguf` file) to the `.rad` at `dst`.

    `dtype` None keeps each tensor's dtype; "bf16" or "fp32" casts every tensor.
    On any error nothing is left at `dst` (an existing file there is replaced
    only by a finished conversion).
    """
    src, dst = Path(src), Path(dst)
    if dtype is not None and dtype not in CASTS:
        raise ConvertError(f"--dtype {dtype!r} is not supported; use one of {', '.join(CASTS)} (or omit it)")
    if dst.is_dir():
        raise ConvertError(f"{dst} is a folder; give the path of the .rad file to write")
    if src.is_dir():
        convert_hf(src, dst, dtype)
    elif src.is_file() and src.suffix.lower() == ".gguf":
        if dst.resolve() == src.resolve():
            raise ConvertError(f"{dst}: the output would overwrite the source")
        from radianced.model.gguf import convert_gguf  # imported only when needed (pulls in gguf, numpy)

        try:
            convert_gguf(src, dst, dtype)
        except (UnsupportedModel, ValueError) as e:  # gguf.py's refusals and GGUFReader's parse errors
            raise ConvertError(f"{src}: {e}") from None
    elif not src.exists():
        raise ConvertError(f"{src}: no such file or folder")
    else:
        raise ConvertError(f"{src}: not a Hugging Face model folder nor a .gguf file")


# -- the folder ----------------------------------------------------------------


@dataclass(frozen=True)
class HFFolder:
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
    if "quantization_config" in hf:
        method = hf["quantization_config"].get("quant_method", "?")
        raise ConvertError(f"{cfg_path}: quantized checkpoints ({method}) are not supported; "
                           f"convert the bf16 release of this model")
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
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string, e.g. "BF16"


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


# -- the plan: what the .rad will hold, checked against the config -----------------


@dataclass(frozen=True)
class PlainTensor:
    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ExpertPieces:
    layer: int  # .rad layer index (MTP layer j -> num_hidden_layers + j)
    expert: int
    prefix: str  # "model.layers.3.mlp.experts."
    fused: bool  # gate_up_proj [E, 2I, H] + down_proj [E, H, I], else per-expert tensors
    inter: int


def expected_layer(cfg: ModelConfig, p: str, layer_type: str, moe: bool) -> list[tuple[str, tuple[int, ...]]]:
    """Non-expert tensors of one decoder layer with name prefix `p`, and their shapes."""
    H, d = cfg.hidden_size, cfg.head_dim
    out = [(f"{p}input_layernorm.weight", (H,)), (f"{p}post_attention_layernorm.weight", (H,))]
    if layer_type == "linear_attention":  # Gated DeltaNet
        key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        nv = cfg.linear_num_value_heads
        a = f"{p}linear_attn."
        out += [(f"{a}in_proj_qkvz.weight", (2 * key_dim + 2 * value_dim, H)),
                (f"{a}in_proj_ba.weight", (2 * nv, H)),
                (f"{a}conv1d.weight", (2 * key_dim + value_dim, 1, cfg.linear_conv_kernel_dim)),
                (f"{a}dt_bias", (nv,)), (f"{a}A_log", (nv,)),
                (f"{a}norm.weight", (cfg.linear_value_head_dim,)),
                (f"{a}out_proj.weight", (H, value_dim))]
    else:
        q_rows = cfg.num_attention_heads * d * (2 if cfg.family == "qwen3_next" else 1)  # next: query + gate
        kv_rows = cfg.num_key_value_heads * d
        a = f"{p}self_attn."
        out += [(f"{a}q_proj.weight", (q_rows, H)), (f"{a}k_proj.weight", (kv_rows, H)),
                (f"{a}v_proj.weight", (kv_rows, H)), (f"{a}o_proj.weight", (H, cfg.num_attention_heads * d))]
        if cfg.attention_bias:
            out += [(f"{a}q_proj.bias", (q_rows,)), (f"{a}k_proj.bias", (kv_rows,)),
                    (f"{a}v_proj.bias", (kv_rows,)), (f"{a}o_proj.bias", (H,))]
        if cfg.family != "llama":
            out += [(f"{a}q_norm.weight", (d,)), (f"{a}k_norm.weight", (d,))]
    m = f"{p}mlp."
    if moe:
        out.append((f"{m}gate.weight", (cfg.num_experts, H)))
        if cfg.shared_expert_intermediate_size:
            si = cfg.shared_expert_intermediate_size
            out += [(f"{m}shared_expert.gate_proj.weight", (si, H)), (f"{m}shared_expert.up_proj.weight", (si, H)),
                    (f"{m}shared_expert.down_proj.weight", (H, si)), (f"{m}shared_expert_gate.weight", (1, H))]
    else:
        inter = cfg.intermediate_size
        out += [(f"{m}gate_proj.weight", (inter, H)), (f"{m}up_proj.weight", (inter, H)),
                (f"{m}down_proj.weight", (H, inter))]
    return out


def plan_hf(cfg: ModelConfig, shards: Shards) -> tuple[ModelConfig, list[PlainTensor | ExpertPieces]]:
    """Every output in write order, checked against the source's names and shapes.

    Returns the config to store (num_mtp_layers set to the MTP layers present).
    Raises ConvertError naming the first missing, misshapen or unexpected tensor.
    """
    src = shards.tensors
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    plan: list[PlainTensor | ExpertPieces] = []
    shapes: dict[str, tuple[int, ...]] = {}  # every source tensor the plan reads, with its expected shape

    def plain(items):
        for name, shape in items:
            plan.append(PlainTensor(name, shape))
            shapes[name] = shape

    def layer(p: str, rad_layer: int, layer_type: str, moe: bool):
        plain(expected_layer(cfg, p, layer_type, moe))
        if not moe:
            return
        x = f"{p}mlp.experts."
        fused = f"{x}gate_up_proj" in src
        if fused:
            shapes[f"{x}gate_up_proj"], shapes[f"{x}down_proj"] = (E, 2 * I, H), (E, H, I)
        for e in range(E):
            if not fused:
                shapes.update({f"{x}{e}.gate_proj.weight": (I, H), f"{x}{e}.up_proj.weight": (I, H),
                               f"{x}{e}.down_proj.weight": (H, I)})
            plan.append(ExpertPieces(rad_layer, e, x, fused, I))

    plain([("model.embed_tokens.weight", (cfg.vocab_size, H))])
    for i in range(cfg.num_hidden_layers):
        layer(f"model.layers.{i}.", i, cfg.layer_type(i), cfg.is_moe_layer(i))
    plain([("model.norm.weight", (H,))])
    if not cfg.tie_word_embeddings:
        plain([("lm_head.weight", (cfg.vocab_size, H))])
    mtp = sorted({int(m.group(1)) for n in src if (m := _MTP_LAYER.match(n))})
    n_mtp = max(mtp) + 1 if mtp else 0
    if cfg.family == "qwen3_next" and any(n.startswith("mtp.") for n in src):
        plain([("mtp.fc.weight", (H, 2 * H)), ("mtp.pre_fc_norm_embedding.weight", (H,)),
               ("mtp.pre_fc_norm_hidden.weight", (H,)), ("mtp.norm.weight", (H,))])
        for j in range(n_mtp):
            p = f"mtp.layers.{j}."
            layer(p, cfg.num_hidden_layers + j, "full_attention", cfg.num_experts > 0)
    else:
        n_mtp = 0

    folder = shards.folder
    for name, shape in shapes.items():
        if name not in src:
            raise ConvertError(f"{folder}: tensor {name} is missing (no safetensors file in the folder has it); "
                               f"the weights do not match config.json")
        if src[name].shape != shape:
            raise ConvertError(f"{shards.where(name)}: tensor {name} has shape {list(src[name].shape)}, but "
                               f"config.json implies {list(shape)}; the weights do not match the config")
    for name in src:
        if name in shapes or _IGNORED.search(name) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        raise ConvertError(f"{shards.where(name)}: unexpected tensor {name}: radianced's {cfg.family} model has "
                           f"no such weight (is config.json the one for these weights?)")
    return msgspec.structs.replace(cfg, num_mtp_layers=n_mtp), plan


# -- writing --------------------------------------------------------------------


def convert_hf(src: Path, dst: Path, dtype: str | None = None) -> None:
    """Hugging Face folder -> `.rad`; validates everything before writing, then streams."""
    folder = read_folder(src)
    shards = Shards(src)
    model, plan = plan_hf(folder.model, shards)
    cast = CASTS[dtype] if dtype else None
    _check_dtypes(shards, plan, cast)
    try:
        with RadWriter(dst, model=model, tokenizer_json=folder.tokenizer_json, chat_template=folder.chat_template,
                       generation=folder.generation, source=f"hf:{src.resolve()}") as w, \
                tqdm(total=len(plan), desc=f"converting {src.name}", unit="tensor",
                     disable=not sys.stderr.isatty(), file=sys.stderr) as bar:
            for item in plan:
                if isinstance(item, PlainTensor):
                    out_dtype = cast or _ST_DTYPES[shards.tensors[item.name].dtype]
                    w.add_tensor_chunks(item.name, out_dtype, item.shape, _row_blocks(shards, item, cast))
                else:
                    w.add_expert(item.layer, item.expert, *_expert_pieces(shards, item, cast))
                shards.release_if_due()
                bar.update()
    except SafetensorError as e:
        raise ConvertError(f"{src}: reading the weights failed ({e}); download the checkpoint again") from None
    finally:
        shards.close()


def _check_dtypes(shards: Shards, plan: list, cast: torch.dtype | None) -> None:
    for item in plan:
        if isinstance(item, PlainTensor):
            names = [item.name]
        elif item.fused:
            names = [f"{item.prefix}gate_up_proj", f"{item.prefix}down_proj"]
        else:
            names = [f"{item.prefix}{item.expert}.{w}_proj.weight" for w in ("gate", "up", "down")]
        for name in names:
            st = shards.tensors[name].dtype
            torch_dtype = _ST_DTYPES.get(st)
            if torch_dtype is None:
                raise ConvertError(f"{shards.where(name)}: tensor {name} has dtype {st}; radianced converts "
                                   f"floating-point weights only")
            if cast is None and torch_dtype not in DTYPE_NAMES:
                raise ConvertError(f"{shards.where(name)}: tensor {name} is {st}, which a .rad cannot hold; "
                                   f"pass --dtype bf16 or --dtype fp32 to cast")
        if not isinstance(item, PlainTensor) and cast is None:
            if len({shards.tensors[n].dtype for n in names}) > 1:
                raise ConvertError(f"{shards.where(names[0])}: the pieces of expert {item.prefix}{item.expert} "
                                   f"differ in dtype; pass --dtype bf16 or --dtype fp32 to cast")


def _row_blocks(shards: Shards, item: PlainTensor, cast: torch.dtype | None) -> Iterator[torch.Tensor]:
    """The tensor in row blocks of at most CHUNK_BYTES (whole when small), cast block by block."""
    itemsize = _ST_DTYPES[shards.tensors[item.name].dtype].itemsize
    nbytes = math.prod(item.shape) * itemsize
    if len(item.shape) < 2 or nbytes <= CHUNK_BYTES:
        blocks = [None]
    else:
        rows = max(1, CHUNK_BYTES // (math.prod(item.shape[1:]) * itemsize))
        blocks = [slice(r, min(r + rows, item.shape[0])) for r in range(0, item.shape[0], rows)]
    for index in blocks:
        block = shards.read(item.name, index)
        yield block if cast is None else block.to(cast)
        del block
        shards.release_if_due()  # within a large tensor too: its pages leave as the blocks are written


def _expert_pieces(shards: Shards, item: ExpertPieces, cast: torch.dtype | None):
    """gate [I, H], up [I, H], down [H, I] of one expert; for a fused layout only its slice is read."""
    x, e = item.prefix, item.expert
    if item.fused:
        gate_up = shards.read(f"{x}gate_up_proj", e)  # [2I, H], gate first
        gate, up = gate_up[:item.inter], gate_up[item.inter:]
        down = shards.read(f"{x}down_proj", e)  # [H, I]
    else:
        gate, up, down = (shards.read(f"{x}{e}.{w}_proj.weight") for w in ("gate", "up", "down"))
    if cast is not None:
        gate, up, down = gate.to(cast), up.to(cast), down.to(cast)
    return gate, up, down
