"""The headline run's chain in one figure (issue 24): card memory -> expert slots -> hit rate -> overflow a token
-> tok/s, predicted beside measured, at b = 1 and b = 8.

    chain_plot(state, path)   # state: tools/bench_headline.py's headline.json; False when no card has rows

Four panels share the x axis (the card budget, GiB): the slots the plan gives, the hit rate, the overflow bytes
a token and the tok/s. Predictions are open markers on dashed lines (tok/s: the serial prediction, the card's
reads and the link's in turn, the link-bound ceiling, and the all-hit card's step with the misses moved to the
link), measurements filled markers on solid lines (tok/s: decode, batch / TPOT p50, where the row has it);
b = 1 blue, b = 8 orange. Each link of the chain is read off one panel against the next.
"""

from __future__ import annotations

from pathlib import Path

MiB = 1 << 20
COLOR = {1: "tab:blue", 8: "tab:orange"}


def chain_points(state: dict) -> dict[int, dict[str, list]]:
    """Per batch, per series, the (card GiB, value) points of every card with rows, in card order."""
    series: dict[int, dict[str, list]] = {}
    for mib, row in sorted(state.get("cards", {}).items(), key=lambda kv: int(kv[0])):
        gib = int(mib) / 1024
        meas = {r["batch"]: r for r in row.get("measured", []) if "batch" in r}
        for pr in row.get("predicted", []):
            s = series.setdefault(pr["batch"], {})
            got = meas.get(pr["batch"], {})
            for name, v in (("slots", pr["slots"]), ("hit_pred", pr["hit_rate"]), ("hit_meas", got.get("hit_rate")),
                            ("over_pred", pr["overflow_bytes_per_token"]),
                            ("over_meas", got.get("overflow_bytes_per_token")),
                            ("tok_serial", pr["tok_s_serial"]), ("tok_link", pr["tok_s_link_bound"]),
                            ("tok_resident", pr.get("tok_s_from_resident")),
                            ("tok_meas", got.get("decode_tok_s", got.get("tok_s")))):
                if v is not None:
                    s.setdefault(name, []).append((gib, v / MiB if name.startswith("over") else v))
    return series


def chain_plot(state: dict, path: Path) -> bool:
    series = chain_points(state)
    if not series:
        return False
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(7, 11), sharex=True)
    panels = (("expert slots", (("slots", "the plan's", "o", "-"),)),
              ("expert hit rate", (("hit_pred", "predicted", "o", "--"), ("hit_meas", "measured", "s", "-"))),
              ("overflow MiB a token", (("over_pred", "predicted", "o", "--"), ("over_meas", "measured", "s", "-"))),
              ("tok/s", (("tok_link", "predicted, link bound", "^", ":"),
                         ("tok_serial", "predicted, serial", "o", "--"),
                         ("tok_resident", "predicted from the all-hit step", "D", "-."),
                         ("tok_meas", "measured decode", "s", "-"))))
    for ax, (label, lines) in zip(axes, panels):
        for batch, s in sorted(series.items()):
            for key, what, marker, style in lines:
                pts = s.get(key)
                if not pts or (key == "slots" and batch != min(series)):  # the slots do not depend on b
                    continue
                filled = key.endswith("meas") or key == "slots"
                ax.plot(*zip(*pts), marker=marker, linestyle=style, color=COLOR.get(batch, "gray"),
                        markerfacecolor=None if filled else "none", label=f"b={batch} {what}")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[-1].set_xlabel("card budget (--gpu-memory-mib), GiB")
    m = state.get("model", {})
    axes[0].set_title(f"{m.get('shape')} x {m.get('layers')} layers ({m.get('quantize')}), {state.get('device')}: "
                      "card -> slots -> hit rate -> overflow -> tok/s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
