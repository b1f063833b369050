"""Synthetic `.rad` models: real per-layer shapes, random weights, a router skew you choose.

    python tools/make_synthetic.py OUT.rad --layers 8 [--shape qwen3-30b-a3b] [--zipf 1.2] \
        [--dtype bf16] [--seed 0] [--vocab N] [--narrow 1] [--device cuda] [--quantize experts=int4]

For benchmarks only (the header says `synthetic`): the weights are random, so
the text is noise, but every tensor has the shape, dtype and byte size of the
real model's, so time and memory are the real model's per layer. `--layers`
chooses how many of the real model's decoder layers to write.

Weights look like a trained model's in scale: matrices normal with std 0.02,
norm multipliers near 1, Qwen3-Next's DeltaNet decays in a range where the state
neither vanishes nor is kept whole. Activations stay finite in bf16.

Routing. `zipf` s makes expert e of a layer (at rank r_e of a per-layer random
permutation) chosen by a fraction of tokens proportional to 1 / r_e^s, capped
at 1 (every token chooses top_k experts, so the most popular ones saturate).
How: a few hidden dimensions D = {u} + S (S: max(16, hidden/32) of them) are
kept out of every layer's output (the rows D of o_proj, out_proj and every down
projection are zero), so a token's residual stream in D is its embedding in D
at every depth. The embedding holds a constant `a` in dimension u and random
values in S. Each router reads only D: its logits are (x_S . W_S[e] + a c_e) /
rms(x), where W_S has random unit rows and the offsets c_e are fitted, at
generation time, so that top_k over the embedding rows of a sample of the
vocabulary picks expert e with the target frequency. rms(x) scales all of a
token's logits alike, so the choice is the same at any depth; the histogram
over random prompts is the target whatever the layer count. The price: a
token's experts depend on the token, not its context (no per-request locality
beyond repeated tokens). zipf 0 fits uniform frequencies.

Generation runs on `--device` (cuda: tens of GiB in well under a minute of
compute); the file is written in large sequential writes through
`radianced.model.rad_writer.RadWriter`, one tensor or one layer's experts in memory at
a time. The same arguments on the same device kind write the same bytes.
`narrow` divides the width (hidden size, head counts, intermediate sizes) for
tests on a CPU; experts, top_k, head dims and the layer pattern stay.

Compact weights (`--quantize`, `radiancectl convert`'s classes and schemes: experts,
layers; model/quantize.py): the random tensors are made as above and quantized on
`--device` as they are written, so a compact model is its float twin (same seed)
rounded, routing included: the rows D stay zero in every format. The embeddings
class is refused (the tables are written in row blocks).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

from radianced.model.config import ModelConfig  # noqa: E402
from radianced.model.hf_plan import expected_layer  # noqa: E402
from radianced.model.quantize import fits, parse_quantize, plain_format, quantize as to_compact  # noqa: E402
from radianced.model.rad_format import DTYPES  # noqa: E402
from radianced.model.rad_writer import RadWriter  # noqa: E402
from radianced.model.tiny import CHAT_TEMPLATE, ENDOFTEXT_ID, IM_END_ID, VOCAB_SIZE, _write_tokenizer  # noqa: E402

GiB = 1 << 30
STD = 0.02  # matrices, like a trained model's initializer_range
BLOCK_BYTES = 64 << 20  # largest row block of a plain tensor generated at once
EXPERT_GROUP_BYTES = 512 << 20  # experts generated at once (one device -> host copy)
CALIBRATION_TOKENS = 16384  # embedding rows the router offsets are fitted on

# The released configs (config.json on the Hub; ../shared/REFERENCE.md), as ModelConfig fields.
SHAPES: dict[str, dict] = {
    "qwen3-30b-a3b": dict(
        family="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
        intermediate_size=6144, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True),
    "qwen3-next-80b-a3b": dict(
        family="qwen3_next", vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, rms_norm_eps=1e-6, rope_theta=1e7, max_position_embeddings=262144,
        partial_rotary_factor=0.25, intermediate_size=5120, num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32),
}
FULL_ATTENTION_INTERVAL = 4  # qwen3-next: layers 3, 7, ... are full attention


class SyntheticError(ValueError):
    """The arguments describe no model this tool can write; the message says which and what would."""


# -- the config -----------------------------------------------------------------


def shape_config(shape: str, layers: int, narrow: int = 1, vocab: int | None = None) -> ModelConfig:
    """The ModelConfig of `shape` with `layers` decoder layers, width divided by `narrow`, `vocab` tokens.

    Qwen3-Next keeps its pattern (full attention at every 4th layer); with fewer
    than 4 layers the last one is full attention, so the model has KV.
    """
    if shape not in SHAPES:
        raise SyntheticError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    if layers < 1:
        raise SyntheticError(f"layers must be at least 1, got {layers}")
    f = dict(SHAPES[shape])
    if vocab is not None:
        if vocab < VOCAB_SIZE:
            raise SyntheticError(f"vocab {vocab} is below the tokenizer's {VOCAB_SIZE} tokens; "
                                 f"give --vocab >= {VOCAB_SIZE}")
        f["vocab_size"] = vocab
    if narrow != 1:
        f.update(_narrowed(f, narrow))
    f["num_hidden_layers"] = layers
    if f["family"] == "qwen3_next":
        types = ["full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
                 for i in range(layers)]
        if "full_attention" not in types:
            types[-1] = "full_attention"
        f["layer_types"] = tuple(types)
    return ModelConfig(**f, bos_token_id=ENDOFTEXT_ID, eos_token_ids=(IM_END_ID, ENDOFTEXT_ID))


def _narrowed(f: dict, n: int) -> dict:
    """Width fields divided by n (head counts at least 1, their ratios kept)."""
    if n < 1 or f["hidden_size"] % n or f["moe_intermediate_size"] % n:
        raise SyntheticError(f"narrow {n} must be a positive divisor of hidden {f['hidden_size']} and "
                             f"moe_intermediate {f['moe_intermediate_size']} (try 2, 4, 8 or 16)")
    out = {k: f[k] // n for k in ("hidden_size", "intermediate_size", "moe_intermediate_size",
                                  "shared_expert_intermediate_size") if f.get(k)}
    kv = max(1, f["num_key_value_heads"] // n)
    out.update(num_key_value_heads=kv, num_attention_heads=kv * (f["num_attention_heads"] // f["num_key_value_heads"]))
    if f.get("linear_num_key_heads"):
        k = max(1, f["linear_num_key_heads"] // n)
        out.update(linear_num_key_heads=k,
                   linear_num_value_heads=k * (f["linear_num_value_heads"] // f["linear_num_key_heads"]))
    return out


def _tokenizer_json(vocab: int) -> str:
    """tiny.py's byte-level BPE (400 tokens, Qwen's special tokens at 397..399), padded to `vocab` ids
    with tokens no merge produces (`<|synthetic_N|>`), so every id the model can emit decodes."""
    with tempfile.TemporaryDirectory(prefix="radianced-tok-") as tmp:
        _write_tokenizer(Path(tmp), seed=0)
        tok = json.loads((Path(tmp) / "tokenizer.json").read_text())
    # the special tokens are listed in the model's vocab too, so loading keeps them at ids 397..399
    # (an added token the model lacks would be renumbered after the fillers)
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    tok["model"]["vocab"].update({**specials, **{f"<|synthetic_{i}|>": i for i in range(VOCAB_SIZE, vocab)}})
    return json.dumps(tok, ensure_ascii=False)


# -- routing ----------------------------------------------------------------------


def routing_dims(hidden: int, gen: torch.Generator) -> tuple[int, torch.Tensor]:
    """(u, S): the constant dimension and the token-identity dimensions the routers read."""
    m = max(16, hidden // 32)
    dims = torch.randperm(hidden, generator=gen)[:m + 1]
    return int(dims[0]), dims[1:].sort().values


def zipf_targets(num_experts: int, top_k: int, zipf: float, ranks: torch.Tensor) -> torch.Tensor:
    """[E] fraction of tokens that choose each expert: min(1, c / rank^zipf), summing to top_k.

    ranks: [E] rank of each expert, 1 = the most popular.
    """
    w = ranks.double() ** -zipf
    order = w.argsort(descending=True)
    for capped in range(top_k + 1):  # the `capped` most popular experts saturate at 1
        rest = w[order[capped:]]
        c = (top_k - capped) / rest.sum()
        if c * rest.max() <= 1 + 1e-9:
            p = torch.ones_like(w)
            p[order[capped:]] = c * rest
            return p.float()
    raise AssertionError("unreachable: capping top_k experts always fits")


def fit_offsets(noise: torch.Tensor, target: torch.Tensor, top_k: int, iters: int = 30) -> torch.Tensor:
    """[E] offsets b such that top_k of (noise + b) picks expert e in about a `target[e]` share of rows.

    noise: [N, E] fp32 per-token logits without offsets; target: [E], summing to top_k.
    Start from the threshold picture (expert e is picked when its Gaussian noise plus
    b_e clears a common threshold: b_e = sigma * probit(target_e)), then correct in
    probit space from the realized shares until they are within 1% (total variation)
    of the target; two or three rounds in practice.
    """
    n, e = noise.shape
    sigma = float(noise.std())
    target = target.clamp(0.5 / n, 1 - 0.5 / n)
    b = sigma * _probit(target)
    for _ in range(iters):
        picked = (noise + b).topk(top_k, dim=1).indices.flatten()
        share = (torch.bincount(picked, minlength=e).float() / n).clamp(0.5 / n, 1 - 0.5 / n)
        if 0.5 * float((share - target).abs().sum()) / top_k < 0.01:
            break
        b += 0.7 * sigma * (_probit(target) - _probit(share))
    return b


def _probit(p: torch.Tensor) -> torch.Tensor:
    return math.sqrt(2) * torch.erfinv(2 * p - 1)


# -- weights ------------------------------------------------------------------------


class _Weights:
    """Random tensors on `device`, handed to the writer on the CPU."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: str, seed: int):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.gen = torch.Generator(self.device).manual_seed(seed)
        self.zero_centred = cfg.family == "qwen3_next"
        u, s = routing_dims(cfg.hidden_size, torch.Generator().manual_seed(seed + 1))
        self.u, self.s = u, s.to(self.device)
        self.protected = torch.cat((torch.tensor([u]), s)).to(self.device)  # rows no layer writes
        self.a = STD  # the constant of dimension u in every embedding row
        self.embed_s: torch.Tensor | None = None  # [N, |S|] fp32: sampled embedding rows in S, as stored

    def randn(self, shape, std: float = STD) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=self.device, dtype=self.dtype).mul_(std)

    def rand(self, shape) -> torch.Tensor:
        return torch.rand(shape, generator=self.gen, device=self.device, dtype=torch.float32)

    def chunks(self, name: str, shape: tuple[int, ...]) -> Iterator[torch.Tensor]:
        """The tensor `name` on the CPU: the [V, H] tables in row blocks of at most BLOCK_BYTES,
        the rest (at most tens of MiB, and rows D must be whole-tensor rows) in one piece."""
        if name == "model.embed_tokens.weight":
            yield from self._embedding(shape)
        elif name == "lm_head.weight":
            rows = max(1, BLOCK_BYTES // (shape[1] * self.dtype.itemsize))
            for r in range(0, shape[0], rows):
                yield self.randn((min(rows, shape[0] - r), shape[1])).cpu()
        else:
            yield self.plain(name, shape).cpu()

    def plain(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """One (block of a) non-expert tensor, by what its name says it is."""
        if name.endswith(("layernorm.weight", "model.norm.weight", "q_norm.weight", "k_norm.weight")):
            t = self.randn(shape).add_(0.0 if self.zero_centred else 1.0)  # multiplier near 1 either way
            if name.endswith("post_attention_layernorm.weight"):
                t[self.protected] = 0.0 if self.zero_centred else 1.0  # the router sees D as stored
            return t
        if name.endswith("linear_attn.norm.weight"):  # DeltaNet's gated output norm: the ordinary kind
            return self.randn(shape).add_(1.0)
        if name.endswith("A_log"):  # decay rate A in [0.05, 1]: exp(g) mostly in (0.5, 1)
            return (0.05 + 0.95 * self.rand(shape)).log().to(self.dtype)
        if name.endswith("dt_bias"):
            return self.randn(shape, 0.5).sub_(1.0)
        if name.endswith("conv1d.weight"):  # depthwise, kernel K: std 1/sqrt(K) / 2
            return self.randn(shape, 0.5 / math.sqrt(shape[-1]))
        t = self.randn(shape)
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            t[self.protected] = 0  # outputs never reach the routing dimensions
        return t

    def _embedding(self, shape: tuple[int, int]) -> Iterator[torch.Tensor]:
        """Embedding rows: random, dimension u = a; keeps a sample of the rows' S part for the routers."""
        rows = max(1, BLOCK_BYTES // (shape[1] * self.dtype.itemsize))
        take = torch.randperm(shape[0], generator=torch.Generator().manual_seed(0))[:CALIBRATION_TOKENS].sort().values
        kept = []
        for r in range(0, shape[0], rows):
            block = self.randn((min(rows, shape[0] - r), shape[1]))
            block[:, self.u] = self.a
            sel = take[(take >= r) & (take < r + block.shape[0])] - r
            kept.append(block[sel.to(self.device)][:, self.s].float())
            yield block.cpu()
        self.embed_s = torch.cat(kept)

    def router(self, shape: tuple[int, int], zipf: float) -> torch.Tensor:
        """[E, H] router reading only D: random unit rows in S, fitted offsets through u (module docstring)."""
        e, k = shape[0], self.cfg.num_experts_per_tok
        w_s = torch.randn((e, len(self.s)), generator=self.gen, device=self.device)
        w_s = (2.0 * w_s / w_s.norm(dim=1, keepdim=True)).to(self.dtype)  # rows of norm 2, as stored
        noise = self.embed_s @ w_s.float().T  # [N, E]
        ranks = torch.randperm(e, generator=self.gen, device=self.device) + 1
        offsets = fit_offsets(noise, zipf_targets(e, k, zipf, ranks.cpu()).to(self.device), k)
        w = torch.zeros(shape, dtype=self.dtype, device=self.device)
        w[:, self.s] = w_s
        w[:, self.u] = (offsets / self.a).to(self.dtype)
        return w

    def experts(self, count: int, fmt: str | None = None) -> Iterator[tuple]:
        """`count` experts' (gate [I, H], up [I, H], down [H, I]) on the CPU, made in groups; in compact
        format `fmt` (quantized where they were made) or None: as they are."""
        h, i = self.cfg.hidden_size, self.cfg.moe_intermediate_size
        per = max(1, EXPERT_GROUP_BYTES // (3 * i * h * self.dtype.itemsize))
        for start in range(0, count, per):
            group = self.randn((min(per, count - start), 3 * i * h))
            group[:, 2 * i * h:].view(-1, h, i)[:, self.protected] = 0  # down rows D
            if fmt is None:
                group = group.cpu()
            for extent in group:
                pieces = (extent[:i * h].view(i, h), extent[i * h:2 * i * h].view(i, h), extent[2 * i * h:].view(h, i))
                yield pieces if fmt is None else tuple(to_compact(p, fmt).to("cpu") for p in pieces)


# -- the file ----------------------------------------------------------------------------


def make_synthetic(path, *, shape: str = "qwen3-30b-a3b", layers: int, zipf: float = 0.0, dtype: str = "bf16",
                   seed: int = 0, vocab: int | None = None, narrow: int = 1, device: str = "cpu",
                   progress: bool = True, quantize: str | None = None) -> Path:
    """Write a synthetic `.rad` at `path` (module docstring); returns `path` as a Path.

    shape: a key of SHAPES; layers: decoder layers written (the real model has 48);
    zipf: router skew (0 = uniform); dtype: bf16, f16 or f32; vocab: None = the real
    model's; narrow: width divisor (tests); device: where the random numbers are made;
    quantize: `--quantize`'s CLASS=SCHEME list for the experts and layers classes, or None.
    Raises SyntheticError for bad arguments and RadError if the file cannot be written.
    """
    if dtype not in DTYPES or dtype == "f8_e4m3":
        raise SyntheticError(f"dtype {dtype!r} is not supported; use bf16, f16 or f32")
    if zipf < 0:
        raise SyntheticError(f"zipf must be >= 0, got {zipf}")
    try:
        formats = parse_quantize(quantize) if quantize is not None else {}
    except ValueError as e:
        raise SyntheticError(str(e)) from None
    if "embeddings" in formats:
        raise SyntheticError("--quantize embeddings=... is not made here (the tables are written in row blocks); "
                             "quantize experts and layers, or convert the float model with radiancectl convert")
    cfg = shape_config(shape, layers, narrow, vocab)
    fmt = formats.get("experts")
    if fmt is not None and not (fits(fmt, (cfg.moe_intermediate_size, cfg.hidden_size))
                                and fits(fmt, (cfg.hidden_size, cfg.moe_intermediate_size))):
        raise SyntheticError(f"experts of [{cfg.moe_intermediate_size}, {cfg.hidden_size}] at narrow {narrow} do not "
                             f"split into {fmt}'s blocks; choose a narrow that leaves both a multiple of 32")
    path = Path(path)
    source = (f"synthetic:{shape}, {layers} of {SHAPES[shape]['num_hidden_layers']} layers"
              + (f", width / {narrow}" if narrow != 1 else "") + f", zipf {zipf}, seed {seed}, {dtype} "
              f"made on {torch.device(device).type}" + (f", --quantize {quantize}" if formats else "")
              + " (tools/make_synthetic.py): random weights")
    w = _Weights(cfg, DTYPES[dtype], device, seed)
    t0 = time.perf_counter()
    with RadWriter(path, model=cfg, tokenizer_json=_tokenizer_json(cfg.vocab_size), chat_template=CHAT_TEMPLATE,
                   generation={"bos_token_id": ENDOFTEXT_ID, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID]},
                   source=source, synthetic=True) as out:
        H, V = cfg.hidden_size, cfg.vocab_size
        embed = "model.embed_tokens.weight"
        out.add_tensor_chunks(embed, w.dtype, (V, H), w.chunks(embed, (V, H)))
        for layer in range(layers):
            _write_layer(out, w, layer, zipf, formats)
            if progress:
                written = out.tmp_path.stat().st_size / GiB
                print(f"make_synthetic: layer {layer + 1}/{layers}, {written:.2f} GiB written, "
                      f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        out.add_tensor_chunks("model.norm.weight", w.dtype, (H,), w.chunks("model.norm.weight", (H,)))
        out.add_tensor_chunks("lm_head.weight", w.dtype, (V, H), w.chunks("lm_head.weight", (V, H)))
    if progress:
        print(f"make_synthetic: {path} ({path.stat().st_size / GiB:.2f} GiB) in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
    return path


def _write_layer(out: RadWriter, w: _Weights, layer: int, zipf: float, formats: dict[str, str]) -> None:
    """Decoder layer `layer`: its tensors in checkpoint order (those `formats` names compact), then its
    routed experts."""
    cfg = w.cfg
    moe = cfg.is_moe_layer(layer)
    for name, shape in expected_layer(cfg, f"model.layers.{layer}.", cfg.layer_type(layer), moe):
        if name.endswith("mlp.gate.weight"):
            out.add_tensor(name, w.router(shape, zipf).cpu())
        elif (fmt := plain_format(name, shape, formats)) is not None:
            out.add_compact(name, to_compact(w.plain(name, shape), fmt).to("cpu"))
        else:
            out.add_tensor_chunks(name, w.dtype, shape, w.chunks(name, shape))
    if moe:
        for e, (gate, up, down) in enumerate(w.experts(cfg.num_experts, formats.get("experts"))):
            out.add_expert(layer, e, gate, up, down)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the .rad to write")
    ap.add_argument("--layers", type=int, required=True, help="decoder layers to write (the real models have 48)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--zipf", type=float, default=0.0, help="router skew: expert of rank r chosen ~ 1/r^zipf")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "f16", "f32"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, help="vocabulary size (default: the real model's)")
    ap.add_argument("--narrow", type=int, default=1, help="divide the width by this (tests on a CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quantize", metavar="CLASS=SCHEME,...",
                    help="compact experts and layers, as radiancectl convert's, e.g. experts=int4,layers=fp8")
    args = ap.parse_args(argv)
    try:
        make_synthetic(args.out, shape=args.shape, layers=args.layers, zipf=args.zipf, dtype=args.dtype,
                       seed=args.seed, vocab=args.vocab, narrow=args.narrow, device=args.device,
                       quantize=args.quantize)
    except SyntheticError as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
