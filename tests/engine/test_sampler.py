"""Sampling: params validation, the batched sampler, and streamed detokenization with stop strings.

CPU only, exact where the result is exact (greedy, penalties, logprobs, seeds,
stop cuts) and statistical with a fixed seed where it is a distribution (so the
test is deterministic; bounds are generous: a correct sampler fails them with
odds far below 1e-6, a wrong support fails them outright).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from radianced.engine.detokenizer import IncrementalDetokenizer
from radianced.engine.sampler import Sampler, SamplingRow, SamplingTensors, apply_penalties
from radianced.engine.sampling_params import InvalidSamplingParams, SamplingParams
from radianced.model.tokenizer import Tokenizer

# == SamplingParams ============================================================


def test_defaults_are_openais():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.frequency_penalty, p.presence_penalty) == (1.0, 1.0, 0.0, 0.0)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.seed, p.logprobs, p.max_tokens) == (0, 0.0, 1.0, None, None, None)
    assert not p.greedy and not p.has_penalties and SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.1, "temperature must be >= 0 (0 is greedy), got -0.1"),
    ("temperature", math.nan, "temperature must be a finite number, got nan"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
    ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
    ("top_k", -2, "top_k must be >= 1, or 0 / -1 to disable, got -2"),
    ("top_k", 2.5, "top_k must be an integer, got 2.5"),
    ("min_p", 1.01, "min_p must be in [0, 1], got 1.01"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0 (1 disables), got 0.0"),
    ("frequency_penalty", 2.5, "frequency_penalty must be in [-2, 2], got 2.5"),
    ("presence_penalty", -3, "presence_penalty must be in [-2, 2], got -3"),
    ("max_tokens", 0, "max_tokens must be >= 1 (or null for up to the context length), got 0"),
    ("logprobs", 21, "logprobs must be in [0, 20] (or null for none), got 21"),
    ("seed", 2**64, "seed must be a 64-bit integer"),
    ("stop", ("ok", ""), "stop must be a list of non-empty strings"),
    ("stop_token_ids", (3, -1), "stop_token_ids must be token ids >= 0"),
])
def test_invalid_values_fail_with_a_message_naming_the_field(field, value, message):
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(message)


def test_stop_accepts_one_string_or_a_list_and_stores_tuples():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[7]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[7, 8]).stop_token_ids == (7, 8)


# == Sampler ===================================================================

V = 50


def _logits(b: int, v: int = V, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn((b, v), generator=torch.Generator().manual_seed(seed))


def _sample(logits, rows, sampler=None):
    t = SamplingTensors.build(rows, logits.shape[1])
    return (sampler or Sampler(seed=0)).sample(logits, t)


def test_greedy_equals_argmax():
    logits = _logits(6)
    result = _sample(logits, [(SamplingParams(temperature=0), [])] * 6)
    assert torch.equal(result.tokens, logits.argmax(-1))
    assert result.logprobs is None and result.top_ids is None


def test_greedy_rows_equal_argmax_inside_a_mixed_batch():
    logits = _logits(4)
    rows = [(SamplingParams(temperature=0), []), (SamplingParams(top_p=0.3), []),
            (SamplingParams(temperature=0, top_k=3, min_p=0.5), []), (SamplingParams(seed=1, top_k=2), [])]
    tokens = _sample(logits, rows).tokens
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_k=1, temperature=1.7),
                                    SamplingParams(top_k=1, seed=9), SamplingParams(top_k=1, top_p=0.9, min_p=0.01)])
def test_top_k_1_equals_greedy(params):
    logits = _logits(8, seed=1)
    assert torch.equal(_sample(logits, [(params, [])] * 8).tokens, logits.argmax(-1))


def test_a_seeded_request_gives_the_same_tokens_alone_and_at_any_position_in_a_batch():
    """Ten steps of a seeded request (its history growing), alone and as each row of a batch of five
    whose other rows differ in every option (unseeded, greedy, another seed, penalties, min_p, top_p)."""
    ours = SamplingParams(seed=1234, temperature=0.9, top_p=0.95, top_k=30)
    others = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(seed=99, min_p=0.05),
              SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, top_p=0.5)]
    history: list[int] = []
    for step in range(10):
        logits = _logits(5, seed=100 + step)
        alone = _sample(logits[:1], [(ours, history)], Sampler(seed=step)).tokens[0]
        for pos in range(5):
            rows = [(p, [1, 2, 3], [4]) for p in others]
            rows.insert(pos, (ours, history))
            mixed = logits.roll(pos, 0)  # our row's logits follow it to its position
            batched = _sample(mixed, rows, Sampler(seed=1000 + pos)).tokens[pos]
            assert batched == alone, f"step {step}: row {pos} of the batch sampled {batched}, alone {alone}"
        history = history + [int(alone)]


def test_a_seed_gives_each_output_position_its_own_draw():
    """On flat logits the token is the noise alone: a seed must not repeat one draw at every step,
    two seeds must differ, and the same (seed, position) must repeat."""
    flat = torch.zeros((1, V))

    def run(seed: int) -> list[int]:
        return [int(_sample(flat, [(SamplingParams(seed=seed), [0] * n)], Sampler(seed=n)).tokens[0])
                for n in range(12)]

    first = run(7)
    assert first == run(7)
    assert len(set(first)) > 6
    assert first != run(8)


def _expected(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The target distribution, written out directly for one row of distinct logits."""
    p = (logits / temperature).softmax(-1)
    order = p.argsort(descending=True).tolist()
    keep = [i for i in order if p[i] >= min_p * p.max()]
    if top_k:
        keep = keep[:top_k]
    q = p[keep] / p[keep].sum()
    kept, mass = [], 0.0
    for i, qi in zip(keep, q.tolist()):
        if mass >= top_p:
            break
        kept.append(i)
        mass += qi
    out = torch.zeros_like(p)
    out[kept] = p[kept] / p[kept].sum()
    return out


