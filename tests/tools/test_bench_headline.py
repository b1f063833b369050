"""tools/bench_headline.py's dry run on the CPU: the model, the profile the daemon saves, three cards each
predicted and measured, and a second call that reuses what the first made. Structure and consistency, no timing."""

from __future__ import annotations

import json

import pytest

from tools import bench_headline


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    home, out = tmp_path_factory.mktemp("headline-home"), tmp_path_factory.mktemp("headline-out")
    mp = pytest.MonkeyPatch()
    mp.setenv("RADIANCED_CPU_THREADS", "1")
    try:
        assert bench_headline.main(["--out", str(out), "--dir", str(home)]) == 0
    finally:
        mp.undo()
    return home, out, json.loads((out / "headline.json").read_text())


def test_each_card_is_predicted_and_measured_at_b1_and_b8(run):
    _, out, state = run
    assert state["quick"] and state["model"]["quantize"] == "experts=int4"
    assert "ranked pairs" in state["profile"]["said"] and state["profile"]["start_s"] > 0
    assert (out / "headline-profile-daemon.log").exists()
    cards = [state["cards"][k] for k in sorted(state["cards"], key=int)]
    assert len(cards) == 3
    slots = [c["expert_slots"] for c in cards]
    assert slots == sorted(slots) and slots[0] < slots[-1] < state["model"]["experts"]
    for card in cards:
        assert [p["batch"] for p in card["predicted"]] == [1, 8]
        assert [m["batch"] for m in card["measured"] if "batch" in m] == [1, 8]
        assert all(p["slots"] == card["expert_slots"] for p in card["predicted"])
        bench = json.loads((out / f"headline-{card['card_mib']}-bench.json").read_text())
        decode = next(w for w in bench["workloads"] if w["name"] == "decode")
        b1, server = card["measured"][0], decode["server"]
        # the decode steps' figures (the plan's), the row's whole ones (its prompt's prefill too) beside them
        assert b1["overflow_bytes_per_token"] == server["decode_overflow_bytes"] / server["decode_tokens"]
        assert b1["hit_rate"] == server["decode_hits"] / server["decode_lookups"]
        tokens = decode["summary"]["output_tokens"]
        assert b1["overflow_bytes_per_token_with_prefill"] == server["overflow_bytes"] / tokens
        assert b1["hit_rate_with_prefill"] == server["hit_rate"]
        assert 0 < server["decode_lookups"] < server["expert_lookups"]  # the prompt's step routed too
        assert {w["name"].split()[0] for w in bench["workloads"]} == {"decode", "prefill", "sweep"}
    hits = [c["predicted"][0]["hit_rate"] for c in cards]
    assert hits == sorted(hits)  # more slots, the profile's next-ranked experts: a higher predicted hit rate
    md = (out / "headline.md").read_text()
    assert "CPU dry run" in md and md.count("| 1 |") == 3 and md.count("| 8 |") == 3
    assert (out / "headline-chain.png").stat().st_size > 5_000  # four panels of three cards


def test_a_second_call_reuses_the_model_profile_and_cards(run, tmp_path):
    home, _, state = run
    assert bench_headline.main(["--out", str(tmp_path), "--dir", str(home), "--steps", "cards"]) == 0
    again = json.loads((tmp_path / "headline.json").read_text())
    assert again["cards"] == state["cards"] and again["model"] == state["model"]


def test_an_earlier_calls_profile_of_the_same_model_stands_in_for_profiling(run, tmp_path):
    """The synthetic model made again (same shape and seed) is the same file, so the first call's profile copy
    installs (its checksum checked) and no profiling daemon starts; a file that is not its profile is refused
    and removed."""
    _, out, state = run
    copy = out / bench_headline.PROFILE_COPY
    home, again = tmp_path / "home", tmp_path / "out"
    assert bench_headline.main(["--out", str(again), "--dir", str(home), "--steps", "model,profile",
                                "--profile-from", str(copy)]) == 0
    made = json.loads((again / "headline.json").read_text())
    assert made["profile"]["from"] == str(copy) and not (again / "headline-profile-daemon.log").exists()
    model = bench_headline.Path(made["model"]["path"])
    assert model.with_name(model.name + ".expert-profile.bin").read_bytes() == copy.read_bytes()
    other = tmp_path / "other.bin"
    other.write_bytes(b"not a profile")
    first = bench_headline.Path(state["model"]["path"])
    kept = first.with_name(first.name + ".expert-profile.bin").read_bytes()
    assert not bench_headline._install_profile(other, first)
    assert not first.with_name(first.name + ".expert-profile.bin").exists()
    assert not bench_headline._install_profile(tmp_path / "missing.bin", first)  # a wrong HEADLINE_PROFILE: profile
    first.with_name(first.name + ".expert-profile.bin").write_bytes(kept)  # the module's other tests use it


