"""The package's own buffers (docs/ARCHITECTURE.md, "Memory beyond model states"): what the gather pool owns, has
handed out and has handed out at most at once, how it reuses a larger buffer and what its once-per-step trim frees;
the staging ring's slots; the flows' scratch. Single process, no collectives."""

import gc

import pytest
import torch

from ds_asynchzp.state.buffer_pool import BufferPool, StagingRing
from ds_asynchzp.state.scratch import Scratch

F32 = torch.float32


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


def test_scratch_bytes_count_every_buffer_once():
    pool = Scratch()
    pool.get("send", 10, torch.float32, "cpu")
    pool.get("send", 4, torch.float32, "cpu")       # fits: reused
    pool.get("recv", 3, torch.bfloat16, "cpu")
    assert pool.allocations == 2
    assert pool.nbytes() == 10 * 4 + 3 * 2
    pool.get("send", 20, torch.float32, "cpu")      # grown: the larger one replaces it
    assert pool.nbytes() == 20 * 4 + 3 * 2


# ------------------------------------------------------------------------------- best fit and trimming
def _cycle(pool, sizes):
    """Acquire every size at once, then give them all back; the buffers handed out."""
    taken = [pool.acquire(n, F32, "cpu")[0] for n in sizes]
    for buffer in taken:
        pool.release(buffer)
    return taken


def test_a_request_reuses_the_smallest_free_buffer_of_its_class_as_a_view():
    pool = BufferPool()
    _cycle(pool, [100, 120, 127])                     # one class (64..127): three buffers, all in use at once
    assert pool.allocations == 3 and pool.owned_bytes == (100 + 120 + 127) * 4
    view, _ = pool.acquire(110, F32, "cpu")           # best fit: the 120, narrowed to 110
    assert view.numel() == 110 and pool.allocations == 3
    assert pool.in_use_bytes == 120 * 4               # what it ties up is the whole buffer
    view.fill_(1)
    pool.release(view)
    again, _ = pool.acquire(110, F32, "cpu")          # the same buffer, the same view
    assert again is view
    pool.release(again)


def test_no_buffer_serves_a_request_of_less_than_half_its_size():
    pool = BufferPool()
    big = _cycle(pool, [128])[0]                      # class 7 (128..255)
    small, _ = pool.acquire(127, F32, "cpu")          # class 6: 128 would be within 2x, but not its class
    assert small.data_ptr() != big.data_ptr() and pool.allocations == 2
    pool.release(small)
    for numel, allocated in ((200, 3), (255, 4)):     # class 7; a miss frees the smaller free 128 (and 200)
        buffer, _ = pool.acquire(numel, F32, "cpu")
        assert buffer.numel() == numel and pool.allocations == allocated
        pool.release(buffer)
    assert pool.frees == 2 and pool.owned_bytes == (127 + 255) * 4
    # Every buffer is less than twice any request it serves: a class holds [2^k, 2^(k+1)) elements.
    hit, _ = pool.acquire(128, F32, "cpu")
    assert hit.untyped_storage().nbytes() == 255 * 4 < 2 * 128 * 4
    pool.release(hit)


def test_a_miss_allocates_as_large_as_its_class_so_buffers_become_interchangeable():
    pool = BufferPool()
    first, _ = pool.acquire(200, F32, "cpu")
    second, _ = pool.acquire(130, F32, "cpu")         # the 200 is in use: a new one, as large as the class's 200
    assert second.untyped_storage().nbytes() == 200 * 4
    pool.release(first)
    pool.release(second)


def test_trim_frees_only_buffers_unused_for_a_whole_step():
    pool = BufferPool()
    _cycle(pool, [1000, 100])                         # construction: a size seen once, and one seen every step
    pool.trim()                                       # the step that saw both keeps both
    assert pool.frees == 0 and pool.owned_bytes == 1100 * 4
    for _ in range(3):                                # steady steps use only the 100
        _cycle(pool, [100])
        pool.trim()
    assert pool.frees == 1 and pool.allocations == 2 and pool.owned_bytes == 100 * 4
    assert pool.owned_bytes <= pool.bound_bytes == 2 * 100 * 4
    # A buffer handed out before the trim and still in use stays.
    held, _ = pool.acquire(100, F32, "cpu")
    pool.trim()
    pool.trim()
    assert pool.owned_bytes == 100 * 4 and pool.in_use_bytes == 100 * 4
    pool.release(held)


def test_trim_keeps_no_more_buffers_per_class_than_were_in_use_at_once():
    pool = BufferPool()
    _cycle(pool, [100, 110, 120])                     # three at once
    pool.trim()
    for numel in (100, 110, 120):                     # then one at a time, each on its best fit
        _cycle(pool, [numel])
    assert pool.owned_bytes == 330 * 4 and pool.frees == 0
    pool.trim()                                       # one was in use at once: the largest stays
    assert pool.owned_bytes == 120 * 4 and pool.frees == 2
    assert pool.owned_bytes <= pool.bound_bytes == 2 * 120 * 4