def _check_distribution(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=expected.numel()).double()
    support = expected > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts.tolist()}"
    exp = n * expected[support].double()
    chi2 = float(((counts[support] - exp) ** 2 / exp).sum())
    df = int(support.sum()) - 1
    assert chi2 < 3 * df + 30, f"chi2 {chi2:.1f} on {df} dof: {counts.tolist()} vs {exp.tolist()}"


SMALL = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.3, 0.0, -0.5, -1.2])  # V = 8, distinct
N = 20_000


@pytest.mark.parametrize("options", [
    dict(),
    dict(temperature=0.5),
    dict(temperature=2.0),
    dict(top_k=3),
    dict(top_p=0.6),
    dict(top_p=0.8, temperature=1.5),
    dict(min_p=0.3),  # keeps 3 of 8
    dict(min_p=0.05, temperature=2.0),  # keeps all 8: min_p compares probabilities, not logits
    dict(min_p=0.15, top_k=5, top_p=0.9, temperature=0.8),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_samples_follow_the_target_distribution(options):
    tokens = _sample(SMALL.expand(N, -1), [(SamplingParams(**options), [])] * N).tokens
    _check_distribution(tokens, _expected(SMALL, **options))


def test_seeded_rows_follow_the_target_distribution():
    """Seeded noise is a fair draw too: one row per seed, N seeds."""
    n = 4000
    options = dict(temperature=0.8, top_p=0.9)
    rows = [(SamplingParams(seed=s, **options), []) for s in range(n)]
    _check_distribution(_sample(SMALL.expand(n, -1), rows).tokens, _expected(SMALL, **options))


def test_penalties_on_exact_numbers():
    """repetition 2 on prompt and output tokens, frequency 0.5 x count and presence 0.25 on output tokens."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, temperature=0)
    t = SamplingTensors.build([SamplingRow(params, output_ids=[3, 3, 4], prompt_ids=[0, 1, 3])], 6)
    assert apply_penalties(logits, t).tolist() == [[
        1.0,  # prompt token, positive: 2 / 2
        -2.0,  # prompt token, negative: -1 * 2
        0.5,  # unseen
        0.25,  # twice in the output: 3 / 2 - 0.5 * 2 - 0.25
        -4.75,  # once in the output: -2 * 2 - 0.5 - 0.25
        1.0,  # unseen
    ]]
    assert Sampler(seed=0).sample(logits, t).tokens.tolist() == [0]  # greedy sees the penalized logits
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]]  # the model's logits are left alone


def test_penalties_apply_only_to_rows_that_ask():
    logits = _logits(2, v=6)
    rows = [(SamplingParams(), [1, 1], [2]), (SamplingParams(frequency_penalty=1.0), [1, 1], [2])]
    t = SamplingTensors.build(rows, 6)
    penalized = apply_penalties(logits, t)
    assert torch.equal(penalized[0], logits[0])
    assert torch.equal(penalized[1], logits[1] - torch.tensor([0, 2.0, 0, 0, 0, 0]))  # prompt not counted


def test_logprobs_are_the_raw_model_log_softmax():
    """Reported logprobs are the model's, before penalties, temperature and filters (vLLM's default)."""
    logits = _logits(3, seed=5)
    rows = [(SamplingParams(logprobs=4, temperature=0.3, top_k=5, repetition_penalty=1.5), [0, 1]),
            (SamplingParams(logprobs=0, temperature=0), []),
            (SamplingParams(), [])]
    result = _sample(logits, rows)
    ref = logits.log_softmax(-1)
    assert torch.equal(result.logprobs, ref.gather(1, result.tokens[:, None])[:, 0])
    assert result.top_ids.shape == (3, 4)  # the batch's widest request; each row keeps its own first n
    assert torch.equal(result.top_ids, ref.topk(4).indices) and torch.equal(result.top_logprobs, ref.topk(4).values)


# == IncrementalDetokenizer ====================================================

MIXED = "Hello 안녕하세요 world 👋🏽 and 🇰🇷, café ☕!"


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory) -> Tokenizer:
    """The tiny models' byte-level BPE (trained on English: Korean and emoji fall apart into byte tokens)."""
    from radianced.model.tiny import make_tiny

    path = make_tiny("llama", tmp_path_factory.mktemp("tiny"))
    return Tokenizer((path / "tokenizer.json").read_text(), None, None, ())


@pytest.fixture(scope="module")
def metaspace() -> Tokenizer:
    """A SentencePiece-style vocabulary (Llama 2): "▁" for spaces, byte fallback, a decoder that strips
    the leading space, so a single "▁" token decodes to "" and token-by-token decoding loses spaces."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in "▁abcdefghijklmnopqrstuvwxyzH.,!?0123456789":
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return Tokenizer(tok.to_str(), None, None, ())


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int] | None = None, **kw) -> list[str]:
    """Feed `ids` in pieces of the given sizes (one by one by default); the deltas, then finish()'s."""
    detok = IncrementalDetokenizer(tok, **kw)
    out, i = [], 0
    for n in chunks or [1] * len(ids):
        out.append(detok.add(ids[i : i + n]).text)
        i += n
    out.append(detok.finish().text)
    return out


@pytest.mark.parametrize("which", ["byte_bpe", "metaspace"])
def test_split_characters_are_held_until_whole(which, request):
    tok = request.getfixturevalue(which)
    ids = tok.encode(MIXED)
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 10  # characters really are split across tokens
    deltas = _stream(tok, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == MIXED
    assert deltas[-1] == ""  # nothing was left for finish()


def test_spaces_survive_a_decoder_that_strips_the_leading_one(metaspace):
    ids = metaspace.encode("the cat ate the hat")
    assert metaspace.decode(ids[1:2]) == ""  # the lone "▁" token decodes to nothing
    assert "".join(_stream(metaspace, ids)) == "the cat ate the hat"
    prompt = metaspace.encode("Hi")
    assert "".join(_stream(metaspace, ids, prompt_ids=prompt)) == metaspace.decode(prompt + ids)[len("Hi"):]


def test_finish_releases_incomplete_bytes_as_replacement_characters(byte_bpe):
    ids = byte_bpe.encode("ok 한")[:-1]  # the syllable's last byte never comes
    deltas = _stream(byte_bpe, ids)
    assert "".join(deltas[:-1]) == "ok " and deltas[-1] == "\ufffd"


def _chunking(n: int):
    return st.lists(st.integers(1, 4), min_size=1, max_size=n).map(lambda sizes: _fit(sizes, n))


def _fit(sizes: list[int], n: int) -> list[int]:
    out, left = [], n
    for s in sizes * (n + 1):
        if left == 0:
            break
        out.append(min(s, left))
        left -= out[-1]
    return out


TEXT = st.text(alphabet=st.sampled_from(list("ab 4.,한국어😀é\n")), min_size=1, max_size=24)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), text=TEXT)
def test_any_chunking_streams_the_same_whole_characters(byte_bpe, data, text):
    ids = byte_bpe.encode(text)
    deltas = _stream(byte_bpe, ids, data.draw(_chunking(len(ids))))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def _reference_cut(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Over the whole text: the match that ends first (then starts first) wins."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    if best is None:
        return text, None
    end, start, s = best
    return text[: end if include else start], s


def test_a_stop_string_spanning_tokens_is_cut_exactly(byte_bpe):
    text = "The answer is 42. Done, and more after."
    ids = byte_bpe.encode(text)
    stop = "42. Do"
    assert all(stop not in byte_bpe.decode([i]) for i in ids)  # no single token holds it
    detok = IncrementalDetokenizer(byte_bpe, stop=[stop, "never"])
    streamed = ""
    for n, tok in enumerate(ids, 1):
        delta = detok.add([tok])
        streamed += delta.text
        assert "The answer is ".startswith(streamed)  # the "4" and what follows are never released
        if delta.stop:
            break
    assert stop in byte_bpe.decode(ids[:n]) and stop not in byte_bpe.decode(ids[: n - 1])  # at the right token
    assert streamed == "The answer is " and detok.stopped == stop and detok.text == streamed
    assert detok.add([ids[-1]]).text == "" and detok.finish().text == ""  # a stopped sequence says no more
    assert "".join(_stream(byte_bpe, ids, stop=[stop], include_stop=True)) == "The answer is 42. Do"


@pytest.mark.parametrize("chunks", ["one by one", "all at once"])
def test_the_stop_that_ends_first_wins(byte_bpe, chunks):
    """"is" ends before "answer is 42" does, so streaming must cut there; a batch rule of
    "first to start" would cut at "answer" only when the whole text arrives at once."""
    ids = byte_bpe.encode("The answer is 42.")
    sizes = [1] * len(ids) if chunks == "one by one" else [len(ids)]
    assert "".join(_stream(byte_bpe, ids, sizes, stop=["answer is 42", "is"])) == "The answer "


def test_text_that_might_start_a_stop_is_held_then_released(byte_bpe):
    detok = IncrementalDetokenizer(byte_bpe, stop=["42."])
    assert detok.add(byte_bpe.encode("x 4")).text == "x "
    assert detok.add(byte_bpe.encode("5")).text == "45"  # not the stop after all
    assert detok.add(byte_bpe.encode(" 42")).text == " "
    assert detok.finish().text == "42"  # the sequence ended another way: the held text is real output


@settings(max_examples=80, deadline=None)
@given(data=st.data(), text=TEXT, include=st.booleans())
def test_stop_strings_cut_exactly_at_the_first_match_for_any_chunking(byte_bpe, data, text, include):
    ids = byte_bpe.encode(text)
    inside = data.draw(st.lists(st.tuples(st.integers(0, len(text)), st.integers(1, 5)), max_size=2))
    stops = [text[i : i + n] for i, n in inside if text[i : i + n]] + data.draw(st.lists(TEXT, max_size=2))
    detok = IncrementalDetokenizer(byte_bpe, stop=stops, include_stop=include)
    streamed, i = "", 0
    for n in data.draw(_chunking(len(ids))):
        delta = detok.add(ids[i : i + n])
        streamed += delta.text
        i += n
        if delta.stop:
            break
    streamed += detok.finish().text
    assert (streamed, detok.stopped) == _reference_cut(text, stops, include)
