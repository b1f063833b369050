"""A MoE daemon's expert operations over the control socket, on a real subprocess.

Tiny Qwen3-MoE (3 layers x 8 experts, 2 routed per token) with 6 expert slots
and the rest in the host pool. `status` carries per-layer counts that agree
with the metrics and with the tokens the requests fed; `radiancectl status`
prints them; `radiancectl profile --save` writes the routing counted since
start into the profile beside the model, merged with what the file held,
never counting an assignment twice, and the next start-up ranks by it; it
writes nowhere else but under --profile-dir, and over nothing but a profile.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from pathlib import Path

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radianced import ctl
from radianced.model.convert import convert
from radianced.model.rad import RadFile
from radianced.model.tiny import make_tiny
from radianced.server import control
from radianced.server.control import StatusResult
from radianced.tiers.profile import Profile, profile_path
from tests.server.conftest import SERVED_NAME, start_daemon

FLAGS = ("--host-pool-mib", "1", "--expert-slots", "6")
K = 2  # num_experts_per_tok of the tiny Qwen3-MoE
PROMPT = [11, 22, 33, 44, 55, 66, 77]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    src = make_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny-moe"))
    convert(src, src / "moe.rad")
    return src / "moe.rad"


@pytest.fixture(scope="module")
def moe_daemon(moe_model, tmp_path_factory):
    """The MoE daemon; `profile --save --out` may write under the session's temporary folder (tmp_path)."""
    d = start_daemon(moe_model, *FLAGS, "--profile-dir", str(tmp_path_factory.getbasetemp()))
    yield d
    assert d.stop() == 0, d.log()[-3000:]


def complete(d, max_tokens: int) -> int:
    """One greedy completion of PROMPT; the tokens it fed through the model (prompt + all but the last)."""
    with httpx.Client(base_url=d.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
                                            "temperature": 0})
    assert r.status_code == 200, r.text
    return len(PROMPT) + r.json()["usage"]["completion_tokens"] - 1


def status(d) -> StatusResult:
    return msgspec.convert(control.call(d.control_socket, "status"), StatusResult)


def metric_values(d) -> dict[tuple[str, tuple], float]:
    with httpx.Client(base_url=d.url, timeout=10) as c:
        text = c.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def load(model: Path) -> Profile:
    with RadFile.open(model) as rad:
        return Profile.load_for(rad)


def layer_sums(p: Profile) -> list[int]:
    return [sum(p.count(layer, e) for e in range(p.num_experts)) for layer in p.moe_layers]


def test_status_counts_every_layer_and_agrees_with_the_metrics(moe_daemon):
    before = status(moe_daemon).experts
    fed = complete(moe_daemon, 6)
    s = status(moe_daemon)
    e = s.experts
    assert [x.layer for x in e.layers] == [0, 1, 2]
    # every fed token routed K experts in every MoE layer
    assert [a.routed - b.routed for a, b in zip(e.layers, before.layers)] == [K * fed] * 3
    assert all(0 <= x.hits <= x.lookups <= x.routed for x in e.layers)
    assert sum(x.lookups - x.hits for x in e.layers) > 0  # 6 slots for 24 experts: some reads over the link
    assert (e.slots, e.pinned, e.host, e.disk) == (6, 0, 24, 0)
    m = metric_values(moe_daemon)
    def total(name: str) -> float:  # over the step kinds (decode, mixed, prefill)
        return sum(v for (n, labels), v in m.items() if n == name and dict(labels).keys() == {"step"})

    assert total("radiance_expert_lookups_total") == sum(x.lookups for x in e.layers)
    assert total("radiance_expert_hits_total") == sum(x.hits for x in e.layers)
    assert m[("radiance_expert_lookups_total", (("step", "decode"),))] > 0  # the requests decoded
    assert m[("radiance_arena_pages", (("tenant", "experts"),))] == e.slots


