"""Stock ZeRO-3's contract where frameworks and user code touch it, AsyncHZP against stock in the same run.

On 2 and 4 CPU ranks, with d_p = d_o and d_p < d_o, threads on and off, and once with DeepSpeed's default ZeRO-3
knobs (tests/_contract_workers.py runs each case under both arms):

* several backward() calls between two steps accumulate as in stock, whatever gradient_accumulation_steps says
  (a gradient after the window's cross-node sum reopens it, with a one-time warning), and DeepSpeed's
  boundary flag and unmanaged accumulation work;
* zero_grad() keeps the gradients reduced so far, as stock does (a step reads them, the next backward replaces
  those it reaches);
* Stage 3's gradient state read right after backward (`averaged_gradients`, `_get_norm_groups`) is the window's
  summed gradient, also with the communication threads slowed down;
* a rebound partition (`param.ds_tensor.data = t`) or one written in place reaches the next forward where the
  layout allows it, and is refused by name where it does not (a rebinding at the next gather, an in-place write at
  the next step);
* an engine without an optimizer (a reference model) trains nothing and forwards as stock, its parameters sharded
  inside the node;
* and other stage-3 behaviours DeepSpeed's own unit tests check: a layer used several times per forward,
  activation checkpointing, a non-scalar backward, eval/train switches with no_grad forwards, an emptied partition
  cache, leaf modules, gradients switched off and on between windows.

Weights change by the gradient each step used (client SGD, lr 1): equal deltas mean equal gradients. Sums over
ranks are grouped differently where d_o < N or d_g < N (inside the node, then across), so deltas match to 1e-6
relative, not bit for bit.
"""

from __future__ import annotations

import os

import pytest

from ds_asynchzp.bench.launch import launch_local

from .dist_harness import LAUNCH_TIMEOUT_S, REPO_ROOT

REL = 1e-6
READ_DELAY = "40"   # ms before and after each of the package's collectives: a read that does not wait sees zeros

CASES = [
    {"name": "two_backwards_one_step", "ops": [["fb", 1], ["fb", 2], ["step"]], "reopens": True},
    {"name": "two_torch_style_backwards_one_step", "ops": [["torch_backward", 1], ["torch_backward", 2], ["step"]],
     "reopens": True},
    {"name": "engine_zero_grad_between_backwards", "ops": [["fb", 1], ["engine_zero_grad"], ["fb", 2], ["step"]],
     "reopens": True},
    {"name": "four_backwards_two_steps_gas2", "gas": 2,
     "ops": [["fb", 1], ["fb", 2], ["step"], ["fb", 3], ["fb", 4], ["step"]], "reopens": True},
    {"name": "unmanaged_accumulation", "gas": 2, "unmanaged": True, "ops": [["fb", 1], ["fb", 2], ["step"]]},
    {"name": "boundary_flag", "gas": 2,
     "ops": [["boundary", False], ["fb", 1], ["boundary", True], ["fb", 2], ["step"]]},
    {"name": "backward_zero_grad_step", "ops": [["fb", 1], ["optimizer_zero_grad"], ["step"]]},
    {"name": "zero_grad_then_a_backward_without_b", "ops": [["fb", 1], ["optimizer_zero_grad"],
                                                           ["fb", 2, "skip_b"], ["step"]]},
    {"name": "zero_grad_keeping_tensors", "ops": [["fb", 1], ["optimizer_zero_grad", False], ["fb", 2], ["step"]]},
    {"name": "zero_grad_inside_a_window", "gas": 2, "zero_grad_warning": True,
     "ops": [["fb", 1], ["step"], ["optimizer_zero_grad"], ["fb", 2, "skip_b"], ["step"]]},
    {"name": "gradient_state_read_after_backward", "comm_delay": READ_DELAY,
     "ops": [["fb", 1], ["read_averaged_gradients"], ["read_norm_groups"], ["step"]]},
    {"name": "gradient_state_after_torch_backward", "comm_delay": READ_DELAY,
     "ops": [["torch_backward", 1], ["read_averaged_gradients"], ["step"]]},
    {"name": "rebound_partition", "ops": [["rebind_partition", 0.25], ["forward_loss", 1], ["fb", 1], ["step"]],
     "refused_when_rows": True},
    {"name": "partition_written_in_place", "refused_when_rows": True,
     "ops": [["write_partition_in_place", 0.25], ["forward_loss", 1], ["fb", 1], ["step"]]},
    {"name": "engine_without_optimizer", "no_optimizer": True, "ops": [["forward_loss", 1], ["forward_loss", 2]]},
    {"name": "engine_without_optimizer_built_partitioned", "no_optimizer": True, "zero_init": True,
     "ops": [["forward_loss", 1], ["forward_loss", 2]]},
    {"name": "offload_states_refused", "ops": [["fb", 1], ["step"], ["offload_states"]], "own_check": True},
    # Other stage-3 behaviours DeepSpeed's own unit tests check, here against stock in the same run.
    {"name": "layer_used_three_times_per_forward", "b_uses": 3, "gas": 2,
     "ops": [["fb", 1], ["step"], ["fb", 2], ["step"]]},
    {"name": "activation_checkpointing", "checkpoint_b": True, "ops": [["fb", 1], ["step"], ["fb", 2], ["step"]]},
    {"name": "non_scalar_backward", "ops": [["non_scalar_backward", 1], ["step"]]},
    {"name": "eval_and_train_switches", "ops": [["fb", 1], ["step"], ["eval_forward", 2], ["fb", 3], ["step"],
                                                ["eval_forward", 4]]},
    {"name": "partition_cache_emptied", "ops": [["fb", 1], ["step"], ["empty_partition_cache"], ["fb", 2], ["step"]]},
    {"name": "leaf_modules", "leaf_b": True, "ops": [["fb", 1], ["step"], ["fb", 2], ["step"]]},
    {"name": "gradients_switched_on_and_off", "gas": 2,
     "ops": [["fb", 1], ["step"], ["b_requires_grad", False], ["fb", 2], ["step"], ["b_requires_grad", True],
             ["fb", 3], ["step"], ["fb", 4], ["step"]]},
]

