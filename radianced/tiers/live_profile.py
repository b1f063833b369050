"""A running daemon's routing counts saved into its expert profile (`radiancectl profile --save`).

The daemon's slab counts every token-to-expert assignment since start
(`ExpertSlab.routing`); `LiveProfile.save` writes them as an expert profile
(`tiers/profile.py`: versioned, checksummed, temp file + rename), by default
`<model>.expert-profile.bin`, which the next start-up ranks the slots by.

Merge, not overwrite (`replace=False`): a profile is a sum of routing
observations, so the counts already in the file are kept and the daemon's are
added. An hour of live traffic must not erase a profiling run over a prompt
set (or another daemon's saved traffic); the sum ranks by all of it, each
source weighted by how much routing it saw. Each save adds only what was
routed since this daemon's previous save to the same file, so saving twice,
or two daemons saving into one file, counts nothing twice. `replace=True`
writes only this daemon's counts since start: for when the traffic has
changed and the old counts should go. A file that cannot be merged (made for
another model file, corrupt, another format version) is replaced, and the
result says why; a missing one is written fresh with the counts since start.

Two savers (threads, or daemons) of one file take turns: an exclusive flock
on the file's folder covers the read, the merge and the rename.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from radianced.tiers.profile import Key, Profile, ProfileError, model_checksum, profile_path


@dataclass(frozen=True)
class Saved:
    """What one save wrote."""

    path: Path
    pairs: int  # ranked (layer, expert) pairs in the file
    added: int  # token-to-expert assignments this save added
    steps: int  # routing steps the file counts, all sources together
    merged: bool  # the file's earlier counts were kept
    note: str | None  # why an existing file was replaced instead of merged, if it was


class LiveProfile:
    """The profile side of one served MoE model. Thread-safe: `save` runs off the event loop."""

    def __init__(self, model_path: str | os.PathLike, moe_layers: Sequence[int], num_experts: int):
        self.model_path = Path(model_path)
        self.checksum = model_checksum(model_path)  # raises ProfileError for a file that is not a .rad
        self.moe_layers = tuple(moe_layers)
        self.num_experts = num_experts
        # per written path: the routing snapshot and steps already added to it
        self._saved: dict[Path, tuple[dict[Key, int], int]] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, rad) -> LiveProfile:
        """The live profile of an open MoE `RadFile`."""
        return cls(rad.path, rad.model.moe_layers, rad.model.num_experts)

    def save(self, routing: Mapping[Key, int], steps: int, path: str | os.PathLike | None = None,
             replace: bool = False) -> Saved:
        """Write the profile at `path` (default `<model>.expert-profile.bin`) atomically.

        routing: (layer, expert) -> assignments since start; steps: routing steps since
        start (both cumulative, as the slab and the driver count them). Raises
        ProfileError naming the path when it cannot be written.
        """
        path = Path(os.path.abspath(path or profile_path(self.model_path)))
        with self._lock, _folder_lock(path):
            old, note = (None, None) if replace else self._existing(path)
            if old is None:  # the file lacks this daemon's earlier counts: write them all
                profile, (base, base_steps) = Profile(self.checksum, self.moe_layers, self.num_experts), ({}, 0)
            else:
                profile, (base, base_steps) = old, self._saved.get(path, ({}, 0))
            added = self._add(profile, routing, base)
            profile.steps += steps - base_steps
            profile.save(path)
            self._saved[path] = (dict(routing), steps)
        return Saved(path, len(profile), added, profile.steps, old is not None, note)

    def _existing(self, path: Path) -> tuple[Profile | None, str | None]:
        """The profile at `path` if it is this model's, else (None, why it is not merged)."""
        if not path.exists():
            return None, None
        try:
            return Profile.load(path, model_checksum=self.checksum, moe_layers=self.moe_layers,
                                num_experts=self.num_experts), None
        except ProfileError as e:
            return None, str(e)

    def _add(self, profile: Profile, routing: Mapping[Key, int], base: Mapping[Key, int]) -> int:
        """Add routing - base to `profile`, layer by layer; the assignments added."""
        added = 0
        for layer in self.moe_layers:
            row = [routing.get((layer, e), 0) - base.get((layer, e), 0) for e in range(self.num_experts)]
            profile.add(layer, row)
            added += sum(row)
        return added


@contextlib.contextmanager
def _folder_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on `path`'s folder (no lock file left behind) while the body runs."""
    try:
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise ProfileError(f"{path}: cannot write the profile: {path.parent}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
