"""DeepSpeed's private names on the optimizer-offload path (`offload_optimizer: {"device": "cpu"}`): Stage 3's
per-parameter host gradients and norms, and DeepSpeedCPUAdam's C++ update, which the host step in pieces cuts.
Part of `deepspeed_internals`, the one place private DeepSpeed names are touched; the Stage 3 attributes these read
are checked when the optimizer is built (`check_stage3_instance`), the rest where they are first used."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from ...errors import DeepSpeedInternalsError


def offload_grad_norm(optimizer: DeepSpeedZeroOptimizer_Stage3, param, grad) -> None:
    """The first half of Stage 3's boundary copy: the norm of one parameter's reduced gradient partition, which
    the offload path's clipping sums (`complete_grad_norm_calculation_for_cpu_offload`)."""
    optimizer.norm_for_param_grads[optimizer.get_param_id(param)] = optimizer._constant_buffered_norm2(grad)


def offload_grad_norms(optimizer: DeepSpeedZeroOptimizer_Stage3) -> list:
    """The per-parameter gradient norms recorded this window (device tensors the step reads, then forgets)."""
    return list(optimizer.norm_for_param_grads.values())


def offload_host_grad(optimizer: DeepSpeedZeroOptimizer_Stage3, param):
    """The host optimizer's fp32 gradient elements of one parameter's partition (a view into its sub-group's)."""
    group, offset, numel = optimizer.grad_position[optimizer.get_param_id(param)]
    return optimizer.fp32_partitioned_groups_flat[group].grad.narrow(0, offset, numel)


def offload_reduced_since_step(optimizer: DeepSpeedZeroOptimizer_Stage3) -> set:
    """The ids of the parameters reduced since the last step: what Stage 3's unmanaged offload boundary copies
    (its `partition_grads` records them; the hierarchical one replaces that and records them itself)."""
    return optimizer._offload_boundary_param_ids


# DeepSpeedCPUAdam's member a host step in pieces swaps (`cpu_adam_update_in_pieces`), and Stage 3's (set under offload
# only), checked where they are first used.
_CPU_ADAM_MEMBERS = ("ds_opt_adam",)
_STAGE3_OFFLOAD_MEMBERS = ("subgroup_to_device", "torch_autocast_gradscaler", "zenflow", "loss_scale", "clip_grad",
                           "fp32_partitioned_groups_flat")


def host_step_in_pieces_refusal(optimizer: DeepSpeedZeroOptimizer_Stage3, sub_group_id: int) -> str | None:
    """Why Stage 3's host step of a sub-group cannot be taken piece by piece (`cpu_adam_update_in_pieces`); None when
    it can: DeepSpeedCPUAdam on the host, none of the paths that wrap or replace its step."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    host = optimizer.optimizer
    if type(host) is not DeepSpeedCPUAdam:
        return f"the host optimizer is {type(host).__name__}, not DeepSpeedCPUAdam"
    missing = ([f"DeepSpeedCPUAdam.{m}" for m in _CPU_ADAM_MEMBERS if not hasattr(host, m)]
               + [f"DeepSpeedZeroOptimizer_Stage3.{m}" for m in _STAGE3_OFFLOAD_MEMBERS if not hasattr(optimizer, m)])
    if missing:
        raise DeepSpeedInternalsError("ds_asynchzp cannot use the installed DeepSpeed: " + ", ".join(missing)
                                      + " no longer set (the host step in pieces, async_hzp.offload_pipeline)")
    if optimizer.subgroup_to_device[sub_group_id] != "cpu":
        return "offload_optimizer.ratio keeps this sub-group's step on the device"
    if optimizer.torch_autocast_gradscaler or optimizer.zenflow:
        return "torch autocast's grad scaler or ZenFlow wraps the host step"
    return None


@contextlib.contextmanager
def cpu_adam_update_in_pieces(optimizer: DeepSpeedZeroOptimizer_Stage3, run_pieces: Callable) -> Iterator[None]:
    """Inside, Stage 3's host step of a sub-group runs as it is (`_optimizer_step` -> DeepSpeedCPUAdam.step: its
    state, step count, torch's step hooks), except that DeepSpeedCPUAdam's one call of its C++ update goes to
    `run_pieces(update)`, where `update(lo, hi)` runs that call on elements [lo, hi) of the sub-group. No call (a
    sub-group without gradient, which stock skips) leaves `run_pieces` uncalled.

    Every call passes the step's number: the C++ optimizer advances its bias corrections on the first and keeps
    them for the others (cpu_adam.h `IncrementStep`). An element stays on the path (vector body or scalar tail)
    the whole call gives it when every piece but the last starts and ends at a multiple of the vector width from
    the sub-group's start."""
    host = optimizer.optimizer
    op = host.ds_opt_adam

    class PiecewiseOp:
        def __getattr__(self, name):
            return getattr(op, name)

        @staticmethod
        def adam_update(*args):
            head, tensors = args[:-4], args[-4:]   # ..., params, grads, exp_avg, exp_avg_sq
            run_pieces(lambda lo, hi: op.adam_update(*head, *(t[lo:hi] for t in tensors)))

    host.ds_opt_adam = PiecewiseOp()
    try:
        yield
    finally:
        host.ds_opt_adam = op


def uses_muon(optimizer: DeepSpeedZeroOptimizer_Stage3) -> bool:
    """Whether Stage 3 orthogonalises gradients with Muon before its step (it reads the host gradients first)."""
    return bool(optimizer.use_muon)


def offload_master(optimizer: DeepSpeedZeroOptimizer_Stage3, sub_group_id: int):
    """A sub-group's fp32 master weights on the host (their `.grad`: the host gradients)."""
    return optimizer.fp32_partitioned_groups_flat[sub_group_id]


def stage3_unflatten_sub_group(optimizer: DeepSpeedZeroOptimizer_Stage3, sub_group_id: int) -> None:
    """The end of Stage 3's `_reassign_or_swap_out_partitioned_parameters` after its copy: each parameter's
    partition points at its piece of the sub-group's flat buffer."""
    optimizer._unflatten_partitioned_parameters(sub_group_id)