# Optimizer states on the host (`offload_optimizer: cpu`, both arms; the client SGD is kept with
# `zero_force_ds_cpu_optimizer: false`, so the weights still move by the gradient each step used). Stock's offload
# copies to the host at the boundary only what the window's last backward reduced (or, unmanaged, everything
# reduced since the step): these cases hold AsyncHZP to that, on the two-node layouts.
OFFLOAD_LAYOUTS = ("4x2-dp2-do4-async", "4x2-dp2-do2-sync", "2x1-dp1-do2-async-default-knobs")
OFFLOADED = ("two_backwards_one_step", "engine_zero_grad_between_backwards", "four_backwards_two_steps_gas2",
             "unmanaged_accumulation", "boundary_flag", "backward_zero_grad_step", "zero_grad_inside_a_window",
             "activation_checkpointing", "gradients_switched_on_and_off")
CASES += [dict(case, name=f"{case['name']}_offload", offload=True, layouts=OFFLOAD_LAYOUTS)
          for case in CASES if case["name"] in OFFLOADED]
CASES += [
    # The boundary backward first, then one that is not: stock copies (and takes the norms of) the first only.
    {"name": "boundary_then_not_offload", "gas": 2, "offload": True, "layouts": OFFLOAD_LAYOUTS, "reopens": True,
     "ops": [["boundary", True], ["fb", 1], ["boundary", False], ["fb", 2, "skip_b"], ["read_norm_groups"],
             ["boundary", True], ["step"]]},
    {"name": "norm_groups_read_after_backward_offload", "offload": True, "layouts": OFFLOAD_LAYOUTS,
     "comm_delay": READ_DELAY, "ops": [["fb", 1], ["read_norm_groups"], ["step"], ["fb", 2], ["step"]]},
    # A whole window in which b gets no gradient, after one that reduced it. Stock's offload never writes b's host
    # gradient in that window (`partition_grads` copies what the last backward reduced; `zero_grad` does not touch the
    # host buffer): b steps again with the host gradient the step before used, as that step's clipping left it
    # (clipping scales the host gradients in place), and counts in no norm. Without clipping, and with clipping
    # that binds on every step (the norm is read in the window without b).
    {"name": "a_window_without_b_offload", "offload": True, "layouts": OFFLOAD_LAYOUTS,
     "ops": [["fb", 1], ["step"], ["fb", 2, "skip_b"], ["step"], ["fb", 3], ["step"]]},
    {"name": "a_window_without_b_clipped_offload", "offload": True, "layouts": OFFLOAD_LAYOUTS, "clip": 0.05,
     "ops": [["fb", 1], ["step"], ["fb", 2, "skip_b"], ["read_norm_groups"], ["step"], ["fb", 3], ["step"]]},
]
# Defects planted in AsyncHZP's arm (tests/_fuzz_workers.planted), each on the case and layout where it shows: b's host
# gradient zeroed in the window without b, and counted in the norm that clipping reads (with SGD, unlike the fuzzer's
# Adam, a changed clipping factor moves the weights by as much).
PLANTED = {"offload_zero_unreduced": "a_window_without_b_offload",
           "offload_unreduced_in_norm": "a_window_without_b_clipped_offload"}
