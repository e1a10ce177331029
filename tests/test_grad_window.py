"""The accumulation window of the gradient shard, in one process: what survives a step, what a reopened window
keeps aside, and the first backward's copy (Stage 3's semantics; tests/test_fuzz_parity.py checks them against stock on
several ranks).

Stock Stage 3 copies each reduced gradient into its partition in a window's first backward, adds afterwards,
and never zeroes the partition: a parameter without a gradient in a window steps with its last gradient. The
gradient shard's own row is that partition.
"""

import pytest
import torch

from ds_asynchzp.comm.grad_reduce import GradReduce, bucket_fingerprint
from ds_asynchzp.layout import HierarchicalLayout
from ds_asynchzp.platform.process_groups import Group
from ds_asynchzp.scheduler.comm_thread import InlineRunner
from ds_asynchzp.state.grad_shards import GradShards, Window


def _param(ds_id: int, numel: int, rows: int):
    param = torch.nn.Parameter(torch.zeros(numel))
    param.ds_id, param.ds_numel = ds_id, numel
    param.partition_numel = lambda: -(-numel // rows)
    return param


def _shards(carries_previous=True):
    # d_o = 4 atoms, d_g = 1: four rows, this rank's own atom in row 2.
    layout = HierarchicalLayout(world=4, node_size=1, param_shard_size=1, grad_shard_size=1,
                                optimizer_shard_size=4)
    params = [_param(0, 8, 4), _param(1, 5, 4)]
    return GradShards(layout, dp_rank=2, params_in_flat_order=params, dtype=torch.float32, device="cpu",
                      carries_previous=carries_previous), params


def test_a_step_keeps_the_own_row_and_zeroes_the_partial_sums():
    shards, params = _shards()
    shards.begin_accumulate(params)
    shards.buffer.data.fill_(3.0)
    shards.end_step()
    own = shards.buffer.own_row
    assert shards.window is Window.EMPTY
    assert torch.all(shards.buffer.data[own] == 3.0)
    assert shards.buffer.data[:own].abs().sum() == 0 and shards.buffer.data[own + 1:].abs().sum() == 0


def test_a_reopened_window_keeps_its_sum_aside_and_starts_every_row_from_zero():
    shards, params = _shards()
    shards.begin_accumulate(params)
    shards.buffer.data.fill_(3.0)
    shards.window = Window.REDUCED            # the cross-node sum was submitted
    with pytest.raises(RuntimeError, match="reopened"):
        shards.begin_accumulate(params)      # a late gradient must reopen the window first
    shards.reopen()
    assert shards.window is Window.ACCUMULATING and shards.buffer.data.abs().sum() == 0
    assert torch.all(shards.reduced_earlier == 3.0)
    # A first backward's copy replaces the kept sum of the parameters it reaches, and only theirs.
    shards.replace_earlier([params[0]])
    c0, c1 = shards.buffer.columns[0], shards.buffer.columns[1]
    assert shards.reduced_earlier[c0.offset:c0.offset + c0.atom].abs().sum() == 0
    assert torch.all(shards.reduced_earlier[c1.offset:c1.offset + c1.atom] == 3.0)
    shards.end_step()
    assert shards.reduced_earlier is None and shards.window is Window.EMPTY


def test_only_the_first_optimizer_replica_carries_the_kept_gradient_into_a_window():
    for carries in (True, False):
        shards, params = _shards(carries_previous=carries)
        shards.buffer.own.fill_(2.0)
        shards.begin_accumulate(params)
        assert torch.all(shards.buffer.own == (2.0 if carries else 0.0)), carries
        # Later buckets of the same window never touch it again.
        shards.buffer.own.fill_(5.0)
        shards.begin_accumulate(params)
        assert torch.all(shards.buffer.own == 5.0)


def test_the_first_backward_copies_and_the_later_ones_add():
    shards, params = _shards()
    shards.buffer.own.fill_(7.0)      # the gradient kept from the last step
    reduce = GradReduce(shards, Group("grad_shard", (0,)), divisor=1, use_reduce_scatter=True, runner=InlineRunner("reduce", 30))
    for param in params:
        param.grad = torch.ones(param.ds_numel)
    reduce.reduce_bucket(params, torch.float32, first=True).wait()
    first = shards.buffer.atoms(params[0]).clone()
    assert torch.all(first == 1.0), "the first backward replaces the kept gradient"
    for param in params:
        param.grad = torch.ones(param.ds_numel)
    reduce.reduce_bucket(params, torch.float32, first=False).wait()
    assert torch.all(shards.buffer.atoms(params[0]) == 2.0)


def test_a_parameter_missing_from_the_first_backward_adds_to_the_kept_gradient():
    shards, params = _shards()
    shards.buffer.own.fill_(7.0)
    reduce = GradReduce(shards, Group("grad_shard", (0,)), divisor=1, use_reduce_scatter=True, runner=InlineRunner("reduce", 30))
    params[0].grad = torch.ones(8)
    reduce.reduce_bucket([params[0]], torch.float32, first=True).wait()
    params[1].grad = torch.ones(5)
    reduce.reduce_bucket([params[1]], torch.float32, first=False).wait()
    own = shards.buffer.own_row
    assert torch.all(shards.buffer.atoms(params[0])[own] == 1.0)
    assert torch.all(shards.buffer.atoms(params[1])[own, :1] == 8.0), "7 kept + 1 added"


def test_bucket_fingerprints_tell_different_buckets_apart():
    a, b = _param(3, 10, 4), _param(4, 10, 4)
    assert bucket_fingerprint([a, b]) == bucket_fingerprint([a, b])
    assert bucket_fingerprint([a]) != bucket_fingerprint([a, b])
    assert bucket_fingerprint([a]) != bucket_fingerprint([b])
