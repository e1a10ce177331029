"""The partition fingerprints (`state/partition_watch.py`) see every in-place write that keeps the sum of the
stored bits, which a plain sum did not: a swap of two values, a permutation of a parameter's atom, and a change
of one value by one unit in the last place."""

import pytest
import torch

from ds_asynchzp.errors import PartitionWriteError
from ds_asynchzp.state import partition_watch
from ds_asynchzp.state.partition_watch import PartitionWatch
from ds_asynchzp.state.sharded_buffer import ShardedBuffer


def _watched(dtype: torch.dtype, sizes=(37, 300, 5, 64)):
    torch.manual_seed(0)
    params = []
    for i, size in enumerate(sizes):
        param = torch.nn.Parameter(torch.empty(size))
        param.ds_id = i
        params.append(param)
    buffer = ShardedBuffer("params", params, rows=2, own_row=1, dtype=dtype, device="cpu",
                           atom_of=lambda p: p.numel())
    buffer.data.copy_(torch.randn(buffer.data.shape).to(dtype))
    watch = PartitionWatch([buffer], {p.ds_id: f"layer{p.ds_id}.weight" for p in params})
    watch.record()
    return buffer, watch


def _plain_sum(buffer) -> int:
    return int(buffer.own.view(torch.int16 if buffer.data.element_size() == 2 else torch.int32).sum(dtype=torch.int64))


def _swap(atom):
    atom[[3, 17]] = atom[[17, 3]].clone()


def _roll(atom):
    atom.copy_(torch.roll(atom.clone(), 1))


def _reverse(atom):
    atom.copy_(atom.clone().flip(0))


def _shuffle(atom):
    atom.copy_(atom.clone()[torch.randperm(atom.numel(), generator=torch.Generator().manual_seed(1))])


def _one_ulp(atom):
    bits = atom.view(torch.int16 if atom.element_size() == 2 else torch.int32)
    bits[11] += 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("write", [_swap, _roll, _reverse, _shuffle, _one_ulp])
def test_an_in_place_write_that_keeps_the_sum_is_named(dtype, write):
    buffer, watch = _watched(dtype)
    before = _plain_sum(buffer)
    write(buffer.own_atom(buffer.params[1]))
    if write is not _one_ulp:
        assert _plain_sum(buffer) == before, "the planted write keeps the plain sum of the bits"
    with pytest.raises(PartitionWriteError, match="layer1.weight") as caught:
        watch.check()
    assert "layer3.weight" not in str(caught.value)


def test_no_write_and_a_write_of_the_same_values_pass():
    buffer, watch = _watched(torch.float32)
    watch.check()
    atom = buffer.own_atom(buffer.params[2])
    atom.copy_(atom.clone())
    watch.check()


def test_a_swap_across_chunks_of_a_long_span_is_seen(monkeypatch):
    """The positions go on across the passes of a span (a small CHUNK makes the span take several)."""
    monkeypatch.setattr(partition_watch, "CHUNK", 16)
    buffer, watch = _watched(torch.float32, sizes=(200,))
    atom = buffer.own_atom(buffer.params[0])
    atom[[5, 150]] = atom[[150, 5]].clone()
    with pytest.raises(PartitionWriteError, match="layer0.weight"):
        watch.check()


def test_the_chunked_fingerprint_is_the_direct_one():
    bits = torch.randint(-2**31, 2**31 - 1, (1000,), dtype=torch.int32)
    k = torch.arange(64, dtype=torch.int64)
    direct = torch.arange(1000, dtype=torch.int64)
    x = bits.to(torch.int64)
    old = partition_watch.CHUNK
    partition_watch.CHUNK = 64
    try:
        chunked = partition_watch.span_fingerprint(bits, (k, k * k))
    finally:
        partition_watch.CHUNK = old
    assert chunked.tolist() == [int(x.sum()), int((x * direct).sum()), int((x * direct * direct).sum())]
