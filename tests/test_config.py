"""The async_hzp ds_config section: parsing, validation, layout resolution, sizing.

Pure Python: no process group is ever created; every rejection is also
checked to leave torch.distributed uninitialized.
"""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from ds_asynchzp import schema
from ds_asynchzp.formulas import sizing
from ds_asynchzp.config import (
    AsyncHZPConfig,
    AsyncHZPConfigError,
    ResolvedLayout,
    resolve_layout,
    section_from_ds_config,
)
from ds_asynchzp.resolved_layout import LayoutSizes, Scheduling

GIB = sizing.BYTES_PER_GB
PSI = 1_000_000_000  # divisible by every world size used below, i.e. already "padded"

BASE = {
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {"stage": 3},
    "async_hzp": {},
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    # The launcher's variables must not leak into the node_size defaults under test.
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)


def make(hzp=None, zero=None, drop=(), **top):
    """BASE with the async_hzp section / zero_optimization keys / top-level keys replaced."""
    cfg = copy.deepcopy(BASE)
    if hzp is not None:
        cfg["async_hzp"] = hzp
    cfg["zero_optimization"].update(zero or {})
    cfg.update(top)
    for path in drop:
        *parents, leaf = path.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        del node[leaf]
    return cfg


# ---------------------------------------------------------------- schema


def test_checked_in_schema_matches_model():
    assert schema.SCHEMA_PATH.read_text() == schema.render_schema()
    assert json.loads(schema.SCHEMA_PATH.read_text()) == AsyncHZPConfig.model_json_schema()
    assert schema.main(["--check"]) == 0


def test_schema_check_detects_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "async_hzp.schema.json"
    stale.write_text("{}\n")
    monkeypatch.setattr(schema, "SCHEMA_PATH", stale)
    assert schema.main(["--check"]) == 1
    assert "python -m ds_asynchzp.schema" in capsys.readouterr().out
    assert schema.main([]) == 0
    assert stale.read_text() == schema.render_schema()


# ---------------------------------------------------------------- rejections