def test_the_steady_state_allocates_and_frees_nothing():
    """Parameters of many sizes, several in use at once and released in another order, every step the same: after
    the first step nothing is allocated or freed, and what the pool owns stays within its bound."""
    sizes = [7, 64, 100, 3000, 65, 127, 1, 4096, 4095, 300, 64, 100]
    pool = BufferPool()
    counts = []
    for step in range(4):
        if step == 0:
            _cycle(pool, [50_000, 33])                # seen once (construction)
        live = []
        for i, numel in enumerate(sizes):
            live.append(pool.acquire(numel, F32, "cpu")[0])
            if i % 3 == 2:                            # a module's parameters released after it ran
                for buffer in reversed(live[-2:]):
                    pool.release(buffer)
                del live[-2:]
        for buffer in live:
            pool.release(buffer)
        pool.trim()
        counts.append((pool.allocations, pool.frees))
        assert pool.owned_bytes <= pool.bound_bytes
    assert counts[1] == counts[2] == counts[3], counts
    assert pool.owned_bytes < 50_000 * 4              # the construction-only size went at the first trim


def test_a_referenced_buffer_is_never_handed_out_or_freed_while_referenced():
    pool = BufferPool()
    kept, _ = pool.acquire(100, F32, "cpu")
    saved = kept.view(10, 10).t()                     # a view autograd saved, outliving the release
    pool.release(kept)
    del kept
    for numel in (100, 90, 70):                       # its class: never this buffer
        other, _ = pool.acquire(numel, F32, "cpu")
        assert other.data_ptr() != saved.data_ptr()
        pool.release(other)
    for _ in range(3):
        pool.trim()                                   # nothing used: the other goes, the referenced one stays
    assert pool.owned_bytes == 100 * 4 and pool.bound_bytes == 100 * 4
    del saved
    gc.collect()
    again, _ = pool.acquire(100, F32, "cpu")          # no longer referenced: handed out again
    assert pool.allocations == 2
    pool.release(again)
    del again
    pool.trim()
    pool.trim()
    assert pool.owned_bytes == 0 and pool.frees == 2


def test_a_view_given_back_while_still_held_is_not_a_reference():
    """The caller may keep the view it gave back (a finished job's result holds it): that is not a use."""
    pool = BufferPool()
    _cycle(pool, [120])
    slots = {1: pool.acquire(100, F32, "cpu")[0]}
    pool.release(slots[1])
    again, _ = pool.acquire(100, F32, "cpu")
    assert again is slots[1] and pool.allocations == 1
    pool.release(again)
    # ...but a view of it taken elsewhere is.
    published = slots[1].view(10, 10)
    other, _ = pool.acquire(100, F32, "cpu")
    assert other.data_ptr() != published.data_ptr() and pool.allocations == 2
    pool.release(other)


def test_giving_back_a_tensor_the_pool_did_not_hand_out_is_refused():
    pool = BufferPool()
    buffer, _ = pool.acquire(10, F32, "cpu")
    with pytest.raises(ValueError):
        pool.release(torch.empty(10))
    pool.release(buffer)
    with pytest.raises(ValueError):
        pool.release(buffer)


def test_staging_ring_shrinks_to_the_last_steps_largest_bucket_only_after_its_jobs():
    class Job:
        def __init__(self):
            self.waited = 0

        def wait(self, also=()):
            self.waited += 1

    ring = StagingRing(slots=4)
    index, _ = ring.acquire(1000, F32, "cpu")          # an unusual first step
    job = Job()
    ring.hold(index, job)
    ring.end_step()
    assert ring.capacity == 1000 and ring.frees == 0   # the step's largest: kept
    for _ in range(2):
        ring.acquire(100, F32, "cpu")
        ring.acquire(300, F32, "cpu")
        ring.end_step()
    assert job.waited == 1 and ring.frees == 4         # waited for before its slots went
    assert ring.capacity == 300 and ring.allocations == 8
    for _ in range(3):                                 # steady: nothing more
        ring.acquire(100, F32, "cpu")
        ring.acquire(300, F32, "cpu")
        ring.end_step()
    assert (ring.allocations, ring.frees, ring.nbytes()) == (8, 4, 4 * 300 * 4)


def test_scratch_shrinks_to_the_last_steps_largest_request_and_drops_unused_keys():
    pool = Scratch()
    pool.get("recv", 5000, F32, "cpu")                 # the construction's large gather
    pool.get("once", 10, F32, "cpu")
    pool.trim()
    assert pool.nbytes() == (5000 + 10) * 4            # both were asked for during the step
    for _ in range(3):
        pool.get("recv", 200, F32, "cpu")
        pool.get("recv", 300, F32, "cpu")
        pool.trim()
    assert pool.nbytes() == 300 * 4                    # shrunk to the step's largest; "once" dropped
    allocations = pool.allocations
    for _ in range(3):
        pool.get("recv", 200, F32, "cpu")
        pool.get("recv", 300, F32, "cpu")
        pool.trim()
    assert pool.allocations == allocations             # steady: nothing allocated
