"""Pinned host buffers for the routing ids of steps in flight, reused once each step is counted.

The pipelined loop launches step N+1 before it counts step N, so every step's
routing ids (the expert slab's [T, R, k] record, copied off the device at
`ExpertSlab.end_launch`) land in a host buffer of their own, which nothing may
overwrite until `ExpertSlab.count` has read them. A fresh pinned buffer and
event each step is host time on the step's critical path; `RoutingBuffers`
lends them and takes them back. Reuse is tied to reading, not to a count of
steps in flight: a buffer returns only through `give`, which its holder calls
once it has read the buffer, so no later copy can land in a buffer a step still
needs, however many steps are in flight. A buffer never given back (its step
failed before it was read) is left to the garbage collector.
"""

from __future__ import annotations

import math

import torch

KEEP = 4  # free buffers kept: the pipelined loop holds two in flight, so the pool stays a few buffers


class RoutingBuffer:
    """One step's routing ids on the host: int64 elements (pinned on CUDA), viewed as the shape
    last asked for (`ids`, and `array` as numpy), and the event after the copy into it."""

    def __init__(self, numel: int, cuda: bool):
        self.numel = numel
        with torch.inference_mode(False):  # a normal tensor, copied into in and out of inference mode
            self.flat = torch.empty(numel, dtype=torch.int64, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.shape: tuple[int, ...] | None = None
        self.ids = self.flat[:0]
        self.array = self.flat.numpy()[:0]

    def view(self, shape: tuple[int, ...]) -> None:
        """Point `ids` and `array` at the buffer's first elements as `shape` (kept while it repeats)."""
        if shape != self.shape:
            n = math.prod(shape)
            self.shape, self.ids = shape, self.flat[:n].view(shape)
            self.array = self.ids.numpy()

    def mark_copied(self) -> None:
        """After the copy into `ids` is queued (CUDA: records the event `wait` waits for)."""
        if self.event is not None:
            self.event.record()

    def wait(self) -> None:
        """Until the copy into `ids` is done (CUDA; on the CPU it already is)."""
        if self.event is not None:
            self.event.synchronize()  # deliberate: the reader needs the data on the host


class RoutingBuffers:
    """A pool of `RoutingBuffer`s (pinned, each with an event, when `cuda`)."""

    def __init__(self, cuda: bool, keep: int = KEEP):
        self.cuda, self.keep = cuda, keep
        self._free: list[RoutingBuffer] = []
        self.made = 0  # buffers allocated since start (every other take reused one)

    def take(self, shape: tuple[int, ...]) -> RoutingBuffer:
        """A buffer of at least prod(shape) elements that no one else holds, viewed as `shape`: the
        smallest free one that fits, else a new one (of a power of two elements, so that steps of
        nearby sizes share it)."""
        n = math.prod(shape)
        buffer = None
        for free in self._free:
            if n <= free.numel and (buffer is None or free.numel < buffer.numel):
                buffer = free
        if buffer is not None:
            self._free.remove(buffer)
        else:
            self.made += 1
            buffer = RoutingBuffer(1 << max(n - 1, 0).bit_length(), self.cuda)
        buffer.view(shape)
        return buffer

    def give(self, buffer: RoutingBuffer) -> None:
        """Take back a buffer its holder has read and will not read again: a later `take` may lend
        it to another copy. Past `keep` free buffers, the smallest is dropped."""
        self._free.append(buffer)
        if len(self._free) > self.keep:
            self._free.remove(min(self._free, key=lambda b: b.numel))