# (id, ds_config, world, local_world_size, env, resolve kwargs, key that the message must name)
BAD = [
    ("unknown-key", make({"param_shard": 2}), 8, 4, {}, {}, "async_hzp.param_shard"),
    ("section-not-object", make(hzp=[]), 8, 4, {}, {}, "async_hzp"),
    ("enabled-string", make({"enabled": "yes"}), 8, 4, {}, {}, "async_hzp.enabled"),
    ("node-size-string", make({"node_size": "4"}), 8, 4, {}, {}, "async_hzp.node_size"),
    ("node-size-zero", make({"node_size": 0}), 8, 4, {}, {}, "async_hzp.node_size"),
    ("param-zero", make({"param_shard_size": 0}), 8, 4, {}, {}, "async_hzp.param_shard_size"),
    ("param-bool", make({"param_shard_size": True}), 8, 4, {}, {}, "async_hzp.param_shard_size"),
    ("param-AUTO", make({"param_shard_size": "AUTO"}), 8, 4, {}, {}, "async_hzp.param_shard_size"),
    ("grad-float", make({"grad_shard_size": 2.0}), 8, 4, {}, {}, "async_hzp.grad_shard_size"),
    ("optim-negative", make({"optimizer_shard_size": -1}), 8, 4, {}, {}, "async_hzp.optimizer_shard_size"),
    ("budget-zero", make({"memory_budget_gb": 0}), 8, 4, {}, {}, "async_hzp.memory_budget_gb"),
    ("budget-string", make({"memory_budget_gb": "lots"}), 8, 4, {}, {}, "async_hzp.memory_budget_gb"),
    ("intra-bw-zero", make({"intra_node_bandwidth_gbps": 0}), 8, 4, {}, {}, "async_hzp.intra_node_bandwidth_gbps"),
    ("inter-bw-string", make({"inter_node_bandwidth_gbps": "fast"}), 8, 4, {}, {},
     "async_hzp.inter_node_bandwidth_gbps"),
    ("log-layout-int", make({"log_layout": 1}), 8, 4, {}, {}, "async_hzp.log_layout"),
    ("stage-missing", make(drop=["zero_optimization.stage"]), 8, 4, {}, {}, "zero_optimization.stage"),
    ("stage-2", make(zero={"stage": 2}), 8, 4, {}, {}, "zero_optimization.stage"),
    ("no-zero-section", make(drop=["zero_optimization"]), 8, 4, {}, {}, "zero_optimization.stage"),
    ("hpz", make(zero={"zero_hpz_partition_size": 4}), 8, 4, {}, {}, "zero_optimization.zero_hpz_partition_size"),
    ("qgZ", make(zero={"zero_quantized_gradients": True}), 8, 4, {}, {}, "zero_optimization.zero_quantized_gradients"),
    ("qwZ", make(zero={"zero_quantized_weights": True}), 8, 4, {}, {}, "zero_optimization.zero_quantized_weights"),
    ("qwZ-nontrainable", make(zero={"zero_quantized_nontrainable_weights": True}), 8, 4, {}, {},
     "zero_optimization.zero_quantized_nontrainable_weights"),
    # Optimizer states on the host are taken (device "cpu"); every other offload is refused by name.
    ("offload-optim-nvme", make(zero={"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}), 8, 4, {}, {},
     "zero_optimization.offload_optimizer.device"),
    ("offload-optim-ratio", make(zero={"offload_optimizer": {"device": "cpu", "ratio": 0.5}}), 8, 4, {}, {},
     "zero_optimization.offload_optimizer.ratio"),
    ("zenflow", make(zero={"offload_optimizer": {"device": "cpu"}, "zenflow": {"topk_ratio": 0.1}}), 8, 4, {}, {},
     "zero_optimization.zenflow"),
    ("offload-param", make(zero={"offload_param": {"device": "nvme"}}), 8, 4, {}, {},
     "zero_optimization.offload_param.device"),
    ("offload-param-cpu", make(zero={"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}),
     8, 4, {}, {}, "zero_optimization.offload_param.device"),
    ("cpu-offload-legacy", make(zero={"cpu_offload": True}), 8, 4, {}, {}, "zero_optimization.cpu_offload"),
    # DeepSpeed 0.19.8 builds SuperOffloadOptimizer_Stage3 from this flag whatever the offload device.
    ("super-offload", make(zero={"offload_optimizer": {"device": "none", "super_offload": True}}), 8, 4, {}, {},
     "zero_optimization.offload_optimizer.super_offload"),
    ("super-offload-top-level", make(zero={"super_offload": True}), 8, 4, {}, {}, "zero_optimization.super_offload"),
    ("mics", make(zero={"mics_shard_size": 4}), 8, 4, {}, {}, "zero_optimization.mics_shard_size"),
    ("autotp", make(tensor_parallel={"autotp_size": 2}), 8, 4, {}, {}, "tensor_parallel.autotp_size"),
    ("expert-tensor-parallel", make(expert_parallel={"enabled": True, "autoep_size": 2,
                                                     "expert_tensor_parallel_size": 2}), 8, 4, {}, {},
     "expert_parallel.expert_tensor_parallel_size"),
    ("deepcompile", make(compile={"deepcompile": True}), 8, 4, {}, {}, "compile.deepcompile"),
    ("node-size-unknown", make(), 8, None, {}, {}, "async_hzp.node_size"),
    ("node-size-env-garbage", make(), 8, None, {"LOCAL_WORLD_SIZE": "four"}, {}, "async_hzp.node_size"),
    ("node-size-not-dividing", make({"node_size": 3}), 8, None, {}, {}, "async_hzp.node_size"),
    ("node-size-above-world", make(), 4, 8, {}, {}, "async_hzp.node_size"),
    ("node-size-vs-local-world-size", make({"node_size": 2}), 8, 4, {}, {}, "async_hzp.node_size"),
    ("node-size-vs-env", make({"node_size": 2}), 8, None, {"LOCAL_WORLD_SIZE": "4"}, {}, "async_hzp.node_size"),
    ("node-size-vs-env-local-size", make({"node_size": 4}), 8, None, {"LOCAL_SIZE": "2"}, {}, "async_hzp.node_size"),
    ("param-not-dividing-node", make({"param_shard_size": 3}), 8, 4, {}, {}, "async_hzp.param_shard_size"),
    ("param-spans-nodes", make({"param_shard_size": 8}), 8, 4, {}, {}, "async_hzp.param_shard_size"),
    ("grad-below-param", make({"param_shard_size": 4, "grad_shard_size": 2}), 8, 4, {}, {},
     "async_hzp.grad_shard_size"),
    ("grad-partial-nodes", make({"param_shard_size": 2, "grad_shard_size": 6}), 12, 4, {}, {},
     "async_hzp.grad_shard_size"),
    ("grad-above-world", make({"grad_shard_size": 16}), 8, 4, {}, {}, "async_hzp.grad_shard_size"),
    ("optim-below-grad", make({"param_shard_size": 2, "grad_shard_size": 4, "optimizer_shard_size": 2}), 8, 4, {}, {},
     "async_hzp.optimizer_shard_size"),
    ("optim-not-dividing-world", make({"optimizer_shard_size": 12}), 8, 4, {}, {}, "async_hzp.optimizer_shard_size"),
    ("optim-not-multiple-of-grad", make({"param_shard_size": 2, "grad_shard_size": 4, "optimizer_shard_size": 6}),
     12, 4, {}, {}, "async_hzp.optimizer_shard_size"),
    ("auto-without-model", make({"param_shard_size": "auto"}), 8, 4, {}, {}, "async_hzp.param_shard_size"),
    ("auto-grad-without-model", make({"grad_shard_size": "auto"}), 8, 4, {}, {}, "async_hzp.grad_shard_size"),
    ("auto-optim-without-model", make({"optimizer_shard_size": "auto"}), 8, 4, {}, {},
     "async_hzp.optimizer_shard_size"),
    ("auto-with-impossible-fixed-param", make({"param_shard_size": 3, "grad_shard_size": "auto"}), 8, 4, {},
     {"num_parameters": PSI}, "async_hzp.param_shard_size"),
    ("auto-with-impossible-fixed-optim", make({"param_shard_size": "auto", "optimizer_shard_size": 5}), 12, 4, {},
     {"num_parameters": PSI}, "async_hzp.optimizer_shard_size"),
    ("auto-budget-too-small", make({"param_shard_size": "auto", "optimizer_shard_size": "auto",
                                    "memory_budget_gb": 2}, bf16={"enabled": True}), 8, 4, {}, {"num_parameters": PSI},
     "async_hzp.memory_budget_gb"),
    ("auto-bad-grad-accum-dtype", make({"param_shard_size": "auto"}, data_types={"grad_accum_dtype": "int4"}), 8, 4,
     {}, {"num_parameters": PSI}, "data_types.grad_accum_dtype"),
    ("auto-bad-comm-dtype", make({"param_shard_size": "auto"}, communication_data_type="fp8"), 8, 4, {},
     {"num_parameters": PSI}, "communication_data_type"),
]


@pytest.mark.parametrize("cfg,world,local,env,kwargs,key", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_is_rejected_naming_the_key(monkeypatch, cfg, world, local, env, kwargs, key):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(AsyncHZPConfigError) as info:
        resolve_layout(cfg, world, local, **kwargs)
    message = str(info.value)
    assert key in message
    assert key in info.value.keys
    assert "Fix:" in message
    assert not dist.is_initialized()


def test_bad_cases_are_distinct_and_numerous():
    assert len(BAD) >= 24
    assert len({b[0] for b in BAD}) == len(BAD)


def test_independent_problems_are_reported_together():
    cfg = make(zero={"stage": 1, "zero_quantized_weights": True}, drop=["optimizer"],
               tensor_parallel={"autotp_size": 4}, compile={"deepcompile": True})
    with pytest.raises(AsyncHZPConfigError) as info:
        resolve_layout(cfg, 8, 4)
    assert set(info.value.keys) == {"zero_optimization.stage", "zero_optimization.zero_quantized_weights",
                                    "tensor_parallel.autotp_size", "compile.deepcompile"}
    assert not dist.is_initialized()


def test_an_unsharded_optimizer_is_refused_by_name():
    """d_o = 1 trained differently from stock ZeRO-3 in the differential fuzzer (reentrant activation
    checkpointing, small buckets, a parameter without a gradient in some windows): refused before any group."""
    with pytest.raises(AsyncHZPConfigError, match=r"optimizer_shard_size.*is 1.*one of 2, 4, 8"):
        resolve_layout(make({"param_shard_size": 1, "grad_shard_size": 1, "optimizer_shard_size": 1}), 8, 4)
    assert resolve_layout(make({"param_shard_size": 1, "grad_shard_size": 1, "optimizer_shard_size": 1}), 1,
                          1).sizes.optimizer_shard_size == 1   # one rank: nothing to shard


def test_messages_suggest_valid_values():
    with pytest.raises(AsyncHZPConfigError, match=r"nearest valid values 2 or 4") as info:
        resolve_layout(make({"node_size": 3}), 8, None)
    assert "8" in str(info.value)
    with pytest.raises(AsyncHZPConfigError, match=r"one of 1, 2, 4"):
        resolve_layout(make({"param_shard_size": 3}), 8, 4)
    # d_o: the divisors of the world that are multiples of d_g.
    with pytest.raises(AsyncHZPConfigError, match=r"world size 12 .*one of 4, 12\b"):
        resolve_layout(make({"param_shard_size": 2, "grad_shard_size": 4, "optimizer_shard_size": 6}), 12, 4)
    with pytest.raises(AsyncHZPConfigError, match=r"one of 4, 8\b"):
        resolve_layout(make({"optimizer_shard_size": 2}), 8, 4)
    with pytest.raises(AsyncHZPConfigError, match=r"did you mean async_hzp.param_shard_size"):
        section_from_ds_config(make({"param_shard_sise": 2}))
    # A fixed size next to "auto": the valid values given the other fixed sizes.
    with pytest.raises(AsyncHZPConfigError, match=r"optimizer_shard_size to one of 2, 3, 4, 6, 12, or to \"auto\""):
        resolve_layout(make({"param_shard_size": "auto", "optimizer_shard_size": 5}), 12, 4, num_parameters=PSI)
    with pytest.raises(AsyncHZPConfigError, match=r"grad_shard_size=8 .*param_shard_size to one of 1, 2, 4, or"):
        resolve_layout(make({"param_shard_size": 8, "grad_shard_size": 8, "optimizer_shard_size": "auto"}), 16, 4,
                       num_parameters=PSI)


def test_disagreeing_environment_is_settled_by_the_config(monkeypatch):
    # Accelerate on CPU ranks rewrites LOCAL_WORLD_SIZE (to 1) where the deepspeed launcher set LOCAL_SIZE.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_SIZE", "4")
    with pytest.warns(RuntimeWarning, match=r"LOCAL_WORLD_SIZE=1, LOCAL_SIZE=4.*set async_hzp.node_size"):
        assert resolve_layout(make(), 8, None).sizes.node_size == 1
    assert resolve_layout(make({"node_size": 4}), 8, None).sizes.node_size == 4   # names one of them: accepted
    with pytest.raises(AsyncHZPConfigError, match=r"LOCAL_WORLD_SIZE=1, LOCAL_SIZE=4"):
        resolve_layout(make({"node_size": 2}), 8, None)


def test_node_size_mismatch_names_both_values_and_the_fix(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(AsyncHZPConfigError) as info:
        resolve_layout(make({"node_size": 4}), 16, None)
    message = str(info.value)
    assert "is 4" in message and "LOCAL_WORLD_SIZE=8" in message
    assert "set async_hzp.node_size to 8 or remove it" in message
    with pytest.raises(AsyncHZPConfigError, match=r"is 4, but the launcher reports 2 .*local_world_size=2"):
        resolve_layout(make({"node_size": 4}), 16, 2)
    # Agreement (and no environment at all) is fine.
    assert resolve_layout(make({"node_size": 8}), 16, 8).sizes.node_size == 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert resolve_layout(make({"node_size": 4}), 16, None).sizes.node_size == 4


def test_supported_neighbours_of_rejected_keys_pass():
    """The rejections look at the value, not the key's presence: off values and reduce_scatter: false pass."""
    cfg = make(zero={"reduce_scatter": False, "zero_quantized_nontrainable_weights": False,
                     "offload_optimizer": {"device": "none", "super_offload": False}},
               tensor_parallel={"autotp_size": 1}, expert_parallel={"enabled": False}, compile={"deepcompile": False})
    layout = resolve_layout(cfg, 8, 4)
    assert (layout.sizes.param_shard_size, layout.sizes.grad_shard_size, layout.sizes.optimizer_shard_size) == (4, 4, 8)


# ---------------------------------------------------------------- good layouts

GOOD = [
    ("defaults", make(), 8, 4, {}, {}, (4, 4, 8)),
    ("explicit", make({"param_shard_size": 2, "grad_shard_size": 4}), 8, 4, {}, {}, (2, 4, 8)),
    ("grad-defaults-to-param", make({"param_shard_size": 2}), 8, 4, {}, {}, (2, 2, 8)),
    ("grad-spans-nodes", make({"param_shard_size": 2, "grad_shard_size": 8}), 16, 4, {}, {}, (2, 8, 16)),
    ("optimizer-explicit-world", make({"optimizer_shard_size": 8}), 8, 4, {}, {}, (4, 4, 8)),
    ("optimizer-inside-node", make({"param_shard_size": 2, "grad_shard_size": 4, "optimizer_shard_size": 4}), 8, 4,
     {}, {}, (2, 4, 4)),
    ("optimizer-equals-param", make({"param_shard_size": 2, "optimizer_shard_size": 2}), 8, 4, {}, {}, (2, 2, 2)),
    ("optimizer-spans-part-of-world", make({"param_shard_size": 2, "grad_shard_size": 4, "optimizer_shard_size": 8}),
     16, 4, {}, {}, (2, 4, 8)),
    ("optimizer-not-aligned-with-nodes", make({"param_shard_size": 2, "optimizer_shard_size": 6}), 12, 4, {}, {},
     (2, 2, 6)),
    ("node-size-from-section", make({"node_size": 2}), 8, None, {}, {}, (2, 2, 8)),
    ("node-size-agrees-with-env", make({"node_size": 4}), 8, None, {"LOCAL_WORLD_SIZE": "4"}, {}, (4, 4, 8)),
    # LOCAL_WORLD_SIZE, when exported, overrides the LOCAL_SIZE the deepspeed launcher sets (emulated nodes).
    ("node-size-env-precedence", make({"node_size": 2}), 8, None, {"LOCAL_WORLD_SIZE": "2", "LOCAL_SIZE": "4"}, {},
     (2, 2, 8)),
    ("node-size-from-env", make(), 8, None, {"LOCAL_WORLD_SIZE": "4"}, {}, (4, 4, 8)),
    ("node-size-from-local-size", make(), 8, None, {"LOCAL_SIZE": "2"}, {}, (2, 2, 8)),
    ("single-rank", make(), 1, 1, {}, {}, (1, 1, 1)),
    ("client-optimizer", make(drop=["optimizer"]), 8, 4, {}, {"has_client_optimizer": True}, (4, 4, 8)),
    # No optimizer (a reference model's engine): accepted, with the parameter-only placement (runtime/api.py).
    ("no-optimizer", make(drop=["optimizer"]), 8, 4, {}, {}, (4, 4, 8)),
    ("harmless-zero-keys", make(zero={"zero_hpz_partition_size": 1, "offload_param": {"device": "none"}}), 8, 4, {}, {},
     (4, 4, 8)),
    ("reduce-scatter-false", make(zero={"reduce_scatter": False}), 8, 4, {}, {}, (4, 4, 8)),
    # HF's, LLaMA-Factory's and axolotl's ZeRO-3 offload configs: optimizer states on the host, pinned.
    ("offload-optimizer-cpu", make(zero={"offload_optimizer": {"device": "cpu", "pin_memory": True}}), 8, 4, {}, {},
     (4, 4, 8)),
    # "auto" (bf16, A = 1, default bandwidths 100 GB/s per rank's NVLink, 25 GB/s per NIC, one NIC per rank; see
    # test_auto_cost_table for the numbers): all three free and a generous budget: the cheapest layout. With one
    # micro-step, (1,8,8)'s two world rings (gradient reduce-scatter, refresh), spread over a node's 4 NICs, take
    # 0.0175 s each: less than (1,4,8)'s 0.0425 s.
    ("auto-all-generous", make({"param_shard_size": "auto", "grad_shard_size": "auto", "optimizer_shard_size": "auto",
                                "memory_budget_gb": 100}, bf16={"enabled": True}), 8, 4, {}, {"num_parameters": PSI},
     (1, 8, 8)),
    # Unset optimizer size stays at the world: only d_o = 8 layouts compete.
    ("auto-param-only", make({"param_shard_size": "auto", "memory_budget_gb": 100}, bf16={"enabled": True}), 8, 4, {},
     {"num_parameters": PSI}, (1, 8, 8)),
    # A fixed size constrains the search instead of being refused. With one micro-step a gradient group over the
    # world costs less (0.0525 s) than (2,4,4)'s reduce-scatter in the node and all-reduce between nodes (0.06 s).
    ("auto-with-fixed-param", make({"param_shard_size": 2, "grad_shard_size": "auto", "optimizer_shard_size": "auto",
                                    "memory_budget_gb": 100}, bf16={"enabled": True}), 8, 4, {},
     {"num_parameters": PSI}, (2, 8, 8)),
    # d_o = 2 and d_o = 4 both take 0.06 s; d_o = 4's links are busy for less in all (0.06 s against 0.0675 s).
    ("auto-optimizer-only", make({"param_shard_size": 2, "grad_shard_size": 2, "optimizer_shard_size": "auto",
                                  "memory_budget_gb": 100}, bf16={"enabled": True}), 8, 4, {},
     {"num_parameters": PSI}, (2, 2, 4)),
    # d_p = 4, d_g = 4: (4,4,8) and (4,4,4) tie (0.065 s; 4.5 GB per rank on NVLink, 0.5 GB per NIC); (4,4,8)
    # needs less memory.
    ("auto-tight", make({"param_shard_size": 4, "grad_shard_size": 4, "optimizer_shard_size": "auto",
                         "memory_budget_gb": 4}, bf16={"enabled": True}), 8, 4, {}, {"num_parameters": PSI},
     (4, 4, 8)),
    # 2.2 GiB: only (4,8,8) (2.25e9) fits.
    ("auto-only-one-fits", make({"grad_shard_size": "auto", "optimizer_shard_size": "auto", "memory_budget_gb": 2.2},
                                bf16={"enabled": True}), 8, 4, {}, {"num_parameters": PSI}, (4, 8, 8)),
    # More micro-steps weigh the per-micro-step flows: with A = 8 the replicated gradient shard wins.
    ("auto-grad-accumulation", make({"param_shard_size": "auto", "optimizer_shard_size": "auto", "memory_budget_gb": 100},
                                    bf16={"enabled": True}, gradient_accumulation_steps=8), 8, 4, {},
     {"num_parameters": PSI}, (1, 1, 4)),
    # The same from train_batch_size / (micro batch * world) = 64 / (1 * 8).
    ("auto-grad-accumulation-derived", make({"param_shard_size": "auto", "optimizer_shard_size": "auto",
                                             "memory_budget_gb": 100}, bf16={"enabled": True}, train_batch_size=64),
     8, 4, {}, {"num_parameters": PSI}, (1, 1, 4)),
    # Inter-node links as fast as NVLink: crossing nodes costs nothing extra, so the smallest-memory tie wins.
    ("auto-bandwidths", make({"param_shard_size": "auto", "optimizer_shard_size": "auto", "memory_budget_gb": 100,
                              "inter_node_bandwidth_gbps": 800}, bf16={"enabled": True}), 8, 4, {},
     {"num_parameters": PSI}, (1, 8, 8)),
]


@pytest.mark.parametrize("cfg,world,local,env,kwargs,expected", [g[1:] for g in GOOD], ids=[g[0] for g in GOOD])
def test_good_config_resolves(monkeypatch, cfg, world, local, env, kwargs, expected):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    layout = resolve_layout(cfg, world, local, **kwargs)
    assert isinstance(layout, ResolvedLayout)
    assert (layout.sizes.param_shard_size, layout.sizes.grad_shard_size, layout.sizes.optimizer_shard_size) == expected
    assert layout.sizes.world_size == world
    assert layout.sizes.num_nodes * layout.sizes.node_size == world
    assert (layout.auto_reason is not None) == ("auto" in json.dumps(cfg["async_hzp"]))
    assert not dist.is_initialized()


@pytest.mark.parametrize("zero, depth", [({}, 2), ({"stage3_prefetch_bucket_size": 0}, 0),
                                         ({"prefetch_bucket_size": 0}, 0), ({"stage3_prefetch_bucket_size": "auto"}, 2),
                                         ({"stage3_prefetch_bucket_size": 5e7}, 2)])
def test_prefetch_depth_follows_deepspeeds_prefetch_switch_by_either_name(zero, depth):
    from ds_asynchzp.config import resolve_prefetch_depth
    assert resolve_prefetch_depth(AsyncHZPConfig(), {"zero_optimization": zero}) == depth
    assert resolve_prefetch_depth(AsyncHZPConfig(prefetch_depth=1), {"zero_optimization": zero}) == 1


def test_comm_timeout_defaults_to_deepspeeds_process_group_timeout(monkeypatch):
    """The section's value, else the default process group's timeout (what init_distributed was given), else
    DeepSpeed's default: DEEPSPEED_TIMEOUT minutes, else 10 minutes (deepspeed/constants.py)."""
    import datetime

    from deepspeed import constants

    monkeypatch.delenv("DEEPSPEED_TIMEOUT", raising=False)
    assert constants.default_pg_timeout == datetime.timedelta(minutes=10), "DeepSpeed's default moved"

    def scheduling(section: dict, group_timeout=None):
        s = resolve_layout(make(section), 8, 4, process_group_timeout_s=group_timeout).scheduling
        return s.comm_timeout_s, s.comm_timeout_source

    assert scheduling({}) == (600.0, "DeepSpeed's default")
    assert scheduling({}, 1800.0) == (1800.0, "the default process group's, as initialized")
    assert scheduling({"comm_timeout_s": 45}, 1800.0) == (45.0, "async_hzp.comm_timeout_s")
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "25")
    assert scheduling({}) == (1500.0, "DeepSpeed's default, DEEPSPEED_TIMEOUT minutes")
    assert "collectives time out after 1500 s" in resolve_layout(make({}), 8, 4).describe()


def test_the_default_process_groups_timeout_is_read(tmp_path):
    """What the runtime passes as the default: the timeout torch.distributed.init_process_group was given."""
    code = ("import datetime, os, torch.distributed as dist\n"
            "from ds_asynchzp.platform.deepspeed_internals import default_group_timeout_s\n"
            "assert default_group_timeout_s() is None\n"
            "dist.init_process_group('gloo', init_method='file://' + os.environ['STORE'], rank=0, world_size=1,\n"
            "                        timeout=datetime.timedelta(seconds=1234))\n"
            "print(default_group_timeout_s())\n"
            "dist.destroy_process_group()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "STORE": str(tmp_path / "store"), "DS_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "1234.0"


def test_scheduling_keys_resolve_and_bad_values_name_the_key():
    layout = resolve_layout(make({"async_comm": False, "prefetch_depth": 0, "boundary_bucket_size": 1000,
                                  "comm_timeout_s": 30}), 8, 4)
    assert layout.scheduling == Scheduling(async_comm=False, prefetch_depth=0, boundary_bucket_size=1000,
                                           comm_timeout_s=30.0, comm_timeout_source="async_hzp.comm_timeout_s")
    assert "communication synchronous" in layout.describe()
    assert "collectives time out after 30 s (async_hzp.comm_timeout_s)" in layout.describe()
    for key, value in (("async_comm", "yes"), ("prefetch_depth", -1), ("boundary_bucket_size", 0),
                       ("comm_timeout_s", 0)):
        with pytest.raises(AsyncHZPConfigError) as info:
            resolve_layout(make({key: value}), 8, 4)
        assert f"async_hzp.{key}" in str(info.value), str(info.value)


def test_quantization_keys_resolve_to_the_engine_plan():
    layout = resolve_layout(make({"quantize_cross_node": True, "gradient_quantization_bits": 4,
                                  "quantization_block_size": 256, "error_feedback": True}), 8, 4)
    plan = layout.quantization_plan()
    # d_p = d_g = 4 inside a node, d_o = 8 across both: only the once-per-step flows cross nodes.
    assert plan.param_gather is None and plan.grad_reduce_scatter is None and plan.boundary_allreduce is None
    assert (plan.boundary_grad.bits, plan.boundary_grad.block_size, plan.param_refresh.bits) == (4, 256, 8)
    assert plan.error_feedback
    assert "boundary_grad INT4, param_refresh INT8 (blocks of 256), with error feedback" in layout.describe()
    weights = resolve_layout(make({"quantized_weights": True, "quantized_gradients": True}), 8, 4)
    plan = weights.quantization_plan()
    assert plan.param_gather.bits == 8 and plan.grad_reduce_scatter.bits == plan.boundary_grad.bits == 8
    assert plan.param_refresh is None and not plan.error_feedback


@pytest.mark.parametrize("section, key", [
    ({"error_feedback": True}, "async_hzp.error_feedback"),
    ({"gradient_quantization_bits": 2}, "async_hzp.gradient_quantization_bits"),
    ({"quantization_block_size": 511}, "async_hzp.quantization_block_size"),
    ({"quantized_weights": "yes"}, "async_hzp.quantized_weights"),
])
def test_bad_quantization_keys_are_named(section, key):
    with pytest.raises(AsyncHZPConfigError) as info:
        resolve_layout(make(section), 8, 4)
    assert key in info.value.keys, str(info.value)


def test_layout_fields_description_and_dict():
    layout = resolve_layout(make(), 8, 4)
    assert layout == ResolvedLayout(LayoutSizes(world_size=8, node_size=4, param_shard_size=4, grad_shard_size=4,
                                                optimizer_shard_size=8))
    assert layout.auto_reason is None
    text = layout.describe()
    assert "\n" not in text and "world=8" in text and "2 node(s) x 4 ranks" in text
    assert "d_p=4 (2 replicas)" in text and "d_g=4 (2 replicas)" in text and "d_o=8 (1 replica)" in text
    assert layout.as_dict() == {"world_size": 8, "node_size": 4, "num_nodes": 2, "param_shard_size": 4,
                                "grad_shard_size": 4, "optimizer_shard_size": 8, "param_replicas": 2,
                                "grad_replicas": 2, "optimizer_replicas": 1, "auto_reason": None,
                                "async_comm": True, "prefetch_depth": 2, "quantized_weights": False,
                                "quantized_gradients": False, "quantize_cross_node": False,
                                "gradient_quantization_bits": 8, "quantization_block_size": 512,
                                "error_feedback": False, "quantization": "no quantized communication",
                                "sequence_parallel_size": 1}
    assert "background threads (prefetch depth 2)" in text and "quantized" not in text
    json.dumps(layout.as_dict())
    inner = resolve_layout(make({"param_shard_size": 2, "grad_shard_size": 4, "optimizer_shard_size": 4}), 8, 4)
    assert "d_o=4 (2 replicas)" in inner.describe()


def test_auto_reason_names_the_numbers_and_reaches_describe():
    cfg = make({"param_shard_size": 4, "grad_shard_size": "auto", "optimizer_shard_size": "auto",
                "memory_budget_gb": 3}, bf16={"enabled": True})
    layout = resolve_layout(cfg, 8, 4, num_parameters=PSI)
    # 3 GiB, d_p = 4: (4,8,8) needs 2.25e9 bytes and 0.0575 s (gathers 0.03 s in the node, the world's
    # reduce-scatter and refresh 0.0175 s and 0.01 s on the NICs); the runner-up (4,4,8) 2.5e9 bytes and 0.065 s.
    assert (layout.sizes.param_shard_size, layout.sizes.grad_shard_size, layout.sizes.optimizer_shard_size) == (4, 8, 8)
    reason = layout.auto_reason
    assert "d_p=4, d_g=8, d_o=8" in reason and "of 3 valid layouts (2 fit the budget)" in reason
    assert "2.10 GiB per rank (budget 3.00 GiB)" in reason
    assert ("0.0575 s per optimizer step, each collective at its busiest link's pace (whole step: NIC 0.688 GB in "
            "0.0275 s, NVLink per rank 4.31 GB in 0.0431 s) vs 0.065 s for the runner-up d_p=4, d_g=4, d_o=8") in reason
    assert reason in layout.describe() and layout.as_dict()["auto_reason"] == reason
    # A tie on both links goes to the smaller memory, and the reason says so.
    tie = resolve_layout(make({"param_shard_size": 4, "grad_shard_size": 4, "optimizer_shard_size": "auto",
                               "memory_budget_gb": 4}, bf16={"enabled": True}), 8, 4, num_parameters=PSI).auto_reason
    assert "the same as the runner-up d_p=4, d_g=4, d_o=4, which needs 3.73 GiB per rank" in tie
    only = resolve_layout(make({"grad_shard_size": "auto", "optimizer_shard_size": "auto", "memory_budget_gb": 2.2},
                               bf16={"enabled": True}), 8, 4, num_parameters=PSI).auto_reason
    assert "no other layout fits" in only


def test_auto_reads_dtypes_steps_and_bandwidths_from_the_ds_config(monkeypatch):
    seen = {}
    real = sizing.choose_layout

    def spy(*args, **kwargs):
        seen.update(kwargs, budget=args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(sizing, "choose_layout", spy)
    cfg = make({"param_shard_size": "auto", "memory_budget_gb": 50, "intra_node_bandwidth_gbps": 1600,
                "inter_node_bandwidth_gbps": 400, "optimizer_shard_size": 8, "grad_shard_size": 4},
               bf16={"enabled": True}, gradient_accumulation_steps=3, communication_data_type="fp32",
               data_types={"grad_accum_dtype": "fp32"})
    resolve_layout(cfg, 8, 4, num_parameters=PSI)
    assert seen == {"param_bytes": 2, "grad_accum_bytes": 4, "grad_comm_bytes": 4, "grad_accum_steps": 3,
                    "intra_bw_bytes_s": 200e9, "inter_bw_bytes_s": 50e9, "budget": 50 * GIB,
                    "fixed": {"grad_shard_size": 4, "optimizer_shard_size": 8}, "nics_per_node": 4,
                    "reference_models": 0, "reference_copies": True}
    # Defaults: the model dtype everywhere (fp32 here), one micro-step, 800 / 200 Gbit/s.
    seen.clear()
    resolve_layout(make({"param_shard_size": "auto", "memory_budget_gb": 50}), 8, 4, num_parameters=PSI)
    assert {k: seen[k] for k in ("param_bytes", "grad_accum_bytes", "grad_comm_bytes", "grad_accum_steps",
                                 "intra_bw_bytes_s", "inter_bw_bytes_s")} == \
        {"param_bytes": 4, "grad_accum_bytes": 4, "grad_comm_bytes": 4, "grad_accum_steps": 1,
         "intra_bw_bytes_s": 100e9, "inter_bw_bytes_s": 25e9}
    # One NIC per node shared by its ranks, as a cloud instance has: "auto" places the bytes on it.
    seen.clear()
    resolve_layout(make({"param_shard_size": "auto", "memory_budget_gb": 50, "nics_per_node": 1}), 8, 4,
                   num_parameters=PSI)
    assert seen["nics_per_node"] == 1
    with pytest.raises(AsyncHZPConfigError, match="async_hzp.nics_per_node") as info:
        resolve_layout(make({"param_shard_size": 4, "nics_per_node": 5}), 8, 4)
    assert "between 1 and 4" in str(info.value)


def test_log_layout_flag_reaches_the_layout():
    assert resolve_layout(make(), 8, 4).log_layout is True
    assert resolve_layout(make({"log_layout": False, "param_shard_size": 2}), 8, 4).log_layout is False


def test_config_and_planner_start_without_deepspeed():
    """asynchzp-plan and config validation must not pay for (or depend on) DeepSpeed or the runtime."""
    code = ("import sys, ds_asynchzp.planner.cli, ds_asynchzp.config, ds_asynchzp.schema, "
            "ds_asynchzp.formulas.sizing, ds_asynchzp.formulas.traffic\n"
            "assert 'deepspeed' not in sys.modules, sorted(m for m in sys.modules if 'deepspeed' in m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[:2] in (['ds_asynchzp', 'runtime'], "
            "['ds_asynchzp', 'state'], ['ds_asynchzp', 'comm']))\n"
            "assert not bad, bad\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]


# ---------------------------------------------------------------- absent / disabled


@pytest.mark.parametrize("cfg", [make(drop=["async_hzp"]), make({"enabled": False}), make(hzp=None) | {"async_hzp": None}])
def test_absent_or_disabled_section_gives_none(cfg):
    assert section_from_ds_config(cfg) is None
    assert resolve_layout(cfg, 8, 4) is None


def test_disabled_section_skips_zero_checks_but_not_typos():
    assert resolve_layout(make({"enabled": False}, zero={"stage": 2}), 8, 4) is None
    with pytest.raises(AsyncHZPConfigError, match="async_hzp.bogus"):
        section_from_ds_config(make({"enabled": False, "bogus": 1}))


def test_section_defaults():
    section = section_from_ds_config(make())
    assert section == AsyncHZPConfig()
    assert section.enabled and section.log_layout and section.param_shard_size is None


# ---------------------------------------------------------------- JSON file input


def test_json_path_input(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(make({"param_shard_size": 2})))
    assert section_from_ds_config(str(path)).param_shard_size == 2
    assert section_from_ds_config(path).param_shard_size == 2
    layout = resolve_layout(str(path), 8, 4)
    assert (layout.sizes.param_shard_size, layout.sizes.grad_shard_size, layout.sizes.optimizer_shard_size) == (2, 2, 8)


def test_invalid_json_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"async_hzp": {,}')
    with pytest.raises(AsyncHZPConfigError, match="ds_config"):
        section_from_ds_config(path)
    assert not dist.is_initialized()


# ---------------------------------------------------------------- sizing


def test_sizing_worked_example():
    # Ψ = 1e9, world 8, params over 4 ranks, grads over 4, optimizer over 8, bf16 params and accumulation.
    got = sizing.model_state_bytes_per_rank(PSI, world=8, d_p=4, d_g=4, d_o=8)
    assert got == {
        "param_shard": 500_000_000,  # 2 B * 1e9 / 4 (DeepSpeed's partition is its own row: no extra copy)
        "grad_shard": 500_000_000,  # 2 B * 1e9 / 4 (DeepSpeed's gradient partition is its own row)
        "master": 500_000_000,  # 4 B * 1e9 / 8
        "optimizer_state": 1_000_000_000,  # 8 B * 1e9 / 8
        "total": 2_500_000_000,
    }
    # Frozen parameters count in the parameter shard only; fp32 accumulation doubles the gradient shard.
    mixed = sizing.model_state_bytes_per_rank(PSI, 8, 2, 4, 4, grad_accum_bytes=4, num_trainable=800_000_000)
    assert mixed == {"param_shard": 1_000_000_000, "grad_shard": 800_000_000, "master": 800_000_000,
                     "optimizer_state": 1_600_000_000, "total": 4_200_000_000}
    # Stock ZeRO-3 is the layout d_p = d_g = d_o = world: 16 bytes per parameter over the world.
    assert sizing.model_state_bytes_per_rank(PSI, 8, 8, 8, 8)["total"] == 16 * PSI // 8
    with pytest.raises(ValueError, match="num_trainable"):
        sizing.model_state_bytes_per_rank(10, 8, 1, 1, 8, num_trainable=11)


def test_valid_layouts_follow_the_rules():
    layouts = sizing.valid_layouts(8, 4)
    assert len(layouts) == 18     # d_o = 1 is refused on more than one rank
    for d_p, d_g, d_o in layouts:
        assert 4 % d_p == 0 and d_g % d_p == 0 and d_o % d_g == 0 and 8 % d_o == 0
        assert 4 % d_g == 0 or d_g % 4 == 0
    assert (4, 8, 8) in layouts and (1, 1, 1) not in layouts and (8, 8, 8) not in layouts
    assert sizing.valid_layouts(1, 1) == [(1, 1, 1)]
    # d_g = 6 in nodes of 4 spans one and a half nodes: never offered.
    assert all(d_g != 6 for _, d_g, _ in sizing.valid_layouts(12, 4))
    assert (2, 2, 6) in sizing.valid_layouts(12, 4)


def test_auto_cost_table():
    """The numbers behind the "auto" cases above, by hand (Ψ = 1e9 bf16, A = 1, NVLink 100 GB/s per rank, one
    25 GB/s NIC per rank, NCCL rings: a ring edge carries (k-1)/k of S, twice for an all-reduce; a node of a group
    spanning nodes sends one edge through its members' NICs, and each member (m-1)/m of an edge over NVLink; each
    collective takes its busiest link's time, one after another):
    (1,4,4): grad RS 2Ψ·3/4 on NVLink (0.015 s) + all-reduce of 2Ψ/4 between 2 nodes, 2·1/2·0.5Ψ on a NIC (0.02 s)
             + refresh 2Ψ·3/4 on NVLink (0.015 s) = 0.05 s; whole step NVLink 3Ψ, NIC 0.5Ψ;
    (1,4,8): RS 0.015 s + boundary exchange 2Ψ/4·1/2 on a NIC (0.01 s) + world refresh, edge 7/8·2Ψ: 1/4 of it
             per NIC (0.0175 s), 3/4 per rank on NVLink (0.013 s) = 0.0425 s; NVLink 2.8125Ψ, NIC 0.6875Ψ;
    (4,4,8): gathers 2·3/4·2Ψ on NVLink (0.03 s) + RS 0.015 s + boundary 0.01 s + refresh 2Ψ/4·1/2 on a NIC
             (0.01 s) = 0.065 s; NVLink 4.5Ψ, NIC 0.5Ψ."""
    kw = dict(param_bytes=2, grad_comm_bytes=2, grad_accum_steps=1, intra_bw_bytes_s=100e9, inter_bw_bytes_s=25e9)
    for lay, fabric, nic, bound in (((1, 4, 4), 3, 0.5, 0.05), ((1, 4, 8), 2.8125, 0.6875, 0.0425),
                                    ((4, 4, 8), 4.5, 0.5, 0.065)):
        seconds, moved = sizing.comm_seconds_per_step(PSI, 8, 4, *lay, **kw)
        assert moved["fabric_busiest"] == pytest.approx(fabric * PSI), lay
        assert moved["nic_busiest"] == pytest.approx(nic * PSI), lay
        assert seconds == pytest.approx(bound), lay
    # One NIC per node: the node's whole egress on it. (1,4,8): RS 0.015 s + four boundary exchanges 4·0.25Ψ
    # (0.04 s) + the refresh's edge 1.75Ψ (0.07 s) = 0.125 s; (1,4,4): 0.015 s + four all-reduces (one per local
    # index) 4·0.5Ψ (0.08 s) + 0.015 s = 0.11 s, now the cheaper.
    one_nic = {lay: sizing.comm_seconds_per_step(PSI, 8, 4, *lay, nics_per_node=1, **kw)[0]
               for lay in ((1, 4, 4), (1, 4, 8))}
    assert one_nic[(1, 4, 8)] == pytest.approx(0.125) and one_nic[(1, 4, 4)] == pytest.approx(0.11)


def test_choose_layout_picks_the_cheapest_fitting_layout():
    kw = dict(param_bytes=2, grad_accum_bytes=2, grad_comm_bytes=2, grad_accum_steps=1, intra_bw_bytes_s=100e9,
              inter_bw_bytes_s=25e9)
    for budget in (2.3e9, 3e9, 4.4e9, 6e9, 20e9):
        *chosen, reason = sizing.choose_layout(PSI, 8, 4, budget, **kw)
        # Brute force over every valid layout: fits, then least time on the busiest link, then least time of
        # both links, then least memory.
        def cost(lay):
            seconds, moved = sizing.comm_seconds_per_step(PSI, 8, 4, *lay, **{k: v for k, v in kw.items()
                                                                             if k != "grad_accum_bytes"})
            return round(seconds, 9), round(moved["nic_s"] + moved["fabric_s"], 9)

        best = min((*cost(lay), sizing.model_state_bytes_per_rank(PSI, 8, *lay)["total"], lay)
                   for lay in sizing.valid_layouts(8, 4)
                   if sizing.model_state_bytes_per_rank(PSI, 8, *lay)["total"] <= budget)
        assert tuple(chosen) == best[3], budget
        assert f"d_p={best[3][0]}, d_g={best[3][1]}, d_o={best[3][2]}" in reason
    assert tuple(sizing.choose_layout(PSI, 8, 4, 20e9, fixed={"optimizer_shard_size": 8}, **kw)[:3]) == (1, 8, 8)
    with pytest.raises(ValueError, match="fixed may only hold"):
        sizing.choose_layout(PSI, 8, 4, 20e9, fixed={"d_p": 2}, **kw)


def test_choose_layout_reports_the_bytes_needed_when_nothing_fits():
    with pytest.raises(AsyncHZPConfigError, match="async_hzp.memory_budget_gb") as info:
        sizing.choose_layout(PSI, 8, 4, 2_249_999_999)
    # The smallest-memory layout (4, 8, 8): 2/4 + 2/8 + 12/8 bytes per parameter.
    assert "2250000000 bytes" in str(info.value) and "d_p=4, d_g=8, d_o=8" in str(info.value)
    # The suggested budget is rounded up, so following the advice works.
    assert "at least 2.10" in str(info.value)
    assert sizing.choose_layout(PSI, 8, 4, 2.10 * GIB)[:3] == (4, 8, 8)
    assert sizing.smallest_memory_layout(PSI, 8, 4, fixed={"optimizer_shard_size": 4}) == (4, 4, 4, 4_000_000_000)


def test_sizing_helpers():
    assert sizing.divisors(12) == [1, 2, 3, 4, 6, 12]
    assert sizing.divisors(1) == [1]
    assert sizing.padded_num_params([10, 8, 1], multiple=4) == 12 + 8 + 4
    assert sizing.padded_num_params([10, 8, 1], 2) == 10 + 8 + 2
    assert sizing.default_budget_bytes(node_size=4) > 0


def test_auto_accounts_for_the_parameter_and_accumulation_dtypes():
    """fp32 parameters, or fp32 gradient accumulation under bf16, take more bytes: the same budget then needs
    another layout. 3.6 GiB ~ 3.87e9 fits bf16's (1,8,8) (3.75e9) but not with fp32 accumulation (4.0e9)."""
    hzp = {"param_shard_size": "auto", "optimizer_shard_size": "auto", "memory_budget_gb": 3.6}
    bf16 = resolve_layout(make(hzp, bf16={"enabled": True}), 8, 4, num_parameters=PSI)
    fp32 = resolve_layout(make(hzp), 8, 4, num_parameters=PSI)
    fp32_accum = resolve_layout(make(hzp, bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}), 8, 4,
                                num_parameters=PSI)
    assert (bf16.sizes.param_shard_size, bf16.sizes.grad_shard_size, bf16.sizes.optimizer_shard_size) == (1, 8, 8)
    for other, b, a in ((fp32, 4, 4), (fp32_accum, 2, 4)):
        chosen = (other.sizes.param_shard_size, other.sizes.grad_shard_size, other.sizes.optimizer_shard_size)
        assert chosen != (1, 8, 8)
        assert sizing.model_state_bytes_per_rank(PSI, 8, *chosen, param_bytes=b, grad_accum_bytes=a)["total"] \
            <= 3.6 * GIB


def test_a_megatron_style_mpu_is_refused_before_any_process_group(monkeypatch):
    """A Megatron-style mpu carries tensor or pipeline groups: refused by name, saying which mpu is accepted (Ulysses
    sequence parallelism's state, tests/test_sequence_parallel.py), before any process group exists."""
    import ds_asynchzp

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")

    class MegatronStyle:
        def get_model_parallel_world_size(self):
            return 2

    with pytest.raises(AsyncHZPConfigError, match="Megatron-style model-parallel unit") as info:
        ds_asynchzp.resolve_for_initialize(config=make(), mpu=MegatronStyle())
    assert info.value.keys == ("mpu",) and "Ulysses sequence parallelism" in str(info.value)
    assert not dist.is_initialized()


def test_sequence_parallelism_in_the_layout_and_the_gradient_dtype():
    """Under Ulysses SP DeepSpeed reduces gradients in seq_parallel_communication_data_type (fp32 unless set), not
    communication_data_type; the layout says where the SP all-to-alls run (consecutive ranks: inside a node when sp
    divides the node size)."""
    from ds_asynchzp.config import grad_comm_bytes

    bf16 = make()
    bf16["bf16"] = {"enabled": True}
    assert grad_comm_bytes(bf16) == 2 and grad_comm_bytes(bf16, 2) == 4
    assert grad_comm_bytes(dict(bf16, seq_parallel_communication_data_type="bf16"), 2) == 2
    inside = resolve_layout(make(), 8, 4, sequence_parallel_size=2)
    assert inside.sequence_parallel_size == 2 and "sp=2: its all-to-alls run inside a node" in inside.describe()
    across = resolve_layout(make(), 8, 4, sequence_parallel_size=8)
    assert "across nodes (8 does not divide the node size 4)" in across.describe()
