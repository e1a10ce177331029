"""The byte counters of the package's own buffers (docs/ARCHITECTURE.md, "Memory beyond model states"): what the
gather pool owns, has handed out and has handed out at most at once; the staging ring's slots; the scratch dicts.
Single process, no collectives."""

import torch

from ds_asynchzp.comm.collectives import scratch
from ds_asynchzp.runtime.buffer_bytes import _scratch_bytes
from ds_asynchzp.state.buffer_pool import BufferPool, StagingRing


def test_pool_counts_owned_in_use_and_peak_bytes():
    pool = BufferPool()
    assert (pool.owned_bytes, pool.in_use_bytes, pool.peak_in_use_bytes) == (0, 0, 0)
    a, _ = pool.acquire(10, torch.float32, "cpu")             # 40 bytes, a miss
    b, _ = pool.acquire(6, torch.bfloat16, "cpu")             # 12 bytes, a miss
    assert (pool.owned_bytes, pool.in_use_bytes, pool.peak_in_use_bytes) == (52, 52, 52)
    pool.release(a)
    assert (pool.owned_bytes, pool.in_use_bytes, pool.peak_in_use_bytes) == (52, 12, 52)
    again, _ = pool.acquire(10, torch.float32, "cpu")         # a hit: nothing new is owned
    assert again.data_ptr() == a.data_ptr() and pool.allocations == 2
    assert (pool.owned_bytes, pool.in_use_bytes) == (52, 52)
    pool.release(again)
    pool.release(b)
    del a, again                                               # the pool's entry is the only reference left
    twice = [pool.acquire(10, torch.float32, "cpu")[0] for _ in range(2)]   # one hit, one miss: 2 of that size
    assert (pool.owned_bytes, pool.in_use_bytes, pool.peak_in_use_bytes) == (92, 80, 80)
    for buffer in twice:
        pool.release(buffer)
    assert pool.in_use_bytes == 0 and pool.peak_in_use_bytes == 80
    # Teardown drops the free buffers: nothing is owned any more.
    pool.clear()
    assert pool.owned_bytes == 0


def test_a_buffer_still_referenced_elsewhere_costs_a_new_one():
    pool = BufferPool()
    kept, _ = pool.acquire(8, torch.float32, "cpu")
    view = kept.view(2, 4)            # a view autograd saved: the buffer cannot be handed out again
    pool.release(kept)
    del kept
    other, _ = pool.acquire(8, torch.float32, "cpu")
    assert other.data_ptr() != view.data_ptr()
    assert (pool.owned_bytes, pool.in_use_bytes, pool.peak_in_use_bytes) == (64, 32, 32)


def test_staging_ring_bytes_are_every_slot_at_the_largest_capacity():
    ring = StagingRing(slots=4)
    assert (ring.nbytes(), ring.capacity, ring.element_size) == (0, 0, 0)
    ring.acquire(100, torch.float32, "cpu")
    ring.acquire(30, torch.float32, "cpu")
    assert ring.nbytes() == 4 * 100 * 4
    ring.acquire(250, torch.float32, "cpu")          # a larger bucket grows every slot
    assert (ring.slots, ring.capacity, ring.element_size) == (4, 250, 4)
    assert ring.nbytes() == ring.slots * ring.capacity * ring.element_size == 4000


def test_scratch_bytes_count_every_buffer_once_and_not_the_counter():
    pool = {}
    scratch(pool, "send", 10, torch.float32, "cpu")
    scratch(pool, "send", 4, torch.float32, "cpu")       # fits: reused
    scratch(pool, "recv", 3, torch.bfloat16, "cpu")
    assert pool["allocations"] == 2
    assert _scratch_bytes(pool) == 10 * 4 + 3 * 2
    scratch(pool, "send", 20, torch.float32, "cpu")      # grown: the larger one replaces it
    assert _scratch_bytes(pool) == 20 * 4 + 3 * 2