def test_a_card_that_failed_runs_again(run, tmp_path):
    home, _, state = run
    state_path = next(home.glob("radianced-headline-*/headline.json"))
    failed = json.loads(state_path.read_text())
    first = min(failed["cards"], key=int)
    failed["cards"][first] = {"error": "ProfileError: cannot read the profile"}  # the H200's call of 2026-12-04
    state_path.write_text(json.dumps(failed))
    assert bench_headline.main(["--out", str(tmp_path), "--dir", str(home), "--steps", "cards"]) == 0
    again = json.loads((tmp_path / "headline.json").read_text())
    assert "error" not in again["cards"][first] and again["cards"][first]["card_mib"] == int(first)
    assert {k: v for k, v in again["cards"].items() if k != first} == \
        {k: v for k, v in state["cards"].items() if k != first}


def test_the_all_hit_cards_step_predicts_the_others_with_their_misses_on_the_link():
    def card(hit, overflow, tpot):
        return {"predicted": [{"batch": 1, "overflow_bytes_per_token": overflow, "tok_s_link_bound": None,
                               "tok_s_serial": 100.0, "slots": 1, "hit_rate": hit}],
                "measured": [{"batch": 1, "hit_rate": hit, "tpot_p50_s": tpot, "decode_tok_s": 1 / tpot,
                              "overflow_bytes_per_token": overflow, "tok_s": 0.9 / tpot}]}
    state = {"rates": {"pcie_gbps": 50.0, "hbm_gbps": 4000.0},
             "cards": {"24576": card(0.9, 100e6, 0.01), "49152": card(1.0, 0.0, 0.008)}}
    bench_headline.from_resident(state)
    small, large = (state["cards"][k]["predicted"][0] for k in ("24576", "49152"))
    assert large["tok_s_from_resident"] == pytest.approx(125.0) and large["resident_card_mib"] == 49152
    assert small["tok_s_from_resident"] == pytest.approx(1 / (0.008 - 100e6 / 4000e9 + 100e6 / 50e9))
    md = bench_headline.render(state)
    assert "| 24 GiB | 1 | 1 | 90.0% / 90.0% |" in md and "from the resident step" in md
    assert f"| {1 / 0.01:,.1f} / {0.9 / 0.01:,.1f} | {100 / small['tok_s_from_resident']:.2f} |" in md
    # the small card's step, 10 ms against the all-hit 8: its 100 MB of misses crossed in 2 ms + their HBM time
    miss = state["cards"]["24576"]["measured"][0]["miss_link_gbps"]
    assert miss == pytest.approx(100e6 / (0.01 - 0.008 + 100e6 / 4000e9) / 1e9)
    assert f"| {miss:.1f} ({miss / 50:.0%}) |" in md
    assert state["cards"]["49152"]["measured"][0]["miss_link_gbps"] is None  # it missed nothing
    del state["cards"]["49152"]
    bench_headline.from_resident(state)  # no card hit everything: nothing to predict from
    assert state["cards"]["24576"]["predicted"][0]["tok_s_from_resident"] is None
    state["given_steps"] = {"1": 0.008}  # --resident-step-ms 1=8: the large card's step from an earlier call
    bench_headline.from_resident(state)
    small = state["cards"]["24576"]["predicted"][0]
    assert small["tok_s_from_resident"] == pytest.approx(1 / (0.008 - 100e6 / 4000e9 + 100e6 / 50e9))
    assert small["resident_card_mib"] == 0
    assert "measured in an earlier call: --resident-step-ms 1=8" in bench_headline.render(state)
    assert "bench run --quick" not in bench_headline.render(state)
    state["cards"]["24576"]["bench_flags"] = ["--quick"]  # --bench-quick: the table says which cards
    assert "Measured with `bench run --quick` (its workloads sized down" in bench_headline.render(state)


def test_another_shape_or_depth_is_its_own_model_and_replaces_the_others_file(tmp_path):
    other = tmp_path / "radianced-headline-qwen3-next-80b-a3b-48l-experts-int4" / "model.rad"
    other.parent.mkdir()
    other.write_bytes(b"the first model")  # the device's disk holds one headline model at a time
    (other.parent / "headline.json").write_text('{"quick": true}')  # a dry run's, as this one is on the CPU
    full = tmp_path / "radianced-headline-full" / "model.rad"
    full.parent.mkdir()
    full.write_bytes(b"a full run's model")
    (full.parent / "headline.json").write_text('{"quick": false}')
    out = tmp_path / "out"
    assert bench_headline.main(["--out", str(out), "--dir", str(tmp_path), "--steps", "model", "--layers", "1",
                                "--shape", "qwen3-30b-a3b", "--quantize", "experts=fp8"]) == 0
    state = json.loads((out / "headline.json").read_text())
    assert (state["model"]["shape"], state["model"]["layers"], state["model"]["quantize"]) == \
        ("qwen3-30b-a3b", 1, "experts=fp8")
    assert not other.exists() and (tmp_path / "radianced-headline-qwen3-30b-a3b-1l-experts-fp8" / "model.rad").exists()
    assert full.exists()  # a dry run removes no full run's model