CASES += [dict(next(case for case in CASES if case["name"] == name), name=f"{name}_planted_{plant}", plant=plant,
               layouts=("2x1-dp1-do2-async-default-knobs",)) for plant, name in PLANTED.items()]

# (ranks, ranks per node, section, d_p, d_o[, DeepSpeed's default ZeRO-3 knobs]); the others partition every
# parameter and flush small gradient buckets.
LAYOUTS = {
    "2x1-dp1-do2-async": (2, 1, {"node_size": 1}, 1, 2),
    "2x1-dp1-do2-async-default-knobs": (2, 1, {"node_size": 1}, 1, 2, True),
    "2x2-dp2-do2-sync": (2, 2, {"node_size": 2, "async_comm": False}, 2, 2),
    "4x2-dp2-do4-async": (4, 2, {"node_size": 2}, 2, 4),
    "4x2-dp2-do2-sync": (4, 2, {"node_size": 2, "optimizer_shard_size": 2, "async_comm": False}, 2, 2),
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def launched(request):
    world, node, section, d_p, d_o, *defaults = LAYOUTS[request.param]
    cases = [dict(case, section=section, default_knobs=bool(defaults)) for case in CASES
             if request.param in case.get("layouts", (request.param,))]
    env = {"PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    ranks = launch_local("tests._contract_workers:run_contract", world, node, {"cases": cases},
                         timeout_s=LAUNCH_TIMEOUT_S, env=env)
    return {"ranks": ranks, "world": world, "d_p": d_p, "d_o": d_o}


def _rel(a, b) -> float:
    scale = max(max((abs(x) for x in b), default=0.0), 1e-30)
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0) / scale


def _arms(launched, name):
    if name not in launched["ranks"][0]:
        pytest.skip(f"{name} runs on the layouts {_case(name)['layouts']} only")
    return [(rank, result[name]["stock"], result[name]["hzp"]) for rank, result in enumerate(launched["ranks"])]


def _case(name):
    return next(case for case in CASES if case["name"] == name)


@pytest.mark.parametrize("name", [case["name"] for case in CASES if not case.get("refused_when_rows")
                                  and not case.get("no_optimizer") and not case.get("own_check")
                                  and not case.get("plant")])
def test_weights_move_as_under_stock(launched, name):
    mismatches = _weights_unlike_stock(launched, name)
    assert not mismatches, mismatches


def _weights_unlike_stock(launched, name) -> list:
    """(rank, parameter, AsyncHZP's change, stock's) of every weight that moved otherwise than under stock."""
    mismatches = []
    for rank, stock, hzp in _arms(launched, name):
        assert stock["error"] is None, (rank, stock["error"])
        assert hzp["error"] is None, (rank, hzp["error"])
        assert hzp["optimizer"].startswith("HierarchicalZeroOptimizer"), hzp["optimizer"]
        assert any(any(want) for want in stock["delta"].values()), f"{name}: stock moved nothing"
        for param, want in stock["delta"].items():
            # Stock's offload drops a gradient the window's last backward missed (it never reaches the host).
            assert any(want) or _case(name).get("offload"), f"{name}: stock did not move {param}: checks nothing"
            if _rel(hzp["delta"][param], want) > REL:
                mismatches.append((rank, param, hzp["delta"][param], want))
    return mismatches


