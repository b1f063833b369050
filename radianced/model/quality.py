"""`radiancectl quality A.rad [--against B.rad] [--text FILE] [--kv-cache-dtype D[,D...]]`: how far a model's next-token distributions are from a reference's.

Both models read the same real text, teacher-forced (every position predicts the
text's next token from the text before it), in independent windows of WINDOW
tokens, the way llama.cpp's perplexity tool cuts a text into n_ctx chunks. Per
predicted position, with P the reference's distribution (B) and Q the model's (A):

    KL(P || Q) = sum P * (log P - log Q)    (llama.cpp `--kl-divergence` direction)
    top-1      argmax P == argmax Q
    perplexity exp(mean of -log prob of the text's next token), of each model

The report is a Markdown table: mean and p99 KL, top-1 agreement, both
perplexities and their difference. The default text is a licence a package
ships (typing_extensions' LICENSE, the Python Software Foundation licence:
about 3,000 tokens of English prose), so the numbers are reproducible on any
installation; `--text FILE` reads another.

Without `--against` the reference is the model itself with the `auto` KV cache and
the report is the KV table: one row per `--kv-cache-dtype` (default fp8, fp8_v4,
k6_v4) with the cache's bytes per token, the pool's token gain against fp8, mean /
p99 KL and top-1 against `auto` (llama.cpp's `--kl-divergence` method; for scale,
its published q8_0 KV cache has a mean KL of 0.00098 against f16), and the mean KL
and top-1 over the same windows wrapped as chats in the model's template. Those
columns are there because a chat's first token (SmolLM2's `<|im_start|>`) is the
model's attention sink and every chat has it at position 0: measured on SmolLM2-135M,
its K and V are small (amax 0.05x to 3x the other tokens' median), and the first fp8
rule (a block's scale from its offset-0 token) saturated block 0's later tokens;
that rule measured 0.0161 / 94.0% on prose and 0.0171 / 92.5% on chats.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import sys
from dataclasses import dataclass
from pathlib import Path

# torch is imported inside the functions that compute: radiancectl builds every subcommand's parser
# (`add_arguments`) at start, and a `radiancectl status` should not pay for importing torch.

# --kv-cache-dtype values: torch dtype names (None: the activations'), or a quantized format (kernels/kv_formats.py)
KV_DTYPES = {"auto": None, "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
KV_FORMAT_NAMES = ("fp8", "fp8_v4", "k6_v4")
WINDOW = 512  # tokens per teacher-forced window (each window starts with an empty context)
DEFAULT_TEXT = ("typing_extensions", "LICENSE")  # (distribution, file name) of the default text


@dataclass(frozen=True)
class Quality:
    """One model measured against a reference over one text.

    model, reference: what each is (the `.rad` paths).
    text: where the text came from; tokens: how many tokens it has (all windows); windows: how many
        windows of at most WINDOW tokens it was cut into.
    positions: predicted positions (tokens - windows: a window's first token has no prediction).
    mean_kl, p99_kl: mean and 99th percentile of KL(reference || model) per position, in nats.
    top1: share of positions where both pick the same most likely token.
    ppl, ref_ppl: the model's and the reference's perplexity of the text.
    """

    model: str
    reference: str
    text: str
    tokens: int
    windows: int
    positions: int
    mean_kl: float
    p99_kl: float
    top1: float
    ppl: float
    ref_ppl: float

    def markdown(self) -> str:
        rows = [("model", f"`{self.model}`"), ("reference", f"`{self.reference}`"),
                ("text", f"{self.text} ({self.tokens} tokens, {self.windows} windows of <= {WINDOW})"),
                ("positions", str(self.positions)), ("mean KL", f"{self.mean_kl:.6f}"),
                ("p99 KL", f"{self.p99_kl:.6f}"), ("top-1 agreement", f"{100 * self.top1:.2f}%"),
                ("perplexity", f"{self.ppl:.4f}"), ("reference perplexity", f"{self.ref_ppl:.4f}"),
                ("Δ perplexity", f"{self.ppl - self.ref_ppl:+.4f}")]
        return "\n".join(["| metric | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def default_text() -> Path:
    """typing_extensions' LICENSE as installed (FileNotFoundError if the package ships none)."""
    dist, name = DEFAULT_TEXT
    for f in importlib.metadata.distribution(dist).files or []:
        if Path(str(f)).name == name:
            return Path(f.locate())
    raise FileNotFoundError(f"{dist} ships no {name}; pass --text FILE")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the .rad to measure")
    p.add_argument("--against", default=None, metavar="REF.rad",
                   help="the reference .rad (same tokenizer); without it, the KV table: the model's quantized "
                        "KV caches against its own auto cache")
    p.add_argument("--text", default=None, metavar="FILE",
                   help="UTF-8 text to read (default: typing_extensions' LICENSE, about 3,000 tokens)")
    p.add_argument("--kv-cache-dtype", default=None, metavar="D[,D...]",
                   help=f"the measured model's KV cache: {', '.join((*KV_DTYPES, *KV_FORMAT_NAMES))} (auto: its "
                        "activations'; the reference always uses auto); with --against one dtype (default auto), "
                        f"without it a list (default {','.join(KV_FORMAT_NAMES)})")


def _kv_dtypes(arg: str | None, against: bool) -> list[str]:
    """The dtypes `--kv-cache-dtype` names; ValueError naming the bad one or the rule broken."""
    names = arg.split(",") if arg else ["auto"] if against else list(KV_FORMAT_NAMES)
    for n in names:
        if n not in KV_DTYPES and n not in KV_FORMAT_NAMES:
            raise ValueError(f"--kv-cache-dtype {n}: choose from {', '.join((*KV_DTYPES, *KV_FORMAT_NAMES))}")
    if against and len(names) > 1:
        raise ValueError("--kv-cache-dtype with --against takes one dtype; leave --against out for the KV table")
    return names


def run(args: argparse.Namespace) -> int:
    """Print the Markdown table of `args.model` against `args.against` (or the KV table); 1 with one line on
    stderr for bad input."""
    from radianced.model.rad import RadFile

    text = Path(args.text) if args.text else default_text()
    name = str(text) if args.text else f"{DEFAULT_TEXT[1]} of {DEFAULT_TEXT[0]}"
    try:
        dtypes = _kv_dtypes(args.kv_cache_dtype, args.against is not None)
        with RadFile.open(args.model) as model:
            if args.against is None:
                print(kv_table(model, text.read_text(encoding="utf-8"), name, dtypes))
                return 0
            with RadFile.open(args.against) as ref:
                q = measure(model, ref, text.read_text(encoding="utf-8"), name, kv_dtype=dtypes[0])
    except (ValueError, UnicodeDecodeError) as e:
        print(f"radiancectl quality: error: {e}", file=sys.stderr)
        return 1
    print(q.markdown())
    return 0


def window_logits(model, cfg, windows: list[list[int]], kv_dtype: str = "auto"):
    """Teacher-forced fp32 logits [sum(len), V] of every position of each window (each from an empty context);
    the KV cache in `kv_dtype` (a `KV_DTYPES` or `KV_FORMAT_NAMES` name)."""
    import torch

    from radianced.kv.blocks import BlockAllocator
    from radianced.kv.cache import KVCache
    from radianced.model.batch import ForwardBatch

    block = 16
    per_window = -(-max(map(len, windows)) // block)
    plain = KV_DTYPES.get(kv_dtype)
    cache = KVCache.allocate(cfg, num_blocks=per_window + 1, block_size=block, num_state_slots=1,
                             dtype=getattr(torch, plain) if plain else model.norm.weight.dtype,
                             kv_dtype=kv_dtype if kv_dtype in KV_FORMAT_NAMES else "auto")
    out = []
    for w in windows:  # one window per forward: the cache holds one window
        alloc = BlockAllocator.fixed(cache.num_blocks, block)
        table = alloc.new_table()
        alloc.append(table, len(w))
        if cache.states is not None:
            cache.states.reset(0)
        batch = ForwardBatch.build([w], [0], [table.ids()], block, logits="all", state_slots=[0])
        with torch.inference_mode():
            out.append(model.forward(batch, cache).float())
    return torch.cat(out)


def _windows(rad, text: str, text_name: str, window: int) -> list[list[int]]:
    from radianced.model.tokenizer import Tokenizer

    ids = Tokenizer.from_header(rad.header).encode(text)
    windows = [w for w in (ids[i:i + window] for i in range(0, len(ids), window)) if len(w) > 1]
    if not windows:
        raise ValueError(f"{text_name} has {len(ids)} tokens; quality needs at least 2")
    return windows


def _compare(logp, logq, windows: list[list[int]]) -> dict:
    """mean_kl, p99_kl, top1, ppl, ref_ppl of logits `logq` against `logp` (both [sum(len), V], fp32)."""
    import torch

    logp, logq = torch.log_softmax(logp, -1), torch.log_softmax(logq, -1)
    keep = torch.cat([torch.arange(len(w) - 1) + sum(map(len, windows[:i])) for i, w in enumerate(windows)])
    targets = torch.tensor([t for w in windows for t in w[1:]])
    logp, logq = logp[keep], logq[keep]
    kl = (logp.exp() * (logp - logq)).sum(-1)  # [positions]
    nll, ref_nll = -logq.gather(1, targets[:, None]).mean(), -logp.gather(1, targets[:, None]).mean()
    return dict(mean_kl=float(kl.mean()), p99_kl=float(torch.quantile(kl, 0.99)),
                top1=float((logp.argmax(-1) == logq.argmax(-1)).float().mean()),
                ppl=math.exp(float(nll)), ref_ppl=math.exp(float(ref_nll)))


def measure(model_rad, ref_rad, text: str, text_name: str, window: int = WINDOW, kv_dtype: str = "auto") -> Quality:
    """`model_rad` against `ref_rad` (open `RadFile`s of one vocabulary) over `text`, on the CPU; the model's KV
    cache in `kv_dtype` (a `--kv-cache-dtype` of this tool), the reference's in its activations' dtype."""
    from radianced.model.loader import load_model

    if model_rad.model.vocab_size != ref_rad.model.vocab_size:
        raise ValueError(f"{model_rad.path} has a vocabulary of {model_rad.model.vocab_size} tokens and "
                         f"{ref_rad.path} one of {ref_rad.model.vocab_size}: compare models of one tokenizer")
    windows = _windows(ref_rad, text, text_name, window)
    logq = window_logits(load_model(model_rad), model_rad.model, windows, kv_dtype)
    logp = window_logits(load_model(ref_rad), ref_rad.model, windows)
    tokens = sum(map(len, windows))
    return Quality(model=str(model_rad.path), reference=str(ref_rad.path), text=text_name, tokens=tokens,
                   windows=len(windows), positions=tokens - len(windows), **_compare(logp, logq, windows))


def _chat_windows(rad, windows: list[list[int]], window: int) -> list[list[int]]:
    """Each window as a chat in the model's template: its first half the user's turn, the rest the
    assistant's (cut to `window` tokens), so position 0 holds the template's first token, as in every
    chat a user sends; [] for a model without a chat template."""
    from radianced.model.tokenizer import ChatTemplateError, Tokenizer

    tok = Tokenizer.from_header(rad.header)
    out = []
    for w in windows:
        turns = [{"role": "user", "content": tok.decode(w[:len(w) // 2])},
                 {"role": "assistant", "content": tok.decode(w[len(w) // 2:])}]
        try:
            ids = tok.encode(tok.apply_chat_template(turns, add_generation_prompt=False))[:window]
        except ChatTemplateError:
            return []
        if len(ids) > 1:
            out.append(ids)
    return out


def kv_table(rad, text: str, text_name: str, dtypes: list[str], window: int = WINDOW) -> str:
    """The KV table (Markdown) of `rad` (an open `RadFile`) over `text`: each of `dtypes` against its auto cache,
    over the text's windows and over the same windows as chats (`_chat_windows`)."""
    from radianced.model.loader import load_model
    from radianced.sizing import ModelFacts

    model, facts = load_model(rad), ModelFacts.from_header(rad.header)
    windows = _windows(rad, text, text_name, window)
    chats = _chat_windows(rad, windows, window)
    ref = window_logits(model, rad.model, windows)
    ref_chat = window_logits(model, rad.model, chats) if chats else None
    fp8 = kv_token_bytes(facts, "fp8")
    rows = []
    for d in dtypes:
        c = _compare(ref, window_logits(model, rad.model, windows, d), windows)
        chat = "n/a | n/a"
        if chats:
            cc = _compare(ref_chat, window_logits(model, rad.model, chats, d), chats)
            chat = f"{cc['mean_kl']:.6f} | {100 * cc['top1']:.2f}%"
        per = kv_token_bytes(facts, d)
        rows.append(f"| {d} | {per:,.1f} | {fp8 / per:.2f}x | {c['mean_kl']:.6f} | {c['p99_kl']:.6f} | "
                    f"{100 * c['top1']:.2f}% | {c['ppl']:.4f} | {chat} |")
    tokens = sum(map(len, windows))
    chat_words = (f"chat: the same windows as a user and an assistant turn in the chat template, "
                  f"{sum(map(len, chats))} tokens" if chats else "chat: n/a (the model has no chat template)")
    head = [f"`{rad.path}` against its own `auto` KV cache ({rad.model.num_hidden_layers} layers, "
            f"{rad.model.num_key_value_heads} KV heads x {rad.model.head_dim} dims); {text_name}: {tokens} tokens "
            f"in {len(windows)} teacher-forced windows of <= {window}, {tokens - len(windows)} positions; "
            f"`auto` perplexity {c['ref_ppl']:.4f}; {chat_words}", "",
            "| dtype | bytes/token | pool vs fp8 | mean KL | p99 KL | top-1 vs auto | perplexity | chat mean KL "
            "| chat top-1 |",
            "|---|---|---|---|---|---|---|---|---|"]
    return "\n".join(head + rows)


def kv_token_bytes(facts, kv_dtype: str) -> float:
    """Bytes one context token costs in the KV cache in `kv_dtype` (a plain torch dtype: its element size)."""
    from radianced.sizing import BLOCK_TOKENS, kv_block_bytes

    layers = len(facts.model.full_attention_layers)
    if kv_dtype in KV_FORMAT_NAMES:
        return kv_block_bytes(facts.model, layers, kv_dtype, facts.act_bytes) / BLOCK_TOKENS
    elem = {"auto": facts.act_bytes, "fp32": 4, "bf16": 2, "fp16": 2}[kv_dtype]
    return kv_block_bytes(facts.model, layers, "auto", elem) / BLOCK_TOKENS
