"""resolve_profile_out: `radiancectl profile --save --out` writes only the model's own profile or under
--profile-dir, resolved by the daemon, and never over anything but a profile (issue 19 finding 7)."""

from __future__ import annotations

import os

import pytest

from radianced.server.profile_paths import ProfilePathError, resolve_profile_out
from radianced.tiers.profile import MAGIC


@pytest.fixture
def layout(tmp_path):
    """models/m.rad, an allowed folder profiles/ (with sub/), and an outside folder."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.rad").write_bytes(b"")
    (tmp_path / "profiles" / "sub").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    return tmp_path


def refusal(*args) -> str:
    with pytest.raises(ProfilePathError) as e:
        resolve_profile_out(*args)
    return str(e.value)


def test_no_out_is_the_models_own_profile(layout):
    own = layout / "models" / "m.rad.expert-profile.bin"
    assert resolve_profile_out(None, str(layout / "models" / "m.rad"), None) == own
    assert resolve_profile_out(str(own), str(layout / "models" / "m.rad"), None) == own


def test_relative_paths_are_taken_from_the_profile_dir_not_the_working_directory(layout, monkeypatch):
    monkeypatch.chdir(layout / "outside")
    model, allowed = str(layout / "models" / "m.rad"), str(layout / "profiles")
    assert resolve_profile_out("sub/p.bin", model, allowed) == layout / "profiles" / "sub" / "p.bin"
    assert refusal("p.bin", model, None) == (
        "out 'p.bin': a relative path is taken from the daemon's --profile-dir, and this daemon has none; leave "
        f"--out out to write the model's own profile ({layout}/models/m.rad.expert-profile.bin)")


@pytest.mark.parametrize("out", ["../outside/p.bin", "sub/../../outside/p.bin", "/etc/passwd", "link/p.bin"])
def test_paths_outside_the_profile_dir_are_refused_after_resolving_links_and_dots(layout, out):
    os.symlink(layout / "outside", layout / "profiles" / "link")
    model, allowed = str(layout / "models" / "m.rad"), str(layout / "profiles")
    assert refusal(out, model, allowed) == (
        f"out {out!r}: the daemon writes an expert profile only to the model's own "
        f"({layout}/models/m.rad.expert-profile.bin) or under --profile-dir {allowed}")


def test_an_existing_file_must_be_a_profile(layout):
    model, allowed = str(layout / "models" / "m.rad"), str(layout / "profiles")
    (layout / "profiles" / "old.bin").write_bytes(MAGIC + b"rest of an old profile")
    assert resolve_profile_out("old.bin", model, allowed) == layout / "profiles" / "old.bin"
    (layout / "profiles" / "notes.txt").write_text("keep me")
    assert refusal("notes.txt", model, allowed) == (
        f"{layout}/profiles/notes.txt: exists and is not an expert profile; the daemon writes only a new file "
        f"or over a profile: choose another path")
    os.symlink(layout / "profiles" / "old.bin", layout / "profiles" / "alias.bin")
    assert refusal("alias.bin", model, allowed).endswith("alias.bin: is a symbolic link; the daemon writes a "
                                                         "profile only as a file of its own: give the link's "
                                                         "target, or another path")
    assert refusal("sub", model, allowed) == f"{layout}/profiles/sub: exists and is not a file; choose another path"
    assert refusal("sub/..", model, allowed) == "out 'sub/..': name a file, not a folder"
