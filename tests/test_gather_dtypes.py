"""The parameter gather in one process, on a one-rank layout (the collective is a local copy; the packing,
grouping, pooling, prefetch and unpacking are the real ones, on a real gather thread).

* Gathers are grouped by dtype: a bf16 parameter fetched together with an fp32 one comes back bf16, with its
  own values (a concatenation would silently promote it).
* Pool buffers are reused once released, never while anything still references them.
* The prefetch replays the recorded request order and stops when the order departs from it.
"""

import pytest
import torch

from ds_asynchzp.comm.param_gather import GatherSource, ParamGather
from ds_asynchzp.layout import HierarchicalLayout
from ds_asynchzp.platform.deepspeed_internals import ZeroParamStatus
from ds_asynchzp.platform.process_groups import Group
from ds_asynchzp.scheduler.comm_thread import CommThread, InlineRunner
from ds_asynchzp.state.buffer_pool import BufferPool
from ds_asynchzp.state.param_shards import ParamShards


def _fake_zero_param(ds_id, values):
    param = torch.nn.Parameter(torch.empty(0, dtype=values.dtype), requires_grad=False)
    param.ds_id, param.ds_numel, param.ds_shape = ds_id, values.numel(), values.shape
    param.ds_tensor = values.detach().reshape(-1).clone()
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE
    return param


def _gather_over(params, runner):
    shards = ParamShards(HierarchicalLayout(1, 1, 1, 1, 1), dp_rank=0)
    shards.adopt_frozen(params)
    source = GatherSource(shards, Group("param_shard", (0,)), quantize=None, refresh_waits=lambda ps: [])
    return ParamGather([source], runner, BufferPool(), prefetch_depth=2)


def _release(gather, params):
    """What the coordinator does after a module ran: free the data, then our partition hook runs."""
    for param in params:
        param.data = torch.empty(0, dtype=param.dtype)
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        gather.released(param)


@pytest.fixture
def thread():
    runner = CommThread("gather-test", timeout=30)
    yield runner
    assert runner.stop()


def test_mixed_dtypes_come_back_in_their_own_dtype(thread):
    half = torch.randn(3, 5).to(torch.bfloat16)
    full = torch.randn(7, dtype=torch.float32)
    params = [_fake_zero_param(0, half), _fake_zero_param(1, full)]
    gather = _gather_over(params, thread)
    assert {b.data.dtype for b in gather.sources[0].shards.buffers} == {torch.bfloat16, torch.float32}
    gather.all_gather_coalesced(params).wait()
    assert params[0].dtype == torch.bfloat16 and torch.equal(params[0].data, half)
    assert params[1].dtype == torch.float32 and torch.equal(params[1].data, full)
    assert all(p.ds_status == ZeroParamStatus.AVAILABLE for p in params)


def test_pool_buffers_are_reused_after_release_but_never_while_referenced():
    values = [torch.randn(6), torch.randn(6)]
    params = [_fake_zero_param(i, v) for i, v in enumerate(values)]
    gather = _gather_over(params, InlineRunner("gather-test", timeout=30))
    for _ in range(3):
        for param in params:
            gather.all_gather_coalesced([param]).wait()
            _release(gather, [param])
    assert gather.pool.allocations == 1
    gather.all_gather_coalesced([params[0]]).wait()
    kept = params[0].data.view(2, 3)        # e.g. a view autograd saved for backward
    _release(gather, [params[0]])
    gather.all_gather_coalesced([params[1]]).wait()
    assert gather.pool.allocations == 2      # the kept buffer was not handed to another parameter
    assert torch.equal(kept.reshape(-1), values[0]) and torch.equal(params[1].data, values[1])


def test_prefetch_replays_the_recorded_order_and_stops_when_it_departs(thread):
    values = [torch.randn(4) for _ in range(4)]
    params = [_fake_zero_param(i, v) for i, v in enumerate(values)]
    gather = _gather_over(params, thread)

    def micro_step(order):
        gather.new_sequence()
        for i in order:
            gather.all_gather_coalesced([params[i]]).wait()
            assert torch.equal(params[i].data, values[i])
            _release(gather, [params[i]])

    micro_step([0, 1, 2, 3])                       # recorded
    assert gather.stats == {"requests": 4, "prefetched": 0, "departures": 1}
    micro_step([0, 1, 2, 3])                       # replayed: every request after the first was prefetched
    assert gather.stats == {"requests": 8, "prefetched": 3, "departures": 1}
    # Departs at the second request, which was still prefetched (it was one of the next two); prefetching then
    # stops, and what was prefetched for the recorded order goes back.
    micro_step([0, 2, 1, 3])
    assert gather.stats == {"requests": 12, "prefetched": 4, "departures": 2}
    gather.new_sequence()                           # nothing prefetched is left holding a buffer
    assert not gather.leases and not gather._prefetched
