"""What faster CPU arithmetic would cost SmolLM2 in greedy tokens: each linear layer's inputs rounded, against fp32.

    python tools/activation_precision.py --out DIR [--tokens 64]

The host backend's products are fp32 FMAs over the GGUF's dequantized values (kernels/cpu_blocks.c), exact
against transformers. This CPU's faster instructions need rounded operands: AVX512-VNNI's int8 dot products
take the activations as int8 (llama.cpp's Q8_0 / Q8_1: 32 values a block, scale absmax / 127), AVX512-BF16's
take both operands as bf16. transformers' fp32 load of the bundled GGUF runs greedy `--tokens` tokens on 8
chat prompts three times: as loaded, with every `nn.Linear`'s input rounded as Q8 blocks, and with its input
and weight rounded to bf16 (the arithmetic itself stays fp32, so this is the rounding's effect alone). For each
prompt and mode: the first token that differs from fp32's and the text up to a few tokens past it.

Writes DIR/activation_precision.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "Explain what a CPU cache is.",
           "List three prime numbers and explain why they are prime.", "Tell me a short story about a robot.",
           "How do I boil an egg?", "What is 17 times 23?", "Translate 'good morning' into Spanish and French.")


def q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) as llama.cpp's Q8_0 quantizes it and its dot products read it: 32 values
    share d = absmax / 127, each value round(x / d) times d as stored (fp16)."""
    blocks = x.reshape(-1, 32)
    d = blocks.abs().amax(1, keepdim=True) / 127
    v = blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d))
    whole = v.abs().floor()  # halves away from zero, as gguf's np_roundf (C's roundf) rounds them
    q = torch.sign(v) * (whole + torch.floor(2 * (v.abs() - whole)))
    return (q * d.half().float()).reshape(x.shape)


MODES = {
    "q8 activations": lambda self, x: F.linear(q8_blocks(x), self.weight, self.bias),
    "bf16 operands": lambda self, x: F.linear(x.bfloat16().float(), self.weight.bfloat16().float(), self.bias),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from radianced.model.default import bundled_gguf

    gguf = bundled_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    fp32_forward = torch.nn.Linear.forward
    rows = []
    try:
        for prompt in PROMPTS:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            torch.nn.Linear.forward = fp32_forward
            ref = model.generate(ids, max_new_tokens=args.tokens, do_sample=False)[0, ids.shape[1]:].tolist()
            row = {"prompt": prompt, "fp32": tok.decode(ref), "fp32_tokens": len(ref)}
            for mode, forward in MODES.items():
                torch.nn.Linear.forward = forward
                out = model.generate(ids, max_new_tokens=args.tokens, do_sample=False)[0, ids.shape[1]:].tolist()
                n = min(len(out), len(ref))
                first = next((i for i in range(n) if out[i] != ref[i]), None if len(out) == len(ref) else n)
                row[mode] = {"first_difference": first, "text": tok.decode(out[:(first or n) + 6])}
            rows.append(row)
            print(f"{prompt[:40]!r}: " + ", ".join(f"{m} {row[m]['first_difference']}" for m in MODES), flush=True)
    finally:
        torch.nn.Linear.forward = fp32_forward
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "activation_precision.json").write_text(json.dumps(
        {"tokens": args.tokens, "threads": torch.get_num_threads(), "rows": rows}, indent=1))
    print(f"\n| prompt | fp32 tokens | {' | '.join(f'{m}: first different token' for m in MODES)} |")
    print("|---|---|" + "---|" * len(MODES))
    for r in rows:
        cells = " | ".join("none" if r[m]["first_difference"] is None else str(r[m]["first_difference"])
                           for m in MODES)
        print(f"| {r['prompt']} | {r['fp32_tokens']} | {cells} |")


if __name__ == "__main__":
    main()
