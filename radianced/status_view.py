"""How `radiancectl status` draws a daemon's status: a summary, its requests, its expert hits
and its receipt, as rich tables (rich is imported only when one is drawn)."""

from __future__ import annotations


def render_status(s) -> None:
    """A daemon's status reply (server/control.py's `StatusResult`) as rich tables on stdout."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False)
    summary = Table(show_header=False, box=None, pad_edge=False)
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("state", s.state)
    summary.add_row("uptime", _duration(s.uptime_s))
    summary.add_row("model", Text(s.model))
    summary.add_row("kv util", f"{s.kv_util:.1%}")
    summary.add_row("requests", f"{s.running} running, {s.waiting} waiting")
    summary.add_row("steps", str(s.steps))
    console.print(summary)

    if s.requests:
        requests = Table(title="requests", title_justify="left")
        requests.add_column("id", overflow="fold")
        requests.add_column("state")
        requests.add_column("prompt", justify="right")
        requests.add_column("generated", justify="right")
        requests.add_column("age", justify="right")
        for r in s.requests:
            requests.add_row(Text(r.id), r.state, str(r.prompt_tokens), str(r.generated), _duration(r.age_s))
        console.print(requests)
    else:
        console.print("requests: none in flight")

    if s.experts is not None:
        _experts(console, s.experts)

    if s.receipt:
        console.print(Text("receipt", style="bold"))
        for line in s.receipt:
            console.print(Text("  " + line), soft_wrap=True)


def _experts(console, e) -> None:
    """The slots and homes on one line, then one line per MoE layer and the total:
    hit rate = hits / lookups since start (SPEC §9's counters)."""
    from rich.table import Table

    console.print(f"experts: {e.slots} slots in use ({e.pinned} pinned), {e.host} in host pool, {e.disk} on disk; "
                  f"{e.refills} refills, {e.evictions} evictions since start")
    table = Table(title="expert hits by layer", title_justify="left")
    for name in ("layer", "hit rate", "hits", "lookups", "routed"):
        table.add_column(name, justify="right")

    def row(name: str, hits: int, lookups: int, routed: int) -> None:
        rate = f"{hits / lookups:.1%}" if lookups else "-"
        table.add_row(name, rate, str(hits), str(lookups), str(routed))

    for layer in e.layers:
        row(str(layer.layer), layer.hits, layer.lookups, layer.routed)
    table.add_section()
    row("all", sum(x.hits for x in e.layers), sum(x.lookups for x in e.layers), sum(x.routed for x in e.layers))
    console.print(table)


def _duration(seconds: float) -> str:
    """45.2 s, 12m 05s, 3h 02m 09s, 2d 03h 00m."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d {h:02d}h {m:02d}m"
    if h:
        return f"{h}h {m:02d}m {s:02d}s"
    return f"{m}m {s:02d}s"
