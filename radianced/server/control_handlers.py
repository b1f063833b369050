"""The control API's commands: what the daemon answers on the control socket (control.py is the transport).

`ControlHandlers(daemon).table()` is the `cmd -> handler` mapping that
`control.serve` takes: status, receipt, drain, cancel, profile_save. Each reads
the daemon's state on the event loop; the profile's file write runs on a thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import msgspec

from radianced.config import Config
from radianced.engine.driver import AsyncEngine
from radianced.server import control
from radianced.server.profile_paths import ProfilePathError, resolve_profile_out
from radianced.server.state import ServerState
from radianced.tiers.live_profile import LiveProfile
from radianced.tiers.profile import ProfileError

log = logging.getLogger("radianced")


class DaemonView(Protocol):
    """What the handlers read of the daemon (daemon.py's `Daemon`)."""

    cfg: Config
    engine: AsyncEngine | None  # None while loading
    http: ServerState
    model_name: str
    model_path: str | None
    receipt: list[str]
    started: float  # time.monotonic() at start
    live_profile: LiveProfile | None  # a MoE model's, once loaded

    def request_stop(self, why: str = "stop", again_hurries: bool = False) -> None: ...


class ControlHandlers:
    def __init__(self, daemon: DaemonView):
        self.daemon = daemon

    def table(self) -> dict:
        return {"status": self.status, "receipt": self.receipt, "drain": self.drain, "cancel": self.cancel,
                "profile_save": self.profile_save}

    def status(self, args: dict) -> control.StatusResult:
        d = self.daemon
        engine = d.engine
        sched = engine.scheduler if engine is not None else None
        return control.StatusResult(
            uptime_s=time.monotonic() - d.started,
            state=d.front.phase.value,
            model=d.model_name or (d.model_path or "the default model"),
            receipt=list(d.receipt),
            kv_util=sched.kv_util if sched else 0.0,
            running=sched.num_running if sched else 0,
            waiting=sched.num_waiting if sched else 0,
            requests=[control.RequestSummary(id=r.request_id, state=r.state, prompt_tokens=r.prompt_tokens,
                                             generated=r.generated, age_s=r.age_s)
                      for r in (engine.live() if engine else ())],
            steps=engine.steps if engine else 0,
            experts=_expert_status(engine.engine.experts, engine.engine.cards) if engine else None,
        )

    def receipt(self, args: dict) -> control.ReceiptResult:
        return control.ReceiptResult(lines=list(self.daemon.receipt))

    def drain(self, args: dict) -> control.DrainResult:
        self.daemon.request_stop("radiancectl drain")
        return control.DrainResult(draining=True)

    def cancel(self, args: dict) -> control.CancelResult:
        """Cancel by the X-Request-Id, or the body's id (cmpl-ID, chatcmpl-ID)."""
        request_id = msgspec.convert(args, control.CancelArgs).id
        for prefix in ("chatcmpl-", "cmpl-"):
            request_id = request_id.removeprefix(prefix)
        engine = self.daemon.engine
        return control.CancelResult(cancelled=engine is not None and engine.cancel(request_id))

    async def profile_save(self, args: dict) -> control.ProfileSaveResult:
        """Write the routing counted since start into the expert profile (tiers/live_profile.py
        says why it merges) at a path profile_paths.py allows; the file work runs on a thread.
        Under --tp every card's routing (`Engine.expert_routing` gathers it)."""
        a = msgspec.convert(args, control.ProfileSaveArgs)
        d = self.daemon
        engine = d.engine
        if engine is None:
            raise control.ControlError("the model is still loading; save the profile once /health answers 200")
        if d.live_profile is None:
            raise control.ControlError(f"{d.model_name} is a dense model: it routes no experts, so it has no "
                                       f"expert profile to save")
        if d.cfg.tp > 1:  # each card counts its own experts: gathered to rank 0 between steps, on their thread
            routing = await engine.between_steps(engine.engine.expert_routing)
        else:  # a dict copy runs without giving up the GIL, so the step thread cannot change it mid-copy
            routing = dict(engine.engine.experts.routing)
        steps = engine.steps

        def save():  # on a thread: the path check reads the file system too
            out = resolve_profile_out(a.out, d.model_path, d.cfg.profile_dir)
            return d.live_profile.save(routing, steps, out, a.replace)

        try:
            saved = await asyncio.to_thread(save)
        except (ProfileError, ProfilePathError) as e:
            raise control.ControlError(str(e)) from None
        log.info("expert profile saved: %s: %d ranked pairs, %d assignments added%s", saved.path, saved.pairs,
                 saved.added, "" if saved.note is None else f" (replaced: {saved.note})")
        return control.ProfileSaveResult(path=str(saved.path), pairs=saved.pairs, added=saved.added,
                                         steps=saved.steps, merged=saved.merged, note=saved.note)


def _expert_status(slab, cards) -> control.ExpertStatus | None:
    """The slab's slots, homes and per-layer counts; None for a dense model. Under --tp (`cards`:
    every card's receipt) every card's: their homes, and the slots and counts the other cards
    report to rank 0's slab (engine/tp_counts.py). Read on the loop while a step may count: each
    number is whole, a layer's may be one layer-step apart."""
    if slab is None:
        return None
    s, p = slab.stats, slab.placement
    homes = [(len(p.pinned), len(p.host), len(p.disk))] if cards is None else \
        [(r.experts_pinned, r.experts_host, r.experts_disk) for r in cards.receipts]
    pinned, host, disk = (sum(n) for n in zip(*homes))
    lookups, hits, routed = dict(s.lookups), dict(s.hits), dict(s.routed)
    return control.ExpertStatus(
        slots=slab.num_slots + s.other_slots, pinned=pinned, host=host, disk=disk, refills=s.refills,
        evictions=s.evictions,
        layers=[control.LayerExperts(layer=layer, lookups=lookups[layer], hits=hits[layer], routed=routed[layer])
                for layer in sorted(lookups)])
