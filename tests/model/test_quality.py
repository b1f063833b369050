"""`radiancectl quality`: teacher-forced KL / top-1 / perplexity of a model against a reference, as Markdown."""

from __future__ import annotations

import math

import pytest
import torch

from radianced.ctl import main
from radianced.model.convert import convert
from radianced.model.quality import default_text, measure
from radianced.model.rad import RadFile
from radianced.model.tiny import make_tiny

TEXT = ("Permission is hereby granted, free of charge, to any person obtaining a copy of this software "
        "and associated documentation files, to deal in the Software without restriction. ") * 6


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("quality")
    src = make_tiny("qwen3_moe", out / "src")
    convert(src, out / "ref.rad")
    convert(src, out / "int8.rad", quantize="experts=int8,layers=int8")
    return out / "ref.rad", out / "int8.rad"


def test_a_model_against_itself_has_zero_kl_and_full_agreement(tiny_pair):
    ref, _ = tiny_pair
    with RadFile.open(ref) as a, RadFile.open(ref) as b:
        q = measure(a, b, TEXT, "text", window=64)
    assert q.windows == math.ceil(q.tokens / 64) and q.positions == q.tokens - q.windows
    assert q.mean_kl == pytest.approx(0, abs=1e-6) and q.p99_kl == pytest.approx(0, abs=1e-6)
    assert q.top1 == 1.0 and q.ppl == pytest.approx(q.ref_ppl)


def test_requantized_model_has_small_positive_kl_and_the_kl_is_the_definition(tiny_pair):
    ref, int8 = tiny_pair
    with RadFile.open(int8) as a, RadFile.open(ref) as b:
        q = measure(a, b, TEXT, "text", window=64)
    assert 0 < q.mean_kl <= q.p99_kl and q.mean_kl < 0.05
    assert 0.8 < q.top1 <= 1.0
    # KL of two known distributions, through the same formula
    p, r = torch.tensor([[0.5, 0.25, 0.25]]).log(), torch.tensor([[0.25, 0.5, 0.25]]).log()
    assert float((p.exp() * (p - r)).sum()) == pytest.approx(0.25 * math.log(2))


