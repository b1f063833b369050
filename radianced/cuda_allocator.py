"""torch's CUDA caching allocator as the daemon sets it: expandable segments.

By default the allocator reserves memory in segments of the sizes first asked for and
splits them; a freed block serves only what fits in it. A step's tensors differ in size
from step to step (the warm-up's prefill buckets, then any length), so the cache fills
with segments that a later, larger tensor cannot use, and it reserves another. On the
H200, `--deterministic --enforce-eager` on a filled card peaked 6.8 MiB over the receipt
that way (its MoE's fp32 per-assignment rows: two 128 MiB segments where one was freed and
then split; tools/startup_check.py). With expandable segments a pool is one range of
addresses whose pages are mapped as needed, so a freed range serves any later size and the
reserved memory follows what is live. vLLM turned them on by default for the same reason
(fragmentation at start-up and graph capture).

A user's own `PYTORCH_CUDA_ALLOC_CONF` / `PYTORCH_ALLOC_CONF` that names
`expandable_segments` is left as it is.
"""

from __future__ import annotations

import os

import torch


def use_expandable_segments() -> str:
    """Turn expandable segments on for the allocations from here on, unless the user's allocator
    configuration says otherwise. Returns the receipt's line."""
    conf = ",".join(os.environ.get(v, "") for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    if "expandable_segments" in conf:
        return f"cuda allocator: {conf.strip(',')} (from the environment)"
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return "cuda allocator: expandable segments (freed ranges serve any later size; set PYTORCH_CUDA_ALLOC_CONF " \
           "to choose otherwise)"