@pytest.mark.parametrize("plant", list(PLANTED))
def test_a_planted_offload_defect_is_caught(launched, plant):
    """The comparison can fail: with the defect planted in AsyncHZP, b's weights move otherwise than stock's."""
    name = f"{PLANTED[plant]}_planted_{plant}"
    assert any(param.startswith("b.") for _, param, _, _ in _weights_unlike_stock(launched, name)), \
        f"the planted defect {plant} went unnoticed"


@pytest.mark.parametrize("name", [case["name"] for case in CASES if case.get("reopens")])
def test_a_gradient_after_the_cross_node_sum_warns_once_naming_the_fix(launched, name):
    for rank, stock, hzp in _arms(launched, name):
        assert not stock["warnings"]
        reopened = [w for w in hzp["warnings"] if "second exchange" in w]
        assert len(reopened) == 1, (rank, hzp["warnings"])
        assert "gradient_accumulation_steps" in reopened[0] and "set_gradient_accumulation_boundary" in reopened[0]


def test_zero_grad_warns_only_inside_a_window(launched):
    for name in ("backward_zero_grad_step", "zero_grad_then_a_backward_without_b", "zero_grad_keeping_tensors",
                 "zero_grad_inside_a_window"):
        for rank, _, hzp in _arms(launched, name):
            warned = [w for w in hzp["warnings"] if "zero_grad() inside an accumulation window" in w]
            assert len(warned) == (1 if _case(name).get("zero_grad_warning") else 0), (name, rank, hzp["warnings"])


def test_gradient_state_read_after_backward_is_the_summed_gradient(launched):
    for name in ("gradient_state_read_after_backward", "gradient_state_after_torch_backward"):
        for rank, stock, hzp in _arms(launched, name):
            assert stock["grad_sq"][0] > 0
            assert abs(hzp["grad_sq"][0] - stock["grad_sq"][0]) <= REL * stock["grad_sq"][0], (name, rank, hzp, stock)
    for rank, stock, hzp in _arms(launched, "gradient_state_read_after_backward"):
        assert abs(hzp["norm_groups"][0] - stock["norm_groups"][0]) <= REL * stock["norm_groups"][0]


@pytest.mark.parametrize("name", ["rebound_partition", "partition_written_in_place"])
def test_a_write_into_a_partition_reaches_the_forward_or_is_refused_by_name(launched, name):
    """Where every gather reads the own atom (d_p = d_o = N) the write acts as under stock; elsewhere a rebinding is
    refused at the next gather, an in-place write at the next step (only its contents show it)."""
    exact = launched["d_p"] == launched["d_o"] == launched["world"]
    for rank, stock, hzp in _arms(launched, name):
        assert stock["error"] is None
        if not exact:
            assert hzp["error"] is not None and hzp["error"].startswith("PartitionWriteError"), hzp["error"]
            assert "GatheredParameters" in hzp["error"] and "modifier_rank" in hzp["error"]
            assert bool(hzp.get("forward")) == (name == "partition_written_in_place"), "where it was refused"
        else:
            assert hzp["error"] is None, hzp["error"]
            assert hzp["forward"] == pytest.approx(stock["forward"], rel=REL)
            for param, want in stock["delta"].items():
                assert _rel(hzp["delta"][param], want) <= REL, (rank, param)


@pytest.mark.parametrize("name", ["boundary_then_not_offload", "norm_groups_read_after_backward_offload",
                                  "a_window_without_b_clipped_offload"])
def test_offload_norms_are_stocks(launched, name):
    """With offload, the norm Stage 3 clips with counts what stock copied to the host: read after the backward,
    after a backward that is not the boundary one, and in a window without b's gradient (where clipping binds)."""
    for rank, stock, hzp in _arms(launched, name):
        assert stock["norm_groups"][0] > _case(name).get("clip", 0.0)
        assert hzp["norm_groups"] == pytest.approx(stock["norm_groups"], rel=REL), (rank, hzp, stock)


