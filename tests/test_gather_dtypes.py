"""Gathers are grouped by dtype: a bf16 parameter fetched together with an fp32 one comes back bf16, with its
own values (a concatenation would silently promote it). One process, a one-rank layout: the collective is a
local copy, the packing, grouping and unpacking are the real ones."""

import torch

from ds_asynchzp.comm.param_gather import ParamGather
from ds_asynchzp.layout import HierarchicalLayout
from ds_asynchzp.runtime.deepspeed_internals import ZeroParamStatus
from ds_asynchzp.runtime.process_groups import Group
from ds_asynchzp.state.param_shards import ParamShards


def _fake_zero_param(ds_id, values):
    param = torch.nn.Parameter(torch.empty(0, dtype=values.dtype), requires_grad=False)
    param.ds_id, param.ds_numel, param.ds_shape = ds_id, values.numel(), values.shape
    param.ds_tensor = values.detach().reshape(-1).clone()
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE
    return param


def test_mixed_dtypes_come_back_in_their_own_dtype():
    layout = HierarchicalLayout(1, 1, 1, 1, 1)
    shards = ParamShards(layout, dp_rank=0)
    half = torch.randn(3, 5).to(torch.bfloat16)
    full = torch.randn(7, dtype=torch.float32)
    params = [_fake_zero_param(0, half), _fake_zero_param(1, full)]
    shards.adopt_frozen(params)
    assert {b.data.dtype for b in shards.buffers} == {torch.bfloat16, torch.float32}
    gather = ParamGather(shards, Group("param_shard", (0,)))
    gather.all_gather_coalesced(params).wait()
    assert params[0].dtype == torch.bfloat16 and torch.equal(params[0].data, half)
    assert params[1].dtype == torch.float32 and torch.equal(params[1].data, full)
    assert all(p.ds_status == ZeroParamStatus.AVAILABLE for p in params)
