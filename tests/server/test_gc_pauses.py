"""GcPauses: every garbage collection of the interpreter timed into the daemon's registry, until closed."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry

from radianced.server.gc_pauses import GcPauses


def counts(registry: CollectorRegistry) -> dict[str, float]:
    return {s.labels["generation"]: s.value for m in registry.collect() for s in m.samples
            if s.name == "radiance_gc_pause_seconds_count"}


def test_each_collection_is_timed_by_generation_until_closed():
    registry = CollectorRegistry()
    pauses = GcPauses(registry)
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
        seen = counts(registry)
        assert seen["2"] >= 2 and seen["0"] >= 1
        total = sum(s.value for m in registry.collect() for s in m.samples if s.name == "radiance_gc_pause_seconds_sum")
        assert total > 0
    finally:
        pauses.close()
    assert pauses._callback not in gc.callbacks
    gc.collect(2)
    assert counts(registry)["2"] == seen["2"]  # closed: no longer timed
    pauses.close()  # twice is harmless
