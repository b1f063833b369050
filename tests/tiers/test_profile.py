"""expert-profile.bin: exact round trips, ranking, merging, and refusals of bad or foreign profiles."""

from __future__ import annotations

import os
import struct

import pytest

from radianced.model.rad import RadFile
from radianced.tiers.profile import (
    MAGIC, PREAMBLE_BYTES, Profile, ProfileError, model_checksum, profile_path,
)

LAYERS = (0, 1, 2)


def make(checksum: int = 0xABCDEF, counts: dict | None = None) -> Profile:
    return Profile(checksum, LAYERS, 4, counts=counts or {(0, 1): 5, (2, 3): 9, (1, 0): 5, (2, 0): 1})


def test_rank_is_by_count_then_file_order():
    p = make()
    assert p.ranked() == [(2, 3, 9), (0, 1, 5), (1, 0, 5), (2, 0, 1)]  # (0,1) and (1,0) tie: file order
    assert p.rank() == [(2, 3), (0, 1), (1, 0), (2, 0)]
    assert len(p) == 4
    assert p.line("/m/m.rad.expert-profile.bin") == "profile m.rad.expert-profile.bin: 4 ranked pairs"


def test_add_counts_a_layer_of_routing():
    p = Profile(1, LAYERS, 4)
    p.add(1, [0, 3, 0, 1])
    p.add(1, [2, 0, 0, 1])
    assert [p.count(1, e) for e in range(4)] == [2, 3, 0, 2]
    assert p.rank() == [(1, 1), (1, 0), (1, 3)]
    with pytest.raises(ValueError, match="3 counts for 4 experts"):
        p.add(0, [1, 2, 3])
    with pytest.raises(ValueError, match=r"\(layer 7, expert 0\) is not a routed expert"):
        p.add(7, [0, 0, 0, 0])


def test_save_and_load_round_trip(tmp_path):
    p = make()
    p.steps = 17
    path = tmp_path / "x.expert-profile.bin"
    p.save(path)
    q = Profile.load(path, model_checksum=0xABCDEF, moe_layers=LAYERS, num_experts=4)
    assert q.ranked() == p.ranked() and q.steps == 17 and q.model_checksum == 0xABCDEF
    assert path.read_bytes()[:8] == MAGIC
    assert not (tmp_path / "x.expert-profile.bin.tmp").exists()


def test_merge_adds_counts_and_steps():
    a, b = make(), make(counts={(0, 1): 10, (1, 3): 2})
    a.steps, b.steps = 3, 4
    a.merge(b)
    assert a.ranked() == [(0, 1, 15), (2, 3, 9), (1, 0, 5), (1, 3, 2), (2, 0, 1)]
    assert a.steps == 7


def test_merging_another_models_profile_is_refused():
    with pytest.raises(ProfileError, match="made for another model file"):
        make().merge(make(checksum=1))
    with pytest.raises(ProfileError, match=r"MoE layers \[0, 1\] x 4 experts, this model \[0, 1, 2\] x 4"):
        make().merge(Profile(0xABCDEF, (0, 1), 4))


def test_profile_of_a_real_model_is_keyed_by_its_header_checksum(tier_rad):
    assert profile_path(tier_rad) == tier_rad.with_name("m.rad.expert-profile.bin")
    with RadFile.open(tier_rad) as rad:
        p = Profile.for_model(rad)
        p.add(2, list(range(16)))
        p.save(profile_path(tier_rad))
        q = Profile.load_for(rad)
    pre = tier_rad.read_bytes()[:36]
    assert q.model_checksum == struct.unpack("<8sIQQQ", pre)[4] == model_checksum(tier_rad)
    assert q.rank()[:3] == [(2, 15), (2, 14), (2, 13)] and len(q) == 15
    profile_path(tier_rad).unlink()


@pytest.mark.parametrize("kw, message", [
    (dict(model_checksum=0x1234, moe_layers=LAYERS, num_experts=4), "was made for another model file"),
    (dict(model_checksum=0xABCDEF, moe_layers=LAYERS, num_experts=8), "x 4 experts, this model [0, 1, 2] x 8"),
    (dict(model_checksum=0xABCDEF, moe_layers=(0, 2), num_experts=4), "this model [0, 2] x 4"),
])
def test_a_profile_of_another_model_is_refused(tmp_path, kw, message):
    path = tmp_path / "p.bin"
    make().save(path)
    with pytest.raises(ProfileError) as e:
        Profile.load(path, **kw)
    assert str(e.value).startswith(str(path)) and message in str(e.value)
    assert "re-run radiancectl profile" in str(e.value)


def corrupt(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:]


@pytest.mark.parametrize("damage, message", [
    (lambda d: b"GGUF" + d[4:], "not an expert profile"),
    (lambda d: d[:20], "not an expert profile"),
    (lambda d: corrupt(d, 20), "header is corrupt"),  # a byte of the model checksum
    (lambda d: corrupt(d, PREAMBLE_BYTES + 5), "body checksum mismatch"),
    (lambda d: d[:-3], "truncated"),
    (lambda d: d[:8] + struct.pack("<I", 9) + d[12:], "format version 9"),
])
def test_a_damaged_profile_is_refused_with_a_clear_message(tmp_path, damage, message):
    path = tmp_path / "p.bin"
    make().save(path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ProfileError) as e:
        Profile.load(path, model_checksum=0xABCDEF, moe_layers=LAYERS, num_experts=4)
    assert message in str(e.value) and str(path) in str(e.value)


def test_a_missing_profile_says_so(tmp_path):
    with pytest.raises(ProfileError, match="cannot read the profile: No such file"):
        Profile.load(tmp_path / "none.bin", model_checksum=1, moe_layers=LAYERS, num_experts=4)


def test_save_never_follows_a_link_planted_at_a_temp_name(tmp_path):
    """The temp file was `NAME.PID.tmp`, opened with a plain open: in a folder another user can
    write, a link planted at that name sent the write anywhere. Now its name is mkstemp's."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    path = tmp_path / "m.expert-profile.bin"
    (tmp_path / f"{path.name}.{os.getpid()}.tmp").symlink_to(victim)
    make().save(path)
    assert victim.read_bytes() == b"keep"
    assert Profile.load(path, model_checksum=0xABCDEF, moe_layers=LAYERS, num_experts=4).ranked() == make().ranked()
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["victim", path.name, f"{path.name}.{os.getpid()}.tmp"])
