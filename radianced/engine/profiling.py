"""The profiling run behind `radiancectl profile`: prompts through an engine, routing counted.

The engine is built as the daemon builds it, with `--placement resident` on the
CPU card (every expert in a slot: nothing is read over a link, and routing does
not depend on placement), and runs greedy. The slab counts every token-to-expert
assignment exactly (`ExpertSlab.routing`); those counts become the profile that
start-up ranks the expert slots by.
"""

from __future__ import annotations

from radianced.card import detect_card
from radianced.config import Config
from radianced.engine.engine import Engine
from radianced.engine.request import Request
from radianced.engine.sampling_params import SamplingParams
from radianced.model.rad import RadFile
from radianced.model.tokenizer import Tokenizer
from radianced.tiers.profile import Profile, ProfileError

MAX_NUM_SEQS = 8


def profile_prompts(rad: RadFile, prompts: list[str], max_tokens: int, card=None) -> Profile:
    """Run each prompt (greedy, up to `max_tokens` generated) and return the routing profile.
    Raises ProfileError for a dense model or no prompts."""
    if not rad.header.experts:
        raise ProfileError(f"{rad.path}: a dense model has no routed experts to profile")
    if not prompts:
        raise ProfileError("no prompts to run")
    tokenizer = Tokenizer.from_header(rad.header)  # before the build: the longest prompt sizes the context
    ids = [tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    if not all(ids):
        raise ProfileError("a prompt encodes to no tokens")
    longest = max(len(i) for i in ids) + max_tokens
    cfg = Config(model=str(rad.path), placement="resident", max_model_len=longest,
                 max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=max(2048, longest), max_queue=len(ids))
    engine = Engine.build(rad, cfg, card or detect_card("cpu"))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
    eos = frozenset(engine.tokenizer.eos_token_ids)
    for n, prompt in enumerate(ids):
        engine.add(Request(f"profile-{n}", tuple(prompt), params, eos))
    steps = 0
    while engine.scheduler.has_unfinished:
        engine.step()
        steps += 1
    profile = Profile.for_model(rad)
    routing = engine.experts.routing
    for layer in profile.moe_layers:
        profile.add(layer, [routing.get((layer, e), 0) for e in range(profile.num_experts)])
    profile.steps = steps
    return profile
