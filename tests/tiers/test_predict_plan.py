"""`radiancectl plan`'s predicted block: the tiny MoE (3 MoE layers x 16 experts, top-2, 9216-byte
extents) with a hand-made profile beside it, every number checked by hand.

Each layer counted 100 tokens: expert 0 routed in all of them, expert 1 in 60,
expert 2 in 40 (p = 1, .6, .4), the rest never. With 8 slots the start slots hold
the three experts 0 and 1 and the first two experts 2 in file order ((0,2),
(1,2)); (2,2) is the one routed expert without a slot, its home the host pool.
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from radianced import ctl
from radianced.tiers.profile import Profile, model_checksum, profile_path
from tests.tiers.conftest import EXTENT, LAYERS

FLAGS = ["--card-mib", "256", "--host-pool-mib", "1", "--expert-slots", "8", "--max-num-seqs", "4"]


@pytest.fixture
def model(tier_rad, tmp_path):
    """A private copy of the tiny MoE (a profile beside the shared one would change other tests)."""
    return shutil.copyfile(tier_rad, tmp_path / "m.rad")


def _profile(model) -> None:
    counts = {(layer, e): n for layer in range(LAYERS) for e, n in enumerate((100, 60, 40))}
    Profile(model_checksum(model), range(LAYERS), 16, counts, steps=100).save(profile_path(model))


def _predicted(capsys, *args) -> list[str]:
    assert ctl.main(["plan", *args]) == 0
    out = capsys.readouterr().out.splitlines()
    return out[next(i for i, line in enumerate(out) if line.startswith("predicted")):]


def test_plan_predicts_hit_rate_overflow_and_tok_s_at_b1_and_max_num_seqs(model, capsys):
    _profile(model)
    lines = _predicted(capsys, "--model", str(model), *FLAGS, "--pcie-gbps", "25")
    b1_miss = .4 * EXTENT  # (2,2) misses in 40% of the tokens: 3686.4 bytes a token
    b4_miss = (1 - .6 ** 4) * EXTENT / 4  # looked up in a step of 4 with 1 - .6^4 = .8704
    assert lines == [
        "predicted (profile m.rad.expert-profile.bin: 9 ranked pairs, 100 tokens; steady state: the 8 start slots "
        "hold the profile's top-ranked experts):",
        # 3 layers x (1 + .6) + 2 x .4 of the 6 lookups; 560 of the 600 assignments
        f"  decode b1: hit rate 93.3% (5.60 of 6.00 lookups a step); overflow {b1_miss / 2**20:.3f} MiB a token "
        f"(0.000 MiB of it from disk)",
        f"    tok/s: at most {25e9 / b1_miss:,.1f} at 25.0 GB/s PCIe (--pcie-gbps); give --hbm-gbps for the bound "
        f"with the card's reads added",
        # lookups 3 x (1 + .9744 + .8704) = 8.5344, hits 3 + 3 x .9744 + 2 x .8704 = 7.664
        f"  decode b4: hit rate 89.8% (7.66 of 8.53 lookups a step); overflow {b4_miss / 2**20:.3f} MiB a token "
        f"(0.000 MiB of it from disk)",
        f"    tok/s of the 4 together: at most {25e9 / b4_miss:,.1f} at 25.0 GB/s PCIe (--pcie-gbps); give "
        f"--hbm-gbps for the bound with the card's reads added",
    ]


def test_an_hbm_rate_adds_the_cards_reads_to_the_link_time(model, capsys):
    _profile(model)
    lines = _predicted(capsys, "--model", str(model), *FLAGS, "--max-num-seqs", "1", "--pcie-gbps", "25",
                       "--hbm-gbps", "4000")
    assert len(lines) == 3 and lines[2].startswith(f"    tok/s: at most {25e9 / (.4 * EXTENT):,.1f} at 25.0 GB/s ")
    serial, card_mib = lines[2].split("; ")[1].split(" with ")
    card_bytes = float(card_mib.split(" MiB")[0]) * 2**20  # resident weights + 5.6 hit extents
    assert float(serial.replace(",", "")) == pytest.approx(1 / (.4 * EXTENT / 25e9 + card_bytes / 4000e9), rel=1e-3)
    assert card_bytes > 5.6 * EXTENT


def test_a_measured_all_hit_step_predicts_tok_s_with_the_misses_on_the_link(model, capsys):
    _profile(model)
    lines = _predicted(capsys, "--model", str(model), *FLAGS, "--pcie-gbps", "25", "--hbm-gbps", "4000",
                       "--resident-step-ms", "1=2.5", "--resident-step-ms", "4=4")
    b1_miss, b4_miss = .4 * EXTENT, (1 - .6 ** 4) * EXTENT  # bytes a step
    b1 = 1 / (2.5e-3 - b1_miss / 4000e9 + b1_miss / 25e9)
    b4 = 4 / (4e-3 - b4_miss / 4000e9 + b4_miss / 25e9)
    assert lines[3] == f"    from the all-hit step (2.5 ms at b1): {b1:,.1f} tok/s, its misses' bytes moved from HBM " \
                       "to the link"
    assert lines[6] == f"    from the all-hit step (4 ms at b4): {b4:,.1f} tok/s, its misses' bytes moved from HBM " \
                       "to the link"
    lines = _predicted(capsys, "--model", str(model), *FLAGS, "--pcie-gbps", "25", "--resident-step-ms", "1=2.5")
    assert lines[3] == "    from the all-hit step (2.5 ms at b1): needs a link rate and --hbm-gbps (its misses' " \
                       "bytes move from HBM to the link)"
    assert len(lines) == 6  # no b4 step given: no line


@pytest.mark.parametrize("text", ["1", "0=2", "1=0", "x=2", "1=inf"])
def test_a_resident_step_not_batch_equals_ms_is_refused_naming_the_flag(model, capsys, text):
    with pytest.raises(SystemExit) as exit_:
        ctl.main(["plan", "--model", str(model), *FLAGS, "--resident-step-ms", text])
    assert exit_.value.code == 2
    assert f"argument --resident-step-ms: {text!r}: give BATCH=MS, e.g. 1=6.4" in capsys.readouterr().err


def test_without_a_profile_plan_says_how_to_make_one(model, capsys):
    assert _predicted(capsys, "--model", str(model), *FLAGS) == [
        "predicted: no expert profile (m.rad.expert-profile.bin) beside the model: run radiancectl profile MODEL "
        "--prompts FILE to predict the hit rate, overflow and tok/s"]


def test_with_every_expert_in_a_slot_nothing_overflows_and_no_link_rate_is_needed(model, capsys):
    _profile(model)
    lines = _predicted(capsys, "--model", str(model), *FLAGS[:4], "--placement", "resident", "--max-num-seqs", "1",
                       "--hbm-gbps", "4000")
    assert lines[1] == "  decode b1: hit rate 100.0% (6.00 of 6.00 lookups a step); overflow 0.000 MiB a token " \
                       "(0.000 MiB of it from disk)"
    assert re.fullmatch(r"    tok/s: no overflow, the link does not bound it; [\d,.]+ with [\d.]+ MiB a token at "
                        r"4000 GB/s HBM added", lines[2]), lines[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the link is probed")
def test_without_cuda_or_a_rate_the_tok_s_line_asks_for_one(model, capsys):
    _profile(model)
    lines = _predicted(capsys, "--model", str(model), *FLAGS, "--max-num-seqs", "1")
    assert lines[2] == "    tok/s: needs a link rate: give --pcie-gbps (no CUDA here to probe the link)"


@pytest.mark.parametrize("rate", ["0", "-3", "fast", "inf"])
def test_a_rate_not_above_zero_is_refused_naming_the_flag(model, capsys, rate):
    with pytest.raises(SystemExit) as exit_:
        ctl.main(["plan", "--model", str(model), *FLAGS, "--hbm-gbps", rate])
    assert exit_.value.code == 2
    assert (f"argument --hbm-gbps: {rate!r}: give the rate in GB/s (1e9 bytes a second), a number above 0"
            in capsys.readouterr().err)


def test_with_the_disk_tier_the_misses_come_from_disk_and_the_disk_rate_joins_the_bound(model, capsys):
    _profile(model)
    lines = _predicted(capsys, "--model", str(model), "--card-mib", "256", "--host-pool-mib", "0",
                       "--weights-disk-tier", "--expert-slots", "8", "--max-num-seqs", "1", "--pcie-gbps", "25")
    miss = .4 * EXTENT / 2**20
    assert lines[1] == (f"  decode b1: hit rate 93.3% (5.60 of 6.00 lookups a step); overflow {miss:.3f} MiB a token "
                        f"({miss:.3f} MiB of it from disk)")
    m = re.fullmatch(r"    tok/s: at most ([\d,.]+) at 25\.0 GB/s PCIe \(--pcie-gbps\), ([\d.]+) GB/s disk \(probed\); "
                     r"give --hbm-gbps for the bound with the card's reads added", lines[2])
    assert m, lines[2]
    disk = float(m[2]) * 1e9  # the O_DIRECT probe of the model file, printed to 0.01 GB/s
    bytes_a_second = float(m[1].replace(",", "")) * .4 * EXTENT  # each token reads its miss from disk and over PCIe
    assert bytes_a_second == pytest.approx(min(25e9, disk), abs=0.005e9 + 1e3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_without_a_rate_plan_probes_the_link(model, capsys):
    _profile(model)
    lines = _predicted(capsys, "--model", str(model), *FLAGS, "--max-num-seqs", "1")
    m = re.fullmatch(r"    tok/s: at most ([\d,.]+) at ([\d.]+) GB/s PCIe \(probed\); give --hbm-gbps for the bound "
                     r"with the card's reads added", lines[2])
    assert m, lines[2]
    assert float(m[1].replace(",", "")) * .4 * EXTENT == pytest.approx(float(m[2]) * 1e9, abs=0.05e9 + 1e3)
