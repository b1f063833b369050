"""The pool of host buffers the slab's routing copies land in (tiers/routing_buffers.py): a buffer
is lent to one holder at a time and reused only once its holder gives it back."""

from __future__ import annotations

import torch

from radianced.tiers.routing_buffers import RoutingBuffers


def test_a_lent_buffer_is_not_lent_again_until_given_back():
    pool = RoutingBuffers(cuda=False)
    a = pool.take((2, 3, 4))
    b = pool.take((2, 3, 4))  # a is still held (its step is not read): b is another buffer
    assert a is not b and a.flat.data_ptr() != b.flat.data_ptr()
    a.ids.fill_(1)
    b.ids.fill_(2)
    assert (a.array == 1).all() and a.ids.shape == a.array.shape == (2, 3, 4)
    pool.give(a)
    c = pool.take((2, 3, 4))
    assert c is a and (b.array == 2).all()  # reused once given back; b untouched
    assert pool.made == 2


def test_the_smallest_free_buffer_that_fits_is_lent_viewed_as_asked():
    pool = RoutingBuffers(cuda=False)
    small, large = pool.take((1, 4, 2)), pool.take((10, 4, 8))
    assert small.numel == 8 and large.numel == 512  # powers of two: nearby sizes share
    pool.give(large)
    pool.give(small)
    again = pool.take((1, 3, 2))
    assert again is small and again.ids.shape == (1, 3, 2)
    assert torch.equal(again.ids.reshape(-1), again.flat[:6])
    bigger = pool.take((2, 4, 2))  # 16 elements: only the large one fits
    assert bigger is large and bigger.ids.shape == (2, 4, 2)
    assert pool.take((20, 4, 8)) not in (small, large) and pool.made == 3


def test_the_pool_keeps_its_largest_free_buffers():
    pool = RoutingBuffers(cuda=False, keep=2)
    held = [pool.take((n,)) for n in (4, 8, 16)]
    for buffer in held:
        pool.give(buffer)
    assert pool.take((16,)) is held[2] and pool.take((8,)) is held[1]
    assert pool.take((4,)) is not held[0]  # the smallest was dropped


def test_a_buffer_made_in_inference_mode_takes_copies_outside_it():
    """Decode graphs are warmed up in inference mode and the runner's steps end outside it: one
    buffer serves both."""
    pool = RoutingBuffers(cuda=False)
    with torch.inference_mode():
        buffer = pool.take((2, 2))
        buffer.ids.copy_(torch.ones(2, 2, dtype=torch.int64))
    pool.give(buffer)
    again = pool.take((2, 2))
    again.ids.copy_(torch.full((2, 2), 3))
    assert again is buffer and (again.array == 3).all()
