"""--speculative through the daemon as users run it: SmolLM2 over HTTP (the openai SDK), n-gram drafts
accepted on an input-grounded prompt, the same greedy text as without, and the counts in /metrics and
the request's log line."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from radianced.model.default import ensure_default_model
from tests.server.conftest import start_daemon

TEXT = ("Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex. "
        "Complex is better than complicated. Flat is better than nested. Sparse is better than dense.")
MESSAGES = [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}]


def _answer(d, stream: bool, **extra) -> str:
    api = openai.OpenAI(base_url=f"{d.url}/v1", api_key="unused", max_retries=0)
    kwargs = dict(model="smollm2-135m-instruct", temperature=0, max_tokens=48, messages=MESSAGES, **extra)
    if not stream:
        return api.chat.completions.create(**kwargs).choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(stream=True, **kwargs)
                   if c.choices)


def _counters(d) -> dict[str, float]:
    text = httpx.get(f"{d.url}/metrics").text
    return {k: float(v) for k, v in re.findall(r"^(radiance_spec_\S+) (\S+)$", text, re.M)}


def test_drafts_are_accepted_and_the_greedy_text_is_the_same_as_without():
    try:
        ensure_default_model()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    flags = ("--card-mib", "2048", "--max-model-len", "512")
    plain = start_daemon(None, *flags)
    try:
        expected = _answer(plain, stream=False)
        stopped = _answer(plain, stream=True, stop=["Simple is"], logprobs=True)
    finally:
        assert plain.stop() == 0
    spec = start_daemon(None, *flags, "--speculative", "4")
    try:
        assert _answer(spec, stream=False) == expected and _answer(spec, stream=True) == expected
        m = _counters(spec)
        assert _answer(spec, stream=True, stop=["Simple is"], logprobs=True) == stopped  # a stop string inside drafts
        assert "Simple is" not in stopped and stopped in expected
    finally:
        assert spec.stop() == 0
    assert 0 < m["radiance_spec_accepted_tokens_total"] <= m["radiance_spec_draft_tokens_total"]
    by_position = [m.get(f'radiance_spec_accepted_tokens_by_position_total{{position="{p}"}}', 0.0)
                   for p in range(1, 5)]
    assert by_position[0] > 0 and by_position == sorted(by_position, reverse=True)  # a later draft needs the earlier
    assert sum(by_position) == m["radiance_spec_accepted_tokens_total"]
    assert "speculative decoding: up to 4 n-gram drafts per sequence and step" in spec.log()
    # the warm-up timed a plain decode step and 5-token verify steps on this machine; drafting uses that r
    measured = re.search(r"cost model measured: a decode step (\S+) ms, r = (\S+) \(a 5-token verify step costs "
                         r"(\S+) plain steps\)", spec.log())
    assert measured is not None and float(measured[1]) > 0 and 1 <= float(measured[3]) <= 5
    assert float(measured[2]) >= 0
    served = "\n".join(ln for ln in spec.log().splitlines() if "warm-up-" not in ln)  # start-up's own requests
    lines = re.findall(r"drafts accepted (\d+)/(\d+) \((\d+\.\d)%\)", served)
    assert len(lines) == 3 and all(0 < int(a) <= int(d) for a, d, _ in lines)  # one line per request
