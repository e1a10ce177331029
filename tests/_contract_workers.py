"""Rank-side code of tests/test_contract.py: stock ZeRO-3's contract where frameworks and user code touch it.

Each case runs one sequence of calls (backwards, zero_grad, steps, reads of Stage 3's gradient state, writes into
a partition, an engine without an optimizer) twice in the same processes, under stock ZeRO-3 and under AsyncHZP,
and reports what each arm saw: the weights after the sequence (a client SGD with lr 1, so a weight's change is the
gradient the step used), the values read, the warnings and the error. A case's `plant` is a defect planted in
AsyncHZP's arm (tests/_fuzz_workers.planted), to show that the comparison catches it.
"""

from __future__ import annotations

import datetime
import math
import os
import warnings

import deepspeed
import torch

import ds_asynchzp
from ds_asynchzp.comm import delay_injection
from ds_asynchzp.platform import ledger
from tests._fuzz_workers import planted

IN, HIDDEN = 8, 6


class Net(torch.nn.Module):
    """`b_uses`: how often the forward applies layer b (a layer used several times per forward); `checkpoint_b`:
    b's applications under activation checkpointing (non-reentrant); `b_in_a_container`: b inside a Sequential."""

    def __init__(self, b_uses: int = 1, checkpoint_b: bool = False, b_in_a_container: bool = False):
        super().__init__()
        self.a = torch.nn.Linear(IN, HIDDEN, bias=False)
        self.b = torch.nn.Linear(HIDDEN, HIDDEN, bias=True)
        if b_in_a_container:     # a container whose children run inside it: what leaf modules are for
            self.b = torch.nn.Sequential(self.b)
        self.c = torch.nn.Linear(HIDDEN, 1, bias=False)
        self.b_uses, self.checkpoint_b = b_uses, checkpoint_b

    def _b(self, h):
        if self.checkpoint_b:
            return torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=False)
        return torch.tanh(self.b(h))

    def forward(self, x, skip_b: bool = False, per_sample: bool = False):
        h = torch.tanh(self.a(x))
        if not skip_b:
            for _ in range(self.b_uses):
                h = self._b(h)
        out = self.c(h).pow(2)
        return out.view(-1) if per_sample else out.mean()


def _config(case: dict, arm: str) -> dict:
    zero = {"stage": 3} if case.get("default_knobs") else {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                             "reduce_bucket_size": 40}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": case.get("gas", 1),
              "zero_optimization": zero,
              "zero_allow_untested_optimizer": True, "gradient_clipping": case.get("clip", 0.0),
              "steps_per_print": 10**9}
    if case.get("unmanaged"):
        config["managed_gradient_accumulation"] = False
    if case.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        config["zero_force_ds_cpu_optimizer"] = False   # the client SGD steps the host master weights
    if arm == "hzp":
        config["async_hzp"] = dict(case["section"], log_layout=False)
    return config


def _batch(rank: int, k: int) -> torch.Tensor:
    return torch.randn(2, IN, generator=torch.Generator().manual_seed(1000 * k + rank))


def _full(engine) -> dict:
    values = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            values[name] = param.detach().clone()
    return values


