"""The slice arithmetic of ds_asynchzp.layout, checked by simulating every rank's buffers in one process:
the per-micro-step collectives and the once-per-step ones produce exactly the states the design promises,
with plain collectives over sorted groups (no permutation). Also the packing of a gradient into atom order."""

import itertools

import pytest
import torch

from ds_asynchzp.comm.grad_reduce import pack_transposed
from ds_asynchzp.layout import HierarchicalLayout

LAYOUTS = [
    # world, node, d_p, d_g, d_o
    (8, 4, 4, 4, 8), (8, 4, 2, 4, 8), (8, 4, 2, 4, 4), (8, 4, 1, 2, 2), (8, 2, 2, 4, 8), (8, 4, 4, 8, 8),
    (4, 2, 1, 1, 4), (16, 4, 2, 8, 16), (16, 8, 4, 4, 8), (2, 2, 2, 2, 2), (1, 1, 1, 1, 1),
]


def _atoms(numel, d_o):
    atom = -(-numel // d_o)
    return atom, torch.nn.functional.pad(torch.arange(numel, dtype=torch.float64) + 1, (0, atom * d_o - numel))


@pytest.mark.parametrize("world,node,d_p,d_g,d_o", LAYOUTS)
def test_every_group_is_sorted_and_partitions_the_world(world, node, d_p, d_g, d_o):
    layout = HierarchicalLayout(world, node, d_p, d_g, d_o)
    for groups in (layout.param_shard_groups(), layout.grad_shard_groups(), layout.optimizer_groups(),
                   layout.param_refresh_groups(), layout.grad_boundary_groups(), layout.outer_replica_groups()):
        assert sorted(itertools.chain(*groups)) == list(range(world))
        assert all(g == sorted(g) for g in groups)


@pytest.mark.parametrize("world,node,d_p,d_g,d_o", LAYOUTS)
def test_gather_and_refresh_rebuild_the_parameter(world, node, d_p, d_g, d_o):
    layout = HierarchicalLayout(world, node, d_p, d_g, d_o)
    atom, padded = _atoms(37, d_o)
    atoms = padded.view(d_o, atom)
    # After the optimizer step each rank holds only its own (updated) atom; the rows of its shard are stale.
    shards = {r: torch.full((layout.param_rows, atom), float("nan"), dtype=torch.float64) for r in range(world)}
    for r in range(world):
        shards[r][layout.param_row_of_own_atom(r)] = atoms[layout.own_atom(r)]
    for group in layout.param_refresh_groups():         # all-gather of the own atoms, in group rank order
        gathered = torch.stack([shards[r][layout.param_row_of_own_atom(r)] for r in group])
        for r in group:
            shards[r] = gathered.clone()
    for r in range(world):
        assert torch.equal(shards[r], atoms[layout.param_shard_atoms(r)])
    for group in layout.param_shard_groups():            # per micro-step: all-gather, then a local transpose
        block = torch.stack([shards[r] for r in group])  # [d_p, T_p, atom]
        full = block.transpose(0, 1).reshape(-1)
        assert torch.equal(full, padded)


@pytest.mark.parametrize("world,node,d_p,d_g,d_o", LAYOUTS)
def test_reduce_scatter_and_boundary_sum_every_rank_into_the_owner(world, node, d_p, d_g, d_o):
    layout = HierarchicalLayout(world, node, d_p, d_g, d_o)
    numel = 29
    atom = -(-numel // d_o)
    grads = {r: torch.randn(numel, dtype=torch.float64) for r in range(world)}
    total = torch.nn.functional.pad(sum(grads.values()), (0, atom * d_o - numel)).view(d_o, atom)
    accum = {}
    for group in layout.grad_shard_groups():             # per micro-step reduce-scatter over [d_g, T_g, atom]
        send = {}
        for r in group:
            dst = torch.empty(d_g, layout.grad_rows, atom, dtype=torch.float64)
            pack_transposed(dst.transpose(0, 1), grads[r])
            send[r] = dst
        summed = sum(send.values())
        for i, r in enumerate(group):
            accum[r] = summed[i].clone()                 # [T_g, atom]
    own = {}
    for group in layout.grad_boundary_groups():          # member k receives row k from everyone
        for k, r in enumerate(group):
            own[r] = sum(accum[s][k] for s in group)
    for group in layout.outer_replica_groups():
        summed = sum(own[r] for r in group)
        for r in group:
            own[r] = summed
    for r in range(world):
        assert layout.grad_shard_atoms(r)[layout.grad_row_of_own_atom(r)] == layout.own_atom(r)
        torch.testing.assert_close(own[r], total[layout.own_atom(r)], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("numel", [0, 1, 5, 24, 25, 31, 47, 48])
@pytest.mark.parametrize("rows,d", [(1, 1), (2, 3), (3, 2), (1, 4)])
def test_pack_transposed_writes_atom_order_and_zero_padding(numel, rows, d):
    atom = max(1, -(-numel // (rows * d)))
    src = torch.arange(1, numel + 1, dtype=torch.float32)
    expected = torch.zeros(rows * d * atom)
    expected[:numel] = src
    backing = torch.full((d, rows, atom), float("nan"))
    pack_transposed(backing.transpose(0, 1), src)
    assert torch.equal(backing.transpose(0, 1).reshape(-1), expected)


def test_invalid_layouts_are_rejected():
    for bad in [(8, 4, 3, 3, 8), (8, 4, 4, 2, 8), (8, 4, 2, 4, 2), (8, 3, 1, 1, 8)]:
        with pytest.raises(ValueError):
            HierarchicalLayout(*bad)