def test_offload_with_optimizer_replicas_warns_once(launched):
    """With d_o < N every optimizer replica steps its own host copy: said once per engine, naming the key; with
    d_o = N nothing is said, and stock says nothing either."""
    replicas = launched["d_o"] < launched["world"]
    for rank, stock, hzp in _arms(launched, "two_backwards_one_step_offload"):
        warned = [w for w in hzp["warnings"] if "offload_optimizer" in w]
        assert len(warned) == (1 if replicas else 0), (rank, hzp["warnings"])
        assert all("optimizer_shard_size" in w for w in warned)
        assert not any("offload_optimizer" in w for w in stock["warnings"])


def test_eval_forwards_equal_stock(launched):
    for rank, stock, hzp in _arms(launched, "eval_and_train_switches"):
        assert len(stock["forward"]) == 2
        assert hzp["forward"] == pytest.approx(stock["forward"], rel=REL), rank


@pytest.mark.parametrize("name", ["engine_without_optimizer", "engine_without_optimizer_built_partitioned"])
def test_an_engine_without_an_optimizer_forwards_as_stock_sharded_inside_the_node(launched, name):
    """Sharded over d_p inside the node (hpZ) where DeepSpeed lets it be, also for a model that zero.Init
    partitioned over the world when it was built (from_pretrained under ZeRO-3), which is given its copies when
    the engine is built: no forward's parameter gathers cross nodes. Stock's cross in every forward."""
    d_p, world = launched["d_p"], launched["world"]
    hierarchical = 1 < d_p < world
    for rank, stock, hzp in _arms(launched, name):
        assert stock["error"] is None and hzp["error"] is None, (stock["error"], hzp["error"])
        assert stock["optimizer"] == hzp["optimizer"] == "DeepSpeedZeRoOffload"
        # Two forwards, the second after the first has left the hierarchical copies behind: what a gather (or a
        # corrupted partition) gives shows in the loss, bit for bit. (Nothing steps here, so the parameters'
        # change is not a check.)
        assert len(stock["forward"]) == 2 and hzp["forward"] == stock["forward"], (stock["forward"], hzp["forward"])
        assert stock["hpz"] == 1 and hzp["hpz"] == (d_p if hierarchical else 1)
        if not hierarchical:
            continue
        assert all(b > 0 for b in stock["forward_gathers_inter_node"]), stock["forward_gathers_inter_node"]
        assert hzp["forward_gathers_inter_node"] == [0.0, 0.0], hzp["forward_gathers_inter_node"]


def test_a_zero_init_model_keeps_stocks_partitioning_where_a_copy_would_move_or_miss_it(monkeypatch):
    """Parameters zero.Init partitioned get hpZ's copy only where the conversion keeps their partitions as they are:
    all of them over the world, none on NVMe, and each where the engine's offload_param puts partitions."""
    from types import SimpleNamespace

    import torch

    from ds_asynchzp.platform import deepspeed_internals as internals

    world_group, node_group = object(), object()
    monkeypatch.setattr(internals.ds_comm, "get_world_size", lambda group=None: 2 if group is node_group else 4)

    def param(group=world_group, swapper=None):
        return SimpleNamespace(ds_id=0, ds_process_group=group, nvme_swapper=swapper, ds_tensor=torch.zeros(1))

    assert internals.hierarchical_copy_refusal([param(), param()], None) is None
    assert internals.hierarchical_copy_refusal([param(), param()], "cpu") is None   # CPU ranks: host memory
    assert "other than the world" in internals.hierarchical_copy_refusal([param(), param(node_group)], None)
    assert "other than the world" in internals.hierarchical_copy_refusal([param(), torch.nn.Parameter()], None)
    assert "NVMe" in internals.hierarchical_copy_refusal([param(swapper=object())], None)
    assert "NVMe" in internals.hierarchical_copy_refusal([param()], "nvme")
    monkeypatch.setattr("deepspeed.accelerator.get_accelerator",
                        lambda: SimpleNamespace(device_name=lambda: "cuda"))
    assert "would move them" in internals.hierarchical_copy_refusal([param()], None)   # host partitions, on GPUs
    assert internals.hierarchical_copy_refusal([param()], "cpu") is None


def test_offload_states_is_refused_by_name(launched):
    for rank, _, hzp in _arms(launched, "offload_states_refused"):
        assert hzp["error"] is not None and hzp["error"].startswith("NotImplementedError"), hzp["error"]
        assert "async_hzp" in hzp["error"]
