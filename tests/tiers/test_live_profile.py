"""LiveProfile: a daemon's cumulative routing counts saved into expert-profile.bin, merged with
what the file holds, never counted twice (repeated saves, two daemons, two threads at once)."""

from __future__ import annotations

import shutil
import threading

import pytest

from radianced.model.rad import RadFile
from radianced.tiers.live_profile import LiveProfile
from radianced.tiers.profile import Profile, ProfileError, profile_path


@pytest.fixture
def rad(tier_rad, tmp_path):
    """The tier model copied into a folder of this test's own (profiles are written beside it)."""
    path = tmp_path / "m.rad"
    shutil.copy(tier_rad, path)
    with RadFile.open(path) as r:
        yield r


def counts(p: Profile) -> dict:
    return {(layer, e): n for layer, e, n in p.ranked()}


def test_first_save_writes_the_counts_since_start_beside_the_model(rad):
    live = LiveProfile.for_model(rad)
    saved = live.save({(0, 3): 5, (2, 15): 9, (1, 0): 1}, steps=4)
    assert saved.path == profile_path(rad.path)
    assert (saved.pairs, saved.added, saved.steps, saved.merged, saved.note) == (3, 15, 4, False, None)
    p = Profile.load_for(rad)
    assert p.ranked() == [(2, 15, 9), (0, 3, 5), (1, 0, 1)] and p.steps == 4
    assert [q.name for q in saved.path.parent.iterdir() if q.name.endswith(".tmp")] == []


def test_saves_merge_with_the_file_and_add_only_what_was_routed_since(rad):
    start = Profile.for_model(rad)
    start.add(1, [0] * 15 + [100])  # a profiling run: (1, 15) x 100
    start.steps = 50
    start.save(profile_path(rad.path))
    live = LiveProfile.for_model(rad)
    first = live.save({(0, 3): 5, (1, 15): 2}, steps=3)
    assert (first.merged, first.added, first.steps) == (True, 7, 53)
    second = live.save({(0, 3): 8, (1, 15): 2, (2, 1): 4}, steps=7)  # cumulative since start
    assert (second.merged, second.added, second.steps, second.pairs) == (True, 7, 57, 3)
    assert counts(Profile.load_for(rad)) == {(1, 15): 102, (0, 3): 8, (2, 1): 4}


def test_two_daemons_saving_into_one_file_count_each_assignment_once(rad):
    a, b = LiveProfile.for_model(rad), LiveProfile.for_model(rad)
    a.save({(0, 0): 3}, steps=1)
    b.save({(0, 0): 1, (0, 1): 6}, steps=2)
    a.save({(0, 0): 5}, steps=4)
    assert counts(Profile.load_for(rad)) == {(0, 0): 6, (0, 1): 6}
    assert Profile.load_for(rad).steps == 6


def test_concurrent_saves_take_turns(rad):
    """Eight savers (threads, as eight daemons' save handlers) at once: the folder lock
    serializes read-merge-rename, so every assignment lands exactly once."""
    lives = [LiveProfile.for_model(rad) for _ in range(8)]
    barrier = threading.Barrier(len(lives))

    def save(i: int, live: LiveProfile) -> None:
        barrier.wait()
        for n in range(1, 6):
            live.save({(i % 3, i): n}, steps=n)

    threads = [threading.Thread(target=save, args=(i, live)) for i, live in enumerate(lives)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    p = Profile.load_for(rad)
    assert counts(p) == {(i % 3, i): 5 for i in range(8)} and p.steps == 8 * 5


def test_replace_drops_the_counts_already_in_the_file(rad):
    old = Profile.for_model(rad)
    old.add(0, [7] * 16)
    old.save(profile_path(rad.path))
    live = LiveProfile.for_model(rad)
    live.save({(2, 2): 3}, steps=1)
    saved = live.save({(2, 2): 4}, steps=2, replace=True)
    assert (saved.merged, saved.added, saved.pairs, saved.steps) == (False, 4, 1, 2)
    assert counts(Profile.load_for(rad)) == {(2, 2): 4}
    live.save({(2, 2): 6}, steps=3)  # and merging goes on from there
    assert counts(Profile.load_for(rad)) == {(2, 2): 6}


def test_a_profile_of_another_model_is_replaced_and_the_result_says_why(rad):
    path = profile_path(rad.path)
    Profile(12345, rad.model.moe_layers, rad.model.num_experts, {(0, 0): 99}).save(path)
    saved = LiveProfile.for_model(rad).save({(0, 1): 2}, steps=1)
    assert not saved.merged and "was made for another model file" in saved.note
    assert counts(Profile.load_for(rad)) == {(0, 1): 2}


def test_a_deleted_file_gets_every_count_since_start_again(rad):
    live = LiveProfile.for_model(rad)
    live.save({(0, 1): 2}, steps=1)
    profile_path(rad.path).unlink()
    saved = live.save({(0, 1): 5}, steps=2)
    assert (saved.merged, saved.added) == (False, 5)
    assert counts(Profile.load_for(rad)) == {(0, 1): 5}


def test_another_path_and_a_missing_folder(rad, tmp_path):
    live = LiveProfile.for_model(rad)
    out = tmp_path / "elsewhere.bin"
    assert live.save({(0, 1): 2}, steps=1, path=out).path == out
    assert counts(Profile.load(out, model_checksum=live.checksum, moe_layers=live.moe_layers,
                               num_experts=live.num_experts)) == {(0, 1): 2}
    with pytest.raises(ProfileError, match=rf"{tmp_path}/no/p.bin: cannot write the profile: {tmp_path}/no: "
                                           r"No such file or directory"):
        live.save({(0, 1): 2}, steps=1, path=tmp_path / "no" / "p.bin")
