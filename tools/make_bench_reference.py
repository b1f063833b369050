"""Write the bench's quality reference for SmolLM2-135M-Instruct: transformers' greedy output, fp32.

    PYTHONPATH=. python tools/make_bench_reference.py   # -> radianced/bench/references/smollm2-135m-instruct.json

Run once; the file is committed. transformers loads the same GGUF the daemon's
default model is converted from, applies its own chat template and tokenizer,
and decodes greedily with its own KV cache until the end-of-turn token or
MAX_NEW_TOKENS. Needs the test extra (transformers).
"""

from __future__ import annotations

import json
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from radianced.bench.quality import REFERENCES
from radianced.model.default import bundled_gguf

MODEL = "smollm2-135m-instruct"  # the daemon's served name for its default model
PROMPT = "Write a haiku about the sea."
MAX_NEW_TOKENS = 48


def main() -> int:
    gguf = bundled_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out: list[int] = []
    ids, past = torch.tensor([list(prompt_ids)]), None
    with torch.inference_mode():
        while len(out) < MAX_NEW_TOKENS and (not out or out[-1] != end):
            step = model(ids, cache=past, use_cache=True)
            out.append(int(step.logits[0, -1].float().argmax()))
            ids, past = torch.tensor([[out[-1]]]), step.cache
    ref = {"model": MODEL, "source": f"transformers {transformers.__version__}, fp32, greedy, {gguf.name}",
           "prompt": PROMPT, "prompt_ids": list(prompt_ids), "token_ids": out,
           "pieces": [tok.decode([i], skip_special_tokens=False) for i in out]}
    path = REFERENCES / f"{MODEL}.json"
    lines = [f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in ref.items()]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")
    print(f"{path}: {len(out)} tokens: {tok.decode(out)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
