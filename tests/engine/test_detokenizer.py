"""StopStrings: the detokenizer's stop match, exact on small cases, equal to a brute-force search for
any text, stops and chunking, and linear in the text (issue 19 finding 1: the check it replaced was
quadratic in a stop's length per token, and one 1 MB stop froze the event loop 17.7 s per token)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radianced.engine.detokenizer import StopStrings


def feed_all(stops: StopStrings, pieces: list[str]) -> tuple[int, str] | None:
    """Feed `pieces` in order; the first match as (its end in the whole text, the stop)."""
    at = 0
    for piece in pieces:
        match = stops.feed(piece)
        if match is not None:
            return at + match[0], match[1]
        at += len(piece)
    return None


def brute_force(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The first end at which a stop ends, and the longest stop ending there."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return end, max(ending, key=len)
    return None


def brute_held(text: str, stops: list[str]) -> int:
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_a_match_reports_its_end_and_the_longest_stop_ending_there():
    assert StopStrings(["is 42", "s 42", "42"]).feed("this is 42.") == (10, "is 42")
    assert StopStrings(["abcd", "bc"]).feed("xabcd") == (4, "bc")  # "bc" ends first
    assert StopStrings(["aab"]).feed("aaab") == (4, "aab")  # the automaton falls back, never restarts
    assert StopStrings([]).feed("anything") is None


def test_held_is_the_longest_stop_prefix_ending_the_text():
    stops = StopStrings(["42.", "abab"])
    assert (stops.feed("x 4"), stops.held) == (None, 1)
    assert (stops.feed("2"), stops.held) == (None, 2)
    assert (stops.feed(" ab"), stops.held) == (None, 2)
    assert (stops.feed("a"), stops.held) == (None, 3)
    assert (stops.feed("c"), stops.held) == (None, 0)
    assert stops.feed("ababab") == (4, "abab")


def test_a_stop_spanning_pieces_is_found_where_it_ends():
    stops = StopStrings(["<|end|>"])
    assert feed_all(stops, ["Hello <", "|en", "d|", "> more"]) == (13, "<|end|>")


def test_a_megabyte_stop_costs_linear_time():
    """One 1,000,001-character stop over 1,000,000 characters that keep almost matching it: the old
    check tried each of its prefixes per token (~5e11 character comparisons); this is ~2e6 steps."""
    stop = "y" * 1_000_000 + "z"
    stops = StopStrings([stop])
    assert feed_all(stops, ["y" * 4] * 250_000) is None and stops.held == 1_000_000
    assert stops.feed("z") == (1, stop)


TEXT = st.text(alphabet="abc", max_size=40)


@settings(max_examples=300, deadline=None)
@given(text=TEXT, stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=5), max_size=4), data=st.data())
def test_equals_a_brute_force_search_for_any_chunking(text, stops, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    matcher = StopStrings(stops)
    assert feed_all(matcher, pieces) == brute_force(text, stops)
    if brute_force(text, stops) is None:
        assert matcher.held == brute_held(text, stops)
