"""Hostile bodies for both endpoints through the daemon (issue 19): never a 5xx, never a hang, and the
daemon answers a normal request afterwards.

Beyond test_http_fuzz.py (short strings, 8 leaves): every field may hold any JSON type, integers far
past 64 bits, strings of lone surrogates (escaped, or as raw CESU-8 bytes) and NULs, strings and
lists sized up to the body limit and past it, and values nested 10,000 to 200,000 levels deep.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radianced.server.limits import MAX_BODY_BYTES
from tests.server.conftest import SMALL_NAME, client
from tests.server.test_http_fuzz import CHAT, COMPLETION, PLAUSIBLE_CHAT, PLAUSIBLE_COMPLETION, post_never_5xx

DEEP = "\x00deep\x00"  # a placeholder string, swapped for the raw nested JSON after encoding

surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=4)
strings = st.text(max_size=20) | surrogates | st.text(st.sampled_from("\x00\ud800a\\\"é🙂"), max_size=20)
huge = st.builds(lambda piece, n: piece * n, st.sampled_from(["x", "é", "\x00", "\\", '"', "\ud83d", "ab "]),
                 st.sampled_from([10_000, 300_000, MAX_BODY_BYTES // 6, MAX_BODY_BYTES // 2 - 64, MAX_BODY_BYTES]))
leaves = (st.none() | st.booleans() | st.integers(-(2**200), 2**200) | st.floats(allow_nan=False, allow_infinity=False)
          | strings)
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(strings, inner, max_size=4),
                      max_leaves=30) | huge | st.just(DEEP) | st.lists(st.integers(-5, 2**64), max_size=5000)
nesting = st.tuples(st.integers(10_000, 200_000), st.sampled_from(["[", '{"a":']))


def _nest(depth: int, opener: str) -> bytes:
    closer = "]" if opener == "[" else "}"
    return (opener * depth + ("" if opener == "[" else "1") + closer * depth).encode()


def hostile(fields: dict, plausible: dict, required: str) -> st.SearchStrategy[bytes]:
    """A plausible request with one or two fields made hostile, or any field holding any value."""
    wild = {k: v | values for k, v in fields.items()}
    sane = st.fixed_dictionaries({required: plausible[required]},
                                 optional={k: v for k, v in plausible.items() if k != required})
    bad = st.tuples(sane, st.dictionaries(st.sampled_from(sorted(fields)) | strings, values, min_size=1,
                                          max_size=2)).map(lambda t: {**t[0], **t[1]})
    objects = st.one_of(bad, bad, st.fixed_dictionaries({}, optional=wild), values)
    return st.builds(_encode, objects, st.booleans(), nesting)


def _encode(obj, ascii_only: bool, deep: tuple[int, str]) -> bytes:
    """JSON text; without ascii_only, lone surrogates go out as raw (invalid) UTF-8 bytes."""
    text = json.dumps(obj, ensure_ascii=ascii_only)
    data = text.encode("utf-8", "surrogatepass")
    return data.replace(json.dumps(DEEP, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass"), _nest(*deep))


FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                      HealthCheck.too_slow,
                                                                      HealthCheck.data_too_large])


@FUZZ
@given(body=hostile(COMPLETION, PLAUSIBLE_COMPLETION, "prompt"))
def test_hostile_completions_never_5xx(small_daemon, body):
    post_never_5xx(small_daemon, "/v1/completions", body)


@FUZZ
@given(body=hostile(CHAT, PLAUSIBLE_CHAT, "messages"))
def test_hostile_chat_completions_never_5xx(small_daemon, body):
    post_never_5xx(small_daemon, "/v1/chat/completions", body)


def test_the_daemon_answers_normally_after_the_hostile_fuzz(small_daemon):
    with client(small_daemon) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/chat/completions", json={"model": SMALL_NAME, "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "still here?"}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert "Traceback" not in small_daemon.log() and "Exception in ASGI application" not in small_daemon.log()