def test_radiancectl_status_prints_a_line_per_layer(moe_daemon, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    complete(moe_daemon, 3)
    e = status(moe_daemon).experts  # the daemon is idle: the ctl reads the same numbers
    assert ctl.main(["status", "--control-socket", moe_daemon.control_socket]) == 0
    lines = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    assert (f"experts: 6 slots in use (0 pinned), 24 in host pool, 0 on disk; {e.refills} refills, "
            f"{e.evictions} evictions since start") in lines
    rows = [[c.strip() for c in line.replace("┃", "│").split("│")[1:-1]]
            for line in lines if line.startswith(("┃", "│"))]
    expected = [[str(x.layer), f"{x.hits / x.lookups:.1%}", str(x.hits), str(x.lookups), str(x.routed)]
                for x in e.layers]
    hits, lookups = sum(x.hits for x in e.layers), sum(x.lookups for x in e.layers)
    expected.append(["all", f"{hits / lookups:.1%}", str(hits), str(lookups), str(sum(x.routed for x in e.layers))])
    assert rows == [["layer", "hit rate", "hits", "lookups", "routed"], *expected]


def test_profile_save_merges_the_live_counts_and_never_counts_twice(moe_daemon, moe_model, capsys):
    """The daemon has counted since start (the earlier tests' requests too): each layer's sum in
    the file equals the layer's `routed` in status, plus what a profiling run had put there."""
    d, path = moe_daemon, profile_path(moe_model)
    with RadFile.open(moe_model) as rad:
        base = Profile.for_model(rad)
    base.add(2, [0] * 7 + [1000])  # a profiling run's counts for (2, 7)
    base.save(path)
    complete(d, 5)
    routed = [x.routed for x in status(d).experts.layers]
    assert ctl.main(["profile", "--save", "--control-socket", d.control_socket]) == 0
    saved = load(moe_model)
    assert layer_sums(saved) == [routed[0], routed[1], routed[2] + 1000]
    assert capsys.readouterr().out == (
        f"{path}: {len(saved)} ranked pairs ({sum(routed)} routed assignments added to the counts already "
        f"there; {saved.steps} steps); the next start-up fills the expert slots in this order\n")

    complete(d, 4)  # a second save adds only what was routed since the first
    routed = [x.routed for x in status(d).experts.layers]
    assert ctl.main(["profile", "--save", "--control-socket", d.control_socket]) == 0
    again = load(moe_model)
    assert layer_sums(again) == [routed[0], routed[1], routed[2] + 1000] and again.steps > saved.steps

    assert ctl.main(["profile", "--save", "--replace", "--control-socket", d.control_socket]) == 0
    assert "written fresh" in capsys.readouterr().out
    assert layer_sums(load(moe_model)) == routed  # the profiling run's 1000 are gone
    assert f"expert profile saved: {path}: " in d.log()


@contextlib.contextmanager
def read_only_folder(path: Path):
    """A folder this process cannot write in: a read-only tmpfs for root (which ignores modes), else mode 0555."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_profile_save_refusals_name_the_problem(moe_daemon, daemon, tmp_path, capsys):
    with read_only_folder(tmp_path / "ro") as ro:
        assert ctl.main(["profile", "--save", "--out", str(ro / "p.bin"), "--control-socket",
                         moe_daemon.control_socket]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"radiancectl profile: the daemon refused: {ro}/p.bin: cannot write the profile: ")
    assert f"cannot write in {ro}; give it write access there or choose another path with --out" in err

    assert ctl.main(["profile", "--save", "--control-socket", daemon.control_socket]) == 1
    assert capsys.readouterr().err == (f"radiancectl profile: the daemon refused: {SERVED_NAME} is a dense model: "
                                       f"it routes no experts, so it has no expert profile to save\n")


@pytest.mark.parametrize("argv, message", [
    (["profile", "--save", "m.rad"], "--save writes the running daemon's counts for the model it serves: drop "
                                     "MODEL and --prompts (or drop --save to profile prompts offline)"),
    (["profile", "m.rad"], "give MODEL and --prompts FILE (or --save to save a running daemon's counts)"),
    (["profile", "m.rad", "--prompts", "p.txt", "--replace"], "--replace goes with --save (an offline run "
                                                              "always writes a new profile)"),
])
def test_profile_arguments_that_do_not_go_together(argv, message, capsys):
    assert ctl.main(argv) == 1
    assert capsys.readouterr().err == f"radiancectl profile: error: {message}\n"


def test_19_7_profile_save_writes_only_profiles_where_the_daemon_allows(moe_daemon, moe_model, tmp_path,
                                                                         tmp_path_factory, capsys, monkeypatch):
    """Issue 19 finding 7: `radiancectl profile --save --out PATH` overwrote any file (under a root daemon,
    any file on the system), and a relative PATH was resolved in radiancectl's working directory."""
    d, allowed = moe_daemon, tmp_path_factory.getbasetemp()  # the daemon's --profile-dir

    def save(out: str) -> tuple[int, str]:
        code = ctl.main(["profile", "--save", "--out", out, "--control-socket", d.control_socket])
        return code, capsys.readouterr().err

    outside = Path(tempfile.mkdtemp(prefix="rd-")) / "p.bin"  # not under --profile-dir
    assert save(str(outside)) == (1, f"radiancectl profile: the daemon refused: out {str(outside)!r}: the daemon "
                                     f"writes an expert profile only to the model's own "
                                     f"({profile_path(moe_model)}) or under --profile-dir {allowed}\n")
    assert not outside.exists()
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    assert save(str(notes)) == (1, f"radiancectl profile: the daemon refused: {notes}: exists and is not an expert "
                                   f"profile; the daemon writes only a new file or over a profile: choose another "
                                   f"path\n")
    assert notes.read_text() == "keep me"

    monkeypatch.chdir(outside.parent)  # radiancectl's working directory plays no part
    relative = str(tmp_path.relative_to(allowed) / "live.bin")
    assert save(relative) == (0, "")
    assert sorted(os.listdir(tmp_path)) == ["live.bin", "notes.txt"]  # written whole: no temporary file left
    assert Profile.from_bytes((tmp_path / "live.bin").read_bytes()).steps > 0
    assert os.listdir(outside.parent) == []
    assert save(relative)[0] == 0  # over a profile: allowed (and merged)