def test_radiancectl_quality_prints_a_markdown_table(tiny_pair, tmp_path, capsys):
    ref, int8 = tiny_pair
    (tmp_path / "t.txt").write_text(TEXT)
    assert main(["quality", str(int8), "--against", str(ref), "--text", str(tmp_path / "t.txt")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| metric | value |\n|---|---|\n")
    for metric in ("mean KL", "p99 KL", "top-1 agreement", "perplexity", "reference perplexity", "Δ perplexity"):
        assert f"| {metric} | " in out


def test_quality_refuses_models_of_different_vocabularies(tiny_pair, tmp_path, capsys):
    ref, _ = tiny_pair
    convert(make_tiny("llama", tmp_path / "l", vocab_size=300), tmp_path / "other.rad")
    (tmp_path / "t.txt").write_text(TEXT)
    assert main(["quality", str(tmp_path / "other.rad"), "--against", str(ref), "--text", str(tmp_path / "t.txt")]) == 1
    assert "vocabulary" in capsys.readouterr().err


def test_the_default_text_is_a_licence_a_package_ships():
    text = default_text().read_text()
    assert "PYTHON SOFTWARE FOUNDATION LICENSE" in text and len(text) > 10_000


def test_a_lower_precision_kv_cache_is_measured_against_the_full_one(tiny_pair, tmp_path, capsys):
    """One tool for weights and KV dtypes: the same model with a bf16 cache against its fp32 self."""
    ref, _ = tiny_pair
    with RadFile.open(ref) as a, RadFile.open(ref) as b:
        q = measure(a, b, TEXT, "text", window=64, kv_dtype="bf16")
    assert 0 < q.mean_kl < 1e-3 and q.top1 > 0.9
    (tmp_path / "t.txt").write_text(TEXT)
    assert main(["quality", str(ref), "--against", str(ref), "--text", str(tmp_path / "t.txt"),
                 "--kv-cache-dtype", "bf16"]) == 0
    assert "| mean KL | 0.000000 |" not in capsys.readouterr().out


def test_without_against_the_kv_table_has_one_row_per_dtype_with_the_receipts_bytes(tiny_pair, tmp_path, capsys):
    from radianced.sizing import kv_block_bytes

    ref, _ = tiny_pair
    (tmp_path / "t.txt").write_text(TEXT)
    assert main(["quality", str(ref), "--text", str(tmp_path / "t.txt"), "--kv-cache-dtype", "fp8,k6_v4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:4] == ["| dtype | bytes/token | pool vs fp8 | mean KL | p99 KL | top-1 vs auto | perplexity | "
                          "chat mean KL | chat top-1 |", "|---|---|---|---|---|---|---|---|---|"]
    assert "chat: the same windows as a user and an assistant turn in the chat template" in lines[0]
    with RadFile.open(ref) as rad:
        m = rad.model
        per = {d: kv_block_bytes(m, len(m.full_attention_layers), d, 4) / 16 for d in ("fp8", "k6_v4")}
    fp8, k6 = (line.split(" | ") for line in lines[4:6])
    assert (fp8[0], fp8[1], fp8[2]) == ("| fp8", f"{per['fp8']:,.1f}", "1.00x")
    assert (k6[0], k6[1], k6[2]) == ("| k6_v4", f"{per['k6_v4']:,.1f}", f"{per['fp8'] / per['k6_v4']:.2f}x")
    assert 0 < float(fp8[3]) < 0.05 and 0 < float(fp8[7]) < 0.05 and len(lines) == 6


def test_a_bad_kv_dtype_list_is_refused_with_the_choices(tiny_pair, capsys):
    ref, _ = tiny_pair
    assert main(["quality", str(ref), "--kv-cache-dtype", "fp8,int3"]) == 1
    assert "--kv-cache-dtype int3: choose from auto, fp32, bf16, fp16, fp8, fp8_v4, k6_v4" in capsys.readouterr().err
    assert main(["quality", str(ref), "--against", str(ref), "--kv-cache-dtype", "fp8,k6_v4"]) == 1
    assert "takes one dtype" in capsys.readouterr().err


def test_the_chat_windows_start_as_a_chat_does(tiny_pair):
    """The KV table's chat columns read each window as a user and an assistant turn: the template's first
    token (the attention sink of a chat) at position 0, the text's tokens after it."""
    from radianced.model.quality import _chat_windows, _windows
    from radianced.model.tokenizer import Tokenizer

    ref, _ = tiny_pair
    with RadFile.open(ref) as rad:
        tok = Tokenizer.from_header(rad.header)
        windows = _windows(rad, TEXT, "text", 64)
        chats = _chat_windows(rad, windows, 64)
    assert len(chats) == len(windows) and all(len(c) <= 64 for c in chats)
    im_start = tok.encode("<|im_start|>")
    assert len(im_start) == 1 and all(c[0] == im_start[0] for c in chats)
    first = tok.decode(chats[0])  # the special tokens decode to nothing
    assert first.startswith("user\n" + tok.decode(windows[0][:10])) and "\nassistant\n" in first


def test_smollm2_with_an_fp8_kv_cache_meets_the_bar_and_answers_paris(smollm2_rad):
    """The issue's bar on the real model: mean KL <= 0.01 and top-1 >= 95% against `auto` (here over the
    licence's first two windows, as prose and as chats: 0.0054 / 96.4% measured), and the same answer to
    the capital-of-France chat, whose first token `auto` picks by only 0.08 nats over "L"."""
    from radianced.kv.cache import KVCache
    from radianced.model.loader import load_model
    from radianced.model.quality import _chat_windows, _compare, _windows, window_logits
    from radianced.model.tokenizer import Tokenizer
    from tests.greedy import greedy_generate

    with RadFile.open(smollm2_rad) as rad:
        model, tok = load_model(rad), Tokenizer.from_header(rad.header)
        windows = _windows(rad, default_text().read_text(), "licence", 512)[:2]
        for w in (windows, _chat_windows(rad, windows, 512)):
            c = _compare(window_logits(model, rad.model, w), window_logits(model, rad.model, w, "fp8"), w)
            assert c["mean_kl"] <= 0.01 and c["top1"] >= 0.95, c
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
        cache = KVCache.allocate(rad.model, num_blocks=4, block_size=16, num_state_slots=1, dtype=torch.float32,
                                 kv_dtype="fp8")
        out = greedy_generate(model, cache, [prompt], 12, stop_ids=tuple(tok.encode("<|im_end|>"))).tokens[0]
    assert tok.decode(out) == "The capital of France is Paris."