def _global_grad_sq(engine, world: int) -> float:
    """The squared norm of the gradient Stage 3 holds, read through `averaged_gradients` (each rank its partitions;
    optimizer replicas hold equal copies, counted once)."""
    local = sum(float(g.float().pow(2).sum()) for group in engine.optimizer.averaged_gradients.values() for g in group
                if g is not None)
    total = torch.tensor([local], dtype=torch.float64)
    deepspeed.comm.all_reduce(total)
    optimizer = engine.optimizer
    d_o = optimizer.hzp_dense.family.layout.optimizer_shard_size if hasattr(optimizer, "hzp_dense") else world
    return float(total) / (world // d_o)


def _run_ops(engine, ops, rank: int, world: int, seen: dict) -> None:
    for op in ops:
        kind, *args = op
        if kind == "fb":
            engine.backward(engine(_batch(rank, args[0]), skip_b=len(args) > 1 and args[1] == "skip_b"))
        elif kind == "torch_backward":
            engine(_batch(rank, args[0])).backward()
        elif kind == "non_scalar_backward":
            out = engine(_batch(rank, args[0]), per_sample=True)
            out.backward(torch.full_like(out, 1.0 / out.numel()))
        elif kind == "eval_forward":
            engine.eval()
            with torch.no_grad():
                seen.setdefault("forward", []).append(float(engine(_batch(rank, args[0]))))
            engine.train()
        elif kind == "offload_states":
            engine.optimizer.offload_states()
        elif kind == "empty_partition_cache":
            engine.empty_partition_cache()
        elif kind == "b_requires_grad":
            for param in engine.module.b.parameters():
                param.requires_grad_(args[0])
        elif kind == "step":
            engine.step()
        elif kind == "optimizer_zero_grad":
            engine.optimizer.zero_grad(set_to_none=args[0] if args else True)
        elif kind == "engine_zero_grad":
            engine.zero_grad()
        elif kind == "boundary":
            engine.set_gradient_accumulation_boundary(args[0])
        elif kind == "read_averaged_gradients":
            seen.setdefault("grad_sq", []).append(_global_grad_sq(engine, world))
        elif kind == "read_norm_groups":
            norms = engine.optimizer._get_norm_groups()
            seen.setdefault("norm_groups", []).append(math.sqrt(sum(float(n) ** 2 for n in norms)))
        elif kind == "rebind_partition":
            for param in engine.module.parameters():
                param.ds_tensor.data = torch.full_like(param.ds_tensor, args[0])
        elif kind == "write_partition_in_place":
            for param in engine.module.parameters():
                param.ds_tensor.data.copy_(torch.full_like(param.ds_tensor, args[0]))
        elif kind == "forward_loss":
            # What the forward's parameter gathers sent between nodes (the ledger's ring model, per rank).
            mark = ledger.install().mark()
            with torch.no_grad():
                seen.setdefault("forward", []).append(float(engine(_batch(rank, args[0]))))
            gathers = ledger.summary(mark)["by_op"].get("all_gather", {})
            seen.setdefault("forward_gathers_inter_node", []).append(gathers.get("inter_node", 0.0))
        else:
            raise ValueError(f"unknown op {kind}")


def _arm(case: dict, arm: str, rank: int, world: int) -> dict:
    torch.manual_seed(7)
    if case.get("zero_init"):      # built partitioned, as from_pretrained under ZeRO-3 builds a model
        with deepspeed.zero.Init(config_dict_or_path=_config(case, arm)):
            model = Net()
    else:
        model = Net(case.get("b_uses", 1), case.get("checkpoint_b", False), case.get("leaf_b", False))
    if case.get("leaf_b"):
        deepspeed.utils.set_z3_leaf_modules(model, [torch.nn.Sequential])
    optimizer = None if case.get("no_optimizer") else torch.optim.SGD(model.parameters(), lr=1.0)
    seen: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = ds_asynchzp.initialize(model=model, optimizer=optimizer, config=_config(case, arm))
        seen["optimizer"] = type(engine.optimizer).__name__
        seen["hpz"] = engine.zero_hpz_partition_size()
        before = _full(engine)
        try:
            _run_ops(engine, case["ops"], rank, world, seen)
            seen["error"] = None
        except Exception as error:  # the case says which error it expects
            seen["error"] = f"{type(error).__name__}: {error}"
        if seen["error"] is None:
            after = _full(engine)
            seen["delta"] = {n: (before[n] - after[n]).flatten().tolist() for n in before}
        engine.destroy()
    seen["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                        and "async_hzp" not in str(w.filename) and ("window" in str(w.message)
                                                                    or "zero_grad" in str(w.message)
                                                                    or "offload_optimizer" in str(w.message))]
    return seen


def run_contract(payload: dict) -> dict:
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=240))
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    results = {}
    for case in payload["cases"]:
        os.environ["DS_ASYNCHZP_COMM_DELAY_MS"] = case.get("comm_delay", "")
        delay_injection.reset()
        results[case["name"]] = {}
        for arm in ("stock", "hzp"):
            # A case's planted defect (tests/_fuzz_workers.planted) applies to AsyncHZP only.
            with planted(case.get("plant", "") if arm == "hzp" else ""):
                results[case["name"]][arm] = _arm(case, arm, rank, world)
        print(f"case {case['name']} done", flush=True)
        deepspeed.comm.barrier()
    return results
