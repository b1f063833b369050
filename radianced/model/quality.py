"""`radiancectl quality A.rad --against B.rad [--text FILE] [--kv-cache-dtype D]`: how far a model's next-token distributions are from a reference's.

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

KV_DTYPES = {"auto": None, "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # torch dtype names
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
    p.add_argument("--against", required=True, metavar="REF.rad", help="the reference .rad (same tokenizer)")
    p.add_argument("--text", default=None, metavar="FILE",
                   help="UTF-8 text to read (default: typing_extensions' LICENSE, about 3,000 tokens)")
    p.add_argument("--kv-cache-dtype", choices=tuple(KV_DTYPES), default="auto",
                   help="the measured model's KV cache dtype (auto: its activations'; the reference always uses auto)")


def run(args: argparse.Namespace) -> int:
    """Print the Markdown table of `args.model` against `args.against`; 1 with one line on stderr for bad input."""
    from radianced.model.rad import RadFile

    text = Path(args.text) if args.text else default_text()
    try:
        with RadFile.open(args.model) as model, RadFile.open(args.against) as ref:
            name = str(text) if args.text else f"{DEFAULT_TEXT[1]} of {DEFAULT_TEXT[0]}"
            q = measure(model, ref, text.read_text(encoding="utf-8"), name, kv_dtype=KV_DTYPES[args.kv_cache_dtype])
    except (ValueError, UnicodeDecodeError) as e:
        print(f"radiancectl quality: error: {e}", file=sys.stderr)
        return 1
    print(q.markdown())
    return 0


def window_logits(model, cfg, windows: list[list[int]], kv_dtype: str | None = None):
    """Teacher-forced fp32 logits [sum(len), V] of every position of each window (each from an empty context);
    the KV cache in torch dtype `kv_dtype` (a name; None: the model's activation dtype)."""
    import torch

    from radianced.kv.blocks import BlockAllocator
    from radianced.kv.cache import KVCache
    from radianced.model.batch import ForwardBatch

    block = 16
    per_window = -(-max(map(len, windows)) // block)
    cache = KVCache.allocate(cfg, num_blocks=per_window + 1, block_size=block, num_state_slots=1,
                             dtype=getattr(torch, kv_dtype) if kv_dtype else model.norm.weight.dtype)
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


def measure(model_rad, ref_rad, text: str, text_name: str, window: int = WINDOW, kv_dtype: str | None = None) -> Quality:
    """`model_rad` against `ref_rad` (open `RadFile`s of one vocabulary) over `text`, on the CPU; the model's KV
    cache in `kv_dtype` (a torch dtype name, None for its activations' dtype), the reference's in its own."""
    import torch

    from radianced.model.loader import load_model
    from radianced.model.tokenizer import Tokenizer

    if model_rad.model.vocab_size != ref_rad.model.vocab_size:
        raise ValueError(f"{model_rad.path} has a vocabulary of {model_rad.model.vocab_size} tokens and "
                         f"{ref_rad.path} one of {ref_rad.model.vocab_size}: compare models of one tokenizer")
    ids = Tokenizer.from_header(ref_rad.header).encode(text)
    windows = [ids[i:i + window] for i in range(0, len(ids), window)]
    windows = [w for w in windows if len(w) > 1]
    if not windows:
        raise ValueError(f"{text_name} has {len(ids)} tokens; quality needs at least 2")
    logq = torch.log_softmax(window_logits(load_model(model_rad), model_rad.model, windows, kv_dtype), -1)
    logp = torch.log_softmax(window_logits(load_model(ref_rad), ref_rad.model, windows), -1)
    keep = torch.cat([torch.arange(len(w) - 1) + sum(map(len, windows[:i])) for i, w in enumerate(windows)])
    targets = torch.tensor([t for w in windows for t in w[1:]])
    logp, logq = logp[keep], logq[keep]
    kl = (logp.exp() * (logp - logq)).sum(-1)  # [positions]
    nll, ref_nll = -logq.gather(1, targets[:, None]).mean(), -logp.gather(1, targets[:, None]).mean()
    return Quality(model=str(model_rad.path), reference=str(ref_rad.path), text=text_name,
                   tokens=sum(map(len, windows)), windows=len(windows), positions=len(targets),
                   mean_kl=float(kl.mean()), p99_kl=float(torch.quantile(kl, 0.99)),
                   top1=float((logp.argmax(-1) == logq.argmax(-1)).float().mean()),
                   ppl=math.exp(float(nll)), ref_ppl=math.exp(float(ref_nll)))
