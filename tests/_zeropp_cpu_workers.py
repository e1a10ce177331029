"""Rank-side code of tests/test_zeropp_cpu.py: unchanged stock ZeRO++ (qgZ's all_to_all_quant_reduce, qwZ's
quantized all-gather, a short hpZ + qwZ + qgZ training) on CPU ranks, with the package's quantizer installed."""

from __future__ import annotations

import datetime
import time

import deepspeed
import torch

from ds_asynchzp.bench.data import batch_for
from ds_asynchzp.models.gpt import build_model
from ds_asynchzp.platform.deepspeed_internals import install_cpu_zeropp_quantizer


def _rank_tensor(rank: int, shape, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(*shape, generator=generator)


def _qgz_checks(rank: int, world: int, node_size: int) -> dict:
    """Stock qgZ against the exact sum, and against stock reduce_scatter_coalesced's mean."""
    from deepspeed.runtime.comm.coalesced_collectives import all_to_all_quant_reduce, reduce_scatter_coalesced
    from deepspeed.utils import groups

    all_to_all_groups = groups._get_local_all_to_all_group()
    shape = (256, 64)
    grad = _rank_tensor(rank, shape, seed=1)
    qgz_raw = all_to_all_quant_reduce([grad.clone()], all_to_all_groups)[0]
    qgz = qgz_raw.float()
    mean = reduce_scatter_coalesced([grad.clone()])[0].float()       # divides its input in place
    total = sum(_rank_tensor(r, shape, seed=1) for r in range(world)).reshape(-1)
    shard = total[rank * total.numel() // world:(rank + 1) * total.numel() // world]
    nodes = world // node_size
    exact = shard / nodes                                             # what qgZ computes, before quantization
    # The same gradient on every rank, on int4's grid (s * {-8..7}, each row - a quantization group - holding -8s,
    # s a power of two): every quantization is exact, so the factor over the mean is exact too.
    steps = torch.randint(-8, 8, shape, generator=torch.Generator().manual_seed(5)).float()
    steps[:, 0] = -8
    on_grid = steps * 2.0 ** -6
    grid_qgz = all_to_all_quant_reduce([on_grid.clone()], all_to_all_groups)[0].float()
    grid_mean = reduce_scatter_coalesced([on_grid.clone()])[0].float()
    return {
        "grid_exact_mean": bool(torch.equal(grid_mean, on_grid.reshape(-1).chunk(world)[rank])),
        "grid_qgz_over_mean": float((grid_qgz * grid_mean).sum() / (grid_mean * grid_mean).sum()),
        "grid_qgz_is_d_times_mean": bool(torch.equal(grid_qgz, node_size * grid_mean)),
        "qgz_dtype": str(qgz_raw.dtype),
        "qgz_numel": qgz.numel(),
        "qgz_rel_err": float((qgz - exact).norm() / exact.norm()),
        "mean_rel_err": float((mean - shard / world).norm() / (shard / world).norm()),
        # qgZ's shard over reduce_scatter's mean, by least squares: D (ranks per node) if qgZ sums per node.
        "qgz_over_mean": float((qgz * mean).sum() / (mean * mean).sum()),
    }


def _qwz_gather_check(rank: int, world: int) -> dict:
    """Stock qwZ: zero.Init with zero_quantized_weights, then a parameter's quantized all-gather."""
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "zero_quantized_weights": True}}
    torch.manual_seed(3)
    reference = torch.nn.Linear(32, 64)
    torch.manual_seed(3)
    with deepspeed.zero.Init(config_dict_or_path=config):
        layer = torch.nn.Linear(32, 64)
    params = [layer.weight, layer.bias]
    handle = params[0].all_gather_coalesced(params, quantize=True)
    handle.wait()
    result = {"quantizer": type(params[0].ds_tensor).__name__}
    for name, param, original in (("weight", layer.weight, reference.weight), ("bias", layer.bias, reference.bias)):
        gathered = param.data.detach().float().clone()
        result[name] = {"shape": list(gathered.shape), "max_abs_err": float((gathered - original).abs().max()),
                        "absmax": float(original.abs().max()), "exact": bool(torch.equal(gathered, original))}
    layer.weight.partition()
    layer.bias.partition()
    return result


def _train(config: dict, steps: int, gas: int, rank: int, world: int) -> list:
    torch.manual_seed(7)
    model = build_model("tiny", seed=7)
    trainable = [p for p in model.parameters() if p.requires_grad]
    # torch's AdamW: no JIT-built op to load in every rank (ZeRO-3 supports it).
    optimizer = torch.optim.AdamW(trainable, lr=3e-3, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, optimizer=optimizer, config=config)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(gas):
            x, y = batch_for(step, micro, rank, world, 2, 32, seed=11)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / gas)
    engine.destroy()
    return losses


def _ds_config(gas: int, zero_extra: dict) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_model_persistence_threshold": 0,
            "reduce_bucket_size": 20000, "overlap_comm": False, **zero_extra}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
            "zero_optimization": zero, "steps_per_print": 10**9}


def run_zeropp(payload: dict) -> dict:
    started = time.perf_counter()
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=240))
    installed = install_cpu_zeropp_quantizer()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    node_size = payload["node_size"]
    seconds = {"init": time.perf_counter() - started}
    result = {"rank": rank, "installed": installed, "qgz": _qgz_checks(rank, world, node_size),
              "qwz": _qwz_gather_check(rank, world), "seconds": seconds}
    seconds["collectives"] = time.perf_counter() - started - seconds["init"]
    if not payload.get("steps"):
        return result
    steps, gas = payload["steps"], payload["gas"]
    mark = time.perf_counter()
    result["zero3_losses"] = _train(_ds_config(gas, {}), steps, gas, rank, world)
    seconds["zero3"], mark = time.perf_counter() - mark, time.perf_counter()
    zeropp = {"zero_hpz_partition_size": node_size, "zero_quantized_weights": True, "zero_quantized_gradients": True}
    result["zeropp_losses"] = _train(_ds_config(gas, zeropp), steps, gas, rank, world)
    seconds["zeropp"] = time.perf_counter() - mark
    deepspeed.comm.barrier()
    return result
