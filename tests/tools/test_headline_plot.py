"""tools/headline_plot.py: the chain's points from a headline state, and its figure."""

from __future__ import annotations

from tools.headline_plot import MiB, chain_plot, chain_points


def card(slots: int, hit: float, measured_hit: float | None) -> dict:
    pred = [{"batch": b, "slots": slots, "hit_rate": hit / b, "overflow_bytes_per_token": 3 * MiB,
             "tok_s_link_bound": 40.0 * b, "tok_s_serial": 30.0 * b} for b in (1, 8)]
    meas = [{"batch": 1, "hit_rate": measured_hit, "overflow_bytes_per_token": 4 * MiB, "tok_s": 25.0},
            {"ttft_p50_s": {"prefill 4096": 0.5}}]
    return {"predicted": pred, "measured": meas}


STATE = {"model": {"shape": "s", "layers": 48, "quantize": "experts=int4"}, "device": "H200",
         "cards": {"49152": card(900, 0.9, 0.85), "24576": card(300, 0.6, None)}}


def test_points_follow_the_cards_in_order_with_overflow_in_mib_and_missing_rows_left_out():
    s = chain_points(STATE)
    assert sorted(s) == [1, 8]
    assert s[1]["slots"] == [(24.0, 300), (48.0, 900)]  # sorted by card, not by the state's order
    assert s[1]["hit_pred"] == [(24.0, 0.6), (48.0, 0.9)] and s[8]["hit_pred"] == [(24.0, 0.075), (48.0, 0.1125)]
    assert s[1]["hit_meas"] == [(48.0, 0.85)]  # the 24 GiB card measured no hit rate
    assert s[1]["over_meas"] == [(24.0, 4.0), (48.0, 4.0)] and s[1]["over_pred"][0] == (24.0, 3.0)
    assert "tok_meas" not in s[8] and s[8]["tok_serial"] == [(24.0, 240.0), (48.0, 240.0)]


def test_the_figure_is_drawn_once_a_card_has_rows(tmp_path):
    assert chain_plot(STATE, tmp_path / "chain.png") and (tmp_path / "chain.png").stat().st_size > 5_000
    assert not chain_plot({"cards": {}}, tmp_path / "none.png") and not (tmp_path / "none.png").exists()
