"""Compact formats in a `.rad`: each tensor's format in the header, bytes kept as written, an expert's
pieces (with their scales) in one extent; plain-dtype files read as before."""

from __future__ import annotations

import gguf
import pytest
import torch
import xxhash

from radianced.kernels.compact import CompactWeight
from radianced.kernels.formats import FORMATS
from radianced.model.config import ModelConfig
from radianced.model.rad import RadFile
from radianced.model.rad_format import ALIGN, Preamble, RadError
from radianced.model.rad_writer import RadWriter

Q = gguf.GGMLQuantizationType


def _cfg() -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=8, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                       max_position_embeddings=64, tie_word_embeddings=True, attention_bias=False,
                       intermediate_size=128)


def _writer(path):
    return RadWriter(path, model=_cfg(), tokenizer_json="{}", chat_template=None, generation={}, source="test")


def q(w: torch.Tensor, qtype) -> CompactWeight:
    data = torch.from_numpy(gguf.quants.quantize(w.numpy(), qtype))
    return CompactWeight(qtype.name.lower(), tuple(w.shape), data)


def fp8(w: torch.Tensor) -> CompactWeight:
    n, k = w.shape
    nbytes = FORMATS["fp8_b128"].nbytes((n, k))
    scales = torch.full((-(-n // 128), -(-k // 128)), 0.5)
    data = torch.zeros(nbytes, dtype=torch.uint8)
    data[:scales.numel() * 4] = scales.flatten().view(torch.uint8)
    data[scales.numel() * 4:scales.numel() * 4 + n * k] = (w / 0.5).to(torch.float8_e4m3fn).flatten().view(torch.uint8)
    return CompactWeight("fp8_b128", (n, k), data)


def test_each_tensor_records_its_format_and_keeps_its_bytes(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g)
    tensors = {"a.q8": q(w, Q.Q8_0), "a.q40": q(w, Q.Q4_0), "a.q41": q(w, Q.Q4_1), "a.fp8": fp8(w[:40, :56])}
    with _writer(tmp_path / "m.rad") as wr:
        wr.add_tensor("plain", w.to(torch.bfloat16))
        for name, c in tensors.items():
            wr.add_compact(name, c)
    with RadFile.open(tmp_path / "m.rad") as rad:
        rad.verify()
        assert {t.name: t.dtype for t in rad.header.tensors} == {
            "plain": "bf16", "a.q8": "q8_0", "a.q40": "q4_0", "a.q41": "q4_1", "a.fp8": "fp8_b128"}
        assert torch.equal(rad.tensor("plain"), w.to(torch.bfloat16))
        for name, c in tensors.items():
            got = rad.tensor(name)
            assert isinstance(got, CompactWeight) and got.fmt == c.fmt and got.shape == c.shape
            assert torch.equal(got.data.reshape(-1), c.data.reshape(-1))
            assert rad.tensor_entry(name).nbytes == FORMATS[c.fmt].nbytes(c.shape)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, "fp8_b128"])
def test_a_compact_expert_is_one_aligned_extent_with_its_scales(tmp_path, qtype):
    g = torch.Generator().manual_seed(1)
    inter, hidden = 96, 64
    make = fp8 if qtype == "fp8_b128" else (lambda w: q(w, qtype))
    pieces = [make(torch.randn(inter, hidden, generator=g)) for _ in range(2)] + [make(torch.randn(hidden, inter, generator=g))]
    with _writer(tmp_path / "e.rad") as wr:
        wr.add_tensor("x", torch.zeros(3))
        wr.add_expert(0, 0, *pieces)
        wr.add_expert(0, 1, *pieces)
    with RadFile.open(tmp_path / "e.rad") as rad:
        e = rad.expert_entry(0, 1)
        assert e.offset % ALIGN == 0 and e.dtype == pieces[0].fmt
        assert e.nbytes == sum(p.nbytes for p in pieces)
        extent = rad.expert_bytes(0, 1)
        assert torch.equal(extent, torch.cat([p.data.reshape(-1) for p in pieces]))
        for got, want in zip(rad.expert(0, 1), pieces):
            assert torch.equal(got.dequantize(), want.dequantize())


def test_expert_pieces_of_mixed_formats_are_refused(tmp_path):
    w = torch.randn(32, 32)
    with pytest.raises(RadError, match="formats differ"):
        with _writer(tmp_path / "x.rad") as wr:
            wr.add_expert(0, 0, q(w, Q.Q8_0), q(w, Q.Q4_0), q(w, Q.Q8_0))
    assert not (tmp_path / "x.rad").exists()


def test_a_header_with_an_unknown_format_is_refused(tmp_path):
    with _writer(tmp_path / "m.rad") as wr:
        wr.add_compact("t", q(torch.randn(4, 32), Q.Q8_0))
    raw = bytearray((tmp_path / "m.rad").read_bytes())
    at = raw.rindex(b"q8_0")
    raw[at:at + 4] = b"q9_0"
    pre = Preamble.unpack(bytes(raw))
    blob = bytes(raw[pre.header_offset:pre.header_offset + pre.header_length])
    raw[:Preamble.SIZE] = Preamble(pre.version, pre.header_offset, pre.header_length, xxhash.xxh3_64_intdigest(blob)).pack()
    (tmp_path / "m.rad").write_bytes(raw)
    with pytest.raises(RadError, match="unknown dtype 'q9_0'"):
        RadFile.open(tmp_path / "m.rad")
