"""The `.rad` container: exact round trips, the on-disk layout, and refusals of bad files."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import msgspec
import pytest
import torch
import xxhash

from radianced import ctl
from radianced.model.config import ModelConfig
from radianced.model.rad import RadFile
from radianced.model.rad_format import ALIGN, MAGIC, RAD_VERSION, Header, Preamble, RadError
from radianced.model.rad_writer import RadWriter

MODEL = ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e6,
                    max_position_embeddings=256, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                    eos_token_ids=(2, 3))
I, H = 8, 16
PREAMBLE = struct.Struct("<8sIQQQ")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes, so comparisons are bit-exact (NaN and -0.0 included)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def make_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g),  # f32, 4096 bytes exactly
        "model.norm.weight": torch.randn(16, generator=g).to(torch.float16),
        "odd.bf16": torch.randn(3, 5, 7, generator=g).to(torch.bfloat16),  # 210 bytes: forces padding
        "odd.f8": torch.randint(0, 256, (33,), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn),
        "transposed.f32": torch.randn(6, 10, generator=g).t(),  # not contiguous
        "scalar.f32": torch.tensor(1.5),
        "special.f32": torch.tensor([float("nan"), -0.0, float("inf"), 1e-45]),
    }


def make_experts(seed: int = 1, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return {(layer, e): (torch.randn(I, H, generator=g).to(dtype), torch.randn(I, H, generator=g).to(dtype),
                         torch.randn(H, I, generator=g).to(dtype))
            for layer in range(2) for e in range(4)}


def write_rad(path, tensors=None, experts=None, **meta) -> None:
    tensors = make_tensors() if tensors is None else tensors
    experts = make_experts() if experts is None else experts
    kw = dict(model=MODEL, tokenizer_json='{"model": "tiny"}', chat_template="{{ messages }}",
              generation={"temperature": 0.7, "eos_token_id": [2, 3]}, source="test:synthetic")
    kw.update(meta)
    with RadWriter(path, **kw) as w:
        for name, t in tensors.items():
            w.add_tensor(name, t)
        for (layer, e), (gate, up, down) in experts.items():
            w.add_expert(layer, e, gate, up, down)


@pytest.fixture
def rad_path(tmp_path):
    path = tmp_path / "m.rad"
    write_rad(path)
    return path


def read_header(path) -> tuple[int, int, int, Header]:
    data = path.read_bytes()
    _, version, hoff, hlen, hsum = PREAMBLE.unpack(data[:PREAMBLE.size])
    return hoff, hlen, hsum, msgspec.msgpack.decode(data[hoff:hoff + hlen], type=Header)


def flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


# -- round trip and layout --------------------------------------------------------


def test_round_trip_is_bit_exact_for_every_dtype(rad_path):
    tensors, experts = make_tensors(), make_experts()
    with RadFile.open(rad_path) as rad:
        assert rad.tensor_names() == list(tensors)
        for name, t in tensors.items():
            got = rad.tensor(name)
            assert got.dtype == t.dtype and got.shape == t.shape, name
            assert torch.equal(bits(got), bits(t)), name
        for (layer, e), want in experts.items():
            for got, t in zip(rad.expert(layer, e), want):
                assert got.dtype == torch.bfloat16 and got.shape == t.shape
                assert torch.equal(bits(got), bits(t))
        rad.verify()


def test_header_round_trips_config_tokenizer_and_metadata(rad_path):
    with RadFile.open(rad_path) as rad:
        h = rad.header
        assert rad.model == MODEL and rad.model.eos_token_ids == (2, 3)
        assert (h.version, h.tokenizer_json, h.chat_template) == (RAD_VERSION, '{"model": "tiny"}', "{{ messages }}")
        assert h.generation == {"temperature": 0.7, "eos_token_id": [2, 3]}
        assert (h.source, h.synthetic) == ("test:synthetic", False)
        assert rad.has_tensor("model.norm.weight") and not rad.has_tensor("lm_head.weight")
    path = rad_path.with_name("syn.rad")
    write_rad(path, tensors={}, experts={}, synthetic=True, chat_template=None)
    with RadFile.open(path) as rad:
        assert rad.header.synthetic and rad.header.chat_template is None and rad.tensor_names() == []


def test_preamble_points_at_a_checksummed_header_after_the_data(rad_path):
    data = rad_path.read_bytes()
    magic, version, hoff, hlen, hsum = PREAMBLE.unpack(data[:PREAMBLE.size])
    assert (magic, version) == (MAGIC, RAD_VERSION)
    assert data[PREAMBLE.size:ALIGN] == bytes(ALIGN - PREAMBLE.size)
    assert hoff + hlen == len(data) and hoff % ALIGN == 0
    assert hsum == xxhash.xxh3_64_intdigest(data[hoff:])
    _, _, _, header = read_header(rad_path)
    last_end = max(x.offset + x.nbytes for x in [*header.tensors, *header.experts])
    assert last_end <= hoff


def test_preamble_type_packs_the_layout_and_unpacks_only_a_rad_start(rad_path):
    p = Preamble(version=1, header_offset=3 * ALIGN, header_length=100, header_checksum=0xDEADBEEF12345678)
    assert Preamble.SIZE == PREAMBLE.size == 36
    assert p.pack() == PREAMBLE.pack(MAGIC, 1, 3 * ALIGN, 100, 0xDEADBEEF12345678)
    assert Preamble.unpack(p.pack() + bytes(ALIGN - 36)) == p
    assert Preamble.unpack(p.pack()[:-1]) is None  # too short
    assert Preamble.unpack(b"GGUF" + p.pack()[4:]) is None  # another magic
    data = rad_path.read_bytes()
    written = Preamble.unpack(data)
    assert (written.version, written.header_offset + written.header_length) == (RAD_VERSION, len(data))
    assert written.header_checksum == xxhash.xxh3_64_intdigest(data[written.header_offset:])


def test_every_extent_starts_on_a_4096_byte_boundary_and_none_overlap(rad_path):
    _, _, _, header = read_header(rad_path)
    extents = sorted((x.offset, x.nbytes) for x in [*header.tensors, *header.experts])
    assert len(extents) == 7 + 8
    for (off, n), (next_off, _) in zip(extents, extents[1:]):
        assert off % ALIGN == 0 and off >= ALIGN
        assert off + n <= next_off
    assert extents[-1][0] % ALIGN == 0


def test_each_expert_is_one_extent_holding_gate_then_up_then_down(rad_path):
    data = rad_path.read_bytes()
    experts = make_experts()
    with RadFile.open(rad_path) as rad:
        assert len(rad.header.experts) == 8
        for (layer, e), (gate, up, down) in experts.items():
            entry = rad.expert_entry(layer, e)
            assert (entry.layer, entry.expert, entry.dtype) == (layer, e, "bf16")
            assert (entry.intermediate, entry.hidden) == (I, H)
            assert entry.nbytes == 3 * I * H * 2
            want = bytes(bits(gate).numpy()) + bytes(bits(up).numpy()) + bytes(bits(down).numpy())
            assert data[entry.offset:entry.offset + entry.nbytes] == want
            assert entry.checksum == xxhash.xxh3_64_intdigest(want)
            # the views are slices of that one extent
            g, u, d = rad.expert(layer, e)
            assert u.data_ptr() - g.data_ptr() == d.data_ptr() - u.data_ptr() == I * H * 2


def test_f8_experts_are_supported(tmp_path):
    experts = make_experts(dtype=torch.float8_e4m3fn)
    write_rad(tmp_path / "f8.rad", tensors={}, experts=experts)
    with RadFile.open(tmp_path / "f8.rad") as rad:
        assert rad.expert_entry(1, 3).dtype == "f8_e4m3" and rad.expert_entry(1, 3).nbytes == 3 * I * H
        for got, want in zip(rad.expert(1, 3), experts[1, 3]):
            assert torch.equal(bits(got), bits(want))


def test_views_are_zero_copy_writable_and_never_touch_the_file(rad_path):
    before = rad_path.read_bytes()
    rad = RadFile.open(rad_path)
    entry = next(t for t in rad.header.tensors if t.name == "model.embed_tokens.weight")
    a, b = rad.tensor("model.embed_tokens.weight"), rad.tensor("model.embed_tokens.weight", verify=False)
    assert a.data_ptr() == b.data_ptr()  # both views of the same mapped page
    assert rad.tensor("model.norm.weight").data_ptr() - a.data_ptr() == \
        next(t for t in rad.header.tensors if t.name == "model.norm.weight").offset - entry.offset
    a.zero_()  # copy-on-write: the process sees it, the file does not
    assert torch.equal(b, torch.zeros_like(b))
    rad.close()
    assert rad_path.read_bytes() == before


def test_views_outlive_close(rad_path):
    """Regression: unmapping on close() left views dangling; the mapping now lives as long as a view does."""
    rad = RadFile.open(rad_path)
    t = rad.tensor("model.embed_tokens.weight")
    gate, _, _ = rad.expert(1, 2)
    rad.close()
    del rad
    assert torch.equal(bits(t), bits(make_tensors()["model.embed_tokens.weight"]))
    assert torch.equal(bits(gate), bits(make_experts()[1, 2][0]))


# -- the writer's contract ----------------------------------------------------------


def test_an_exception_inside_the_writer_leaves_no_file(tmp_path):
    path = tmp_path / "m.rad"
    with pytest.raises(KeyError):
        with RadWriter(path, model=MODEL, tokenizer_json="{}", chat_template=None, generation={}, source="t") as w:
            w.add_tensor("a", torch.ones(1000))
            assert (tmp_path / "m.rad.tmp").exists() and not path.exists()
            raise KeyError("boom")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_keeps_the_existing_file(rad_path):
    before = rad_path.read_bytes()
    with pytest.raises(RadError, match=r"m\.rad: tensor ints has dtype torch\.int64"):
        with RadWriter(rad_path, model=MODEL, tokenizer_json="{}", chat_template=None, generation={}, source="t") as w:
            w.add_tensor("fine", torch.ones(3))
            w.add_tensor("ints", torch.arange(4))
    assert rad_path.read_bytes() == before
    assert sorted(p.name for p in rad_path.parent.iterdir()) == ["m.rad"]


def _tensor_twice(w):
    w.add_tensor("x", torch.ones(2))
    w.add_tensor("x", torch.ones(2))


def _expert_twice(w):
    for _ in range(2):
        w.add_expert(1, 1, torch.ones(4, 8), torch.ones(4, 8), torch.ones(8, 4))


@pytest.mark.parametrize("bad, message", [
    (_tensor_twice, "tensor x added twice"),
    (_expert_twice, r"expert \(layer 1, expert 1\) added twice"),
    (lambda w: w.add_expert(0, 0, torch.ones(4, 8), torch.ones(4, 8), torch.ones(4, 8)),
     r"expert \(layer 0, expert 0\): expected gate \[I, H\], up \[I, H\], down \[H, I\]"),
    (lambda w: w.add_expert(0, 1, torch.ones(4, 8), torch.ones(4, 8, dtype=torch.float16), torch.ones(8, 4)),
     r"expert \(layer 0, expert 1\): gate/up/down dtypes differ"),
    (lambda w: w.add_tensor_chunks("c", torch.float32, (4, 4), [torch.ones(2, 4)]), "tensor c: pieces hold 32 bytes"),
])
def test_writer_refuses_bad_input_and_leaves_no_file(tmp_path, bad, message):
    path = tmp_path / "m.rad"
    with pytest.raises(RadError, match=message):
        with RadWriter(path, model=MODEL, tokenizer_json="{}", chat_template=None, generation={}, source="t") as w:
            bad(w)
    assert list(tmp_path.iterdir()) == []


def test_chunked_tensor_equals_the_whole(tmp_path):
    t = torch.randn(10, 6)
    with RadWriter(tmp_path / "c.rad", model=MODEL, tokenizer_json="{}", chat_template=None, generation={},
                   source="t") as w:
        w.add_tensor_chunks("c", torch.float32, (10, 6), [t[:3], t[3:4], t[4:]])
        w.add_tensor("whole", t)
    with RadFile.open(tmp_path / "c.rad") as rad:
        assert torch.equal(rad.tensor("c"), t)
        assert rad.tensor_entry("c").checksum == rad.tensor_entry("whole").checksum


def test_writer_needs_an_existing_folder(tmp_path):
    with pytest.raises(RadError, match="does not exist; create it first"):
        RadWriter(tmp_path / "no" / "m.rad", model=MODEL, tokenizer_json="{}", chat_template=None, generation={},
                  source="t")


# -- refusals -----------------------------------------------------------------------


def test_truncated_file_is_refused_at_open(rad_path):
    size = rad_path.stat().st_size
    os.truncate(rad_path, size - 100)
    with pytest.raises(RadError, match=rf"{rad_path}: the file is truncated: it is {size - 100} bytes but its "
                                       rf"header ends at byte {size}"):
        RadFile.open(rad_path)
    os.truncate(rad_path, 5000)  # cut into the tensor data too
    with pytest.raises(RadError, match="truncated"):
        RadFile.open(rad_path)
    os.truncate(rad_path, 100)  # the preamble survives: still recognised as a truncated .rad
    with pytest.raises(RadError, match="it is 100 bytes but its header ends"):
        RadFile.open(rad_path)
    os.truncate(rad_path, 20)
    with pytest.raises(RadError, match="not a .rad file"):
        RadFile.open(rad_path)


def test_an_extent_past_the_end_is_refused_naming_the_tensor(rad_path):
    """A header that passes its checksum but points outside the file (a writer bug) is caught at open, by name."""
    data = bytearray(rad_path.read_bytes())
    hoff, hlen, _, header = read_header(rad_path)
    header.tensors[2] = msgspec.structs.replace(header.tensors[2], offset=hoff + 10 * ALIGN)
    blob = msgspec.msgpack.encode(header)
    data[hoff:] = blob
    data[:PREAMBLE.size] = PREAMBLE.pack(MAGIC, RAD_VERSION, hoff, len(blob), xxhash.xxh3_64_intdigest(blob))
    rad_path.write_bytes(bytes(data))
    with pytest.raises(RadError, match=rf"{rad_path}: tensor odd\.bf16 \(bytes \d+\.\.\d+\) runs past the end"):
        RadFile.open(rad_path)


def test_flipped_byte_in_the_header_is_refused(rad_path):
    hoff, hlen, _, _ = read_header(rad_path)
    flip_byte(rad_path, hoff + hlen // 2)
    with pytest.raises(RadError, match=rf"{rad_path}: the header is corrupt \(checksum mismatch\)"):
        RadFile.open(rad_path)


def test_flipped_preamble_fields_are_refused(rad_path):
    data = bytearray(rad_path.read_bytes())
    data[8] = 2  # version 2
    rad_path.write_bytes(bytes(data))
    with pytest.raises(RadError, match="format version 2; this radianced reads version 1"):
        RadFile.open(rad_path)
    data[:8] = b"GGUF\x03\x00\x00\x00"
    rad_path.write_bytes(bytes(data))
    with pytest.raises(RadError, match="not a .rad file .it is a GGUF file"):
        RadFile.open(rad_path)


def test_flipped_byte_in_an_expert_is_refused_by_expert_and_by_verify(rad_path):
    with RadFile.open(rad_path) as rad:
        entry = rad.expert_entry(1, 2)
    flip_byte(rad_path, entry.offset + entry.nbytes - 3)  # inside down_proj
    rad = RadFile.open(rad_path)  # open checks structure, not every byte
    with pytest.raises(RadError, match=rf"{rad_path}: expert \(layer 1, expert 2\) is corrupt"):
        rad.expert(1, 2)
    rad.expert(1, 2, verify=False)  # unchecked access is allowed
    rad.expert(1, 1)
    rad.tensor("model.norm.weight")
    with pytest.raises(RadError, match=rf"{rad_path}: expert \(layer 1, expert 2\) is corrupt"):
        rad.verify()


def test_flipped_byte_in_a_tensor_is_refused_by_name(rad_path):
    with RadFile.open(rad_path) as rad:
        entry = rad.tensor_entry("odd.bf16")
    flip_byte(rad_path, entry.offset)
    with RadFile.open(rad_path) as rad:
        with pytest.raises(RadError, match=rf"{rad_path}: tensor odd\.bf16 is corrupt"):
            rad.tensor("odd.bf16")
        with pytest.raises(RadError, match=r"tensor odd\.bf16 is corrupt"):
            rad.verify()


def test_unknown_names_are_refused(rad_path):
    with RadFile.open(rad_path) as rad:
        with pytest.raises(RadError, match=r"no tensor named 'lm_head.weight'"):
            rad.tensor("lm_head.weight")
        with pytest.raises(RadError, match=r"no routed expert \(layer 0, expert 9\)"):
            rad.expert(0, 9)


# -- radiancectl verify ---------------------------------------------------------------


def test_ctl_verify_prints_one_line_for_a_good_file(rad_path, capsys):
    assert ctl.main(["verify", str(rad_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"{rad_path}: OK: qwen3_moe, 2 layers, 7 tensors, 8 expert extents")


def test_ctl_verify_fails_naming_the_file_and_the_bad_expert(rad_path):
    with RadFile.open(rad_path) as rad:
        entry = rad.expert_entry(0, 3)
    flip_byte(rad_path, entry.offset + 1)
    r = subprocess.run([sys.executable, "-m", "radianced.ctl", "verify", str(rad_path)], capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith(f"radiancectl verify: error: {rad_path}: expert (layer 0, expert 3) is corrupt")
    assert "Traceback" not in r.stderr


def test_ctl_verify_reports_a_missing_file_without_a_traceback(tmp_path, capsys):
    assert ctl.main(["verify", str(tmp_path / "none.rad")]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'none.rad'}: cannot open" in err and "Traceback" not in err
