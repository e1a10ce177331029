"""The async_hzp ds_config section: parsing, validation, layout resolution, sizing.

Pure Python: no process group is ever created; every rejection is also
checked to leave torch.distributed uninitialized.
"""

import copy
import json

import pytest
import torch.distributed as dist

from ds_asynchzp import schema, sizing
from ds_asynchzp.config import (
    AsyncHZPConfig,
    AsyncHZPConfigError,
    ResolvedLayout,
    resolve_layout,
    section_from_ds_config,
)

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
    ("log-layout-int", make({"log_layout": 1}), 8, 4, {}, {}, "async_hzp.log_layout"),
    ("stage-missing", make(drop=["zero_optimization.stage"]), 8, 4, {}, {}, "zero_optimization.stage"),
    ("stage-2", make(zero={"stage": 2}), 8, 4, {}, {}, "zero_optimization.stage"),
    ("no-zero-section", make(drop=["zero_optimization"]), 8, 4, {}, {}, "zero_optimization.stage"),
    ("no-optimizer", make(drop=["optimizer"]), 8, 4, {}, {}, "optimizer"),
    ("hpz", make(zero={"zero_hpz_partition_size": 4}), 8, 4, {}, {}, "zero_optimization.zero_hpz_partition_size"),
    ("qgZ", make(zero={"zero_quantized_gradients": True}), 8, 4, {}, {}, "zero_optimization.zero_quantized_gradients"),
    ("qwZ", make(zero={"zero_quantized_weights": True}), 8, 4, {}, {}, "zero_optimization.zero_quantized_weights"),
    ("offload-optim", make(zero={"offload_optimizer": {"device": "cpu"}}), 8, 4, {}, {},
     "zero_optimization.offload_optimizer.device"),
    ("offload-param", make(zero={"offload_param": {"device": "nvme"}}), 8, 4, {}, {},
     "zero_optimization.offload_param.device"),
    ("cpu-offload-legacy", make(zero={"cpu_offload": True}), 8, 4, {}, {}, "zero_optimization.cpu_offload"),
    ("mics", make(zero={"mics_shard_size": 4}), 8, 4, {}, {}, "zero_optimization.mics_shard_size"),
    ("node-size-unknown", make(), 8, None, {}, {}, "async_hzp.node_size"),
    ("node-size-env-garbage", make(), 8, None, {"LOCAL_WORLD_SIZE": "four"}, {}, "async_hzp.node_size"),
    ("node-size-not-dividing", make({"node_size": 3}), 8, None, {}, {}, "async_hzp.node_size"),
    ("node-size-above-world", make(), 4, 8, {}, {}, "async_hzp.node_size"),
    ("param-not-dividing-node", make({"param_shard_size": 3}), 8, 4, {}, {}, "async_hzp.param_shard_size"),
    ("param-spans-nodes", make({"param_shard_size": 8}), 8, 4, {}, {}, "async_hzp.param_shard_size"),
    ("grad-below-param", make({"param_shard_size": 4, "grad_shard_size": 2}), 8, 4, {}, {},
     "async_hzp.grad_shard_size"),
    ("grad-partial-nodes", make({"param_shard_size": 2, "grad_shard_size": 6}), 12, 4, {}, {},
     "async_hzp.grad_shard_size"),
    ("grad-above-world", make({"grad_shard_size": 16}), 8, 4, {}, {}, "async_hzp.grad_shard_size"),
    ("optim-below-world", make({"optimizer_shard_size": 4}), 8, 4, {}, {}, "async_hzp.optimizer_shard_size"),
    ("auto-without-model", make({"param_shard_size": "auto"}), 8, 4, {}, {}, "async_hzp.param_shard_size"),
    ("auto-grad-without-model", make({"grad_shard_size": "auto"}), 8, 4, {}, {}, "async_hzp.grad_shard_size"),
    ("auto-mixed-with-int", make({"param_shard_size": 2, "grad_shard_size": "auto"}), 8, 4, {}, {"num_parameters": PSI},
     "async_hzp.param_shard_size"),
    ("auto-budget-too-small", make({"param_shard_size": "auto", "memory_budget_gb": 3}, bf16={"enabled": True}), 8, 4, {}, {"num_parameters": PSI},
     "async_hzp.memory_budget_gb"),
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
    cfg = make(zero={"stage": 1, "zero_quantized_weights": True}, drop=["optimizer"])
    with pytest.raises(AsyncHZPConfigError) as info:
        resolve_layout(cfg, 8, 4)
    assert set(info.value.keys) == {"zero_optimization.stage", "zero_optimization.zero_quantized_weights", "optimizer"}
    assert not dist.is_initialized()


def test_messages_suggest_valid_values():
    with pytest.raises(AsyncHZPConfigError, match=r"nearest valid values 2 or 4") as info:
        resolve_layout(make({"node_size": 3}), 8, None)
    assert "8" in str(info.value)
    with pytest.raises(AsyncHZPConfigError, match=r"one of 1, 2, 4"):
        resolve_layout(make({"param_shard_size": 3}), 8, 4)
    with pytest.raises(AsyncHZPConfigError, match=r"world size 8"):
        resolve_layout(make({"optimizer_shard_size": 4}), 8, 4)
    with pytest.raises(AsyncHZPConfigError, match=r"did you mean async_hzp.param_shard_size"):
        section_from_ds_config(make({"param_shard_sise": 2}))


# ---------------------------------------------------------------- good layouts

GOOD = [
    ("defaults", make(), 8, 4, {}, {}, (4, 4, 8)),
    ("explicit", make({"param_shard_size": 2, "grad_shard_size": 4}), 8, 4, {}, {}, (2, 4, 8)),
    ("grad-defaults-to-param", make({"param_shard_size": 2}), 8, 4, {}, {}, (2, 2, 8)),
    ("grad-spans-nodes", make({"param_shard_size": 2, "grad_shard_size": 8}), 16, 4, {}, {}, (2, 8, 16)),
    ("optimizer-explicit-world", make({"optimizer_shard_size": 8}), 8, 4, {}, {}, (4, 4, 8)),
    ("optimizer-auto", make({"optimizer_shard_size": "auto"}), 8, 4, {}, {}, (4, 4, 8)),
    ("node-size-from-section", make({"node_size": 2}), 8, 4, {}, {}, (2, 2, 8)),
    ("node-size-from-env", make(), 8, None, {"LOCAL_WORLD_SIZE": "4"}, {}, (4, 4, 8)),
    ("node-size-from-local-size", make(), 8, None, {"LOCAL_SIZE": "2"}, {}, (2, 2, 8)),
    ("single-rank", make(), 1, 1, {}, {}, (1, 1, 1)),
    ("client-optimizer", make(drop=["optimizer"]), 8, 4, {}, {"has_client_optimizer": True}, (4, 4, 8)),
    ("harmless-zero-keys", make(zero={"zero_hpz_partition_size": 1, "offload_param": {"device": "none"}}), 8, 4, {}, {},
     (4, 4, 8)),
    # Generous budget: full replication (d_p = 1) needs 8.25e9 bytes and fits.
    ("auto-generous", make({"param_shard_size": "auto", "memory_budget_gb": 100}, bf16={"enabled": True}), 8, 4, {}, {"num_parameters": PSI},
     (1, 1, 8)),
    # 6 GiB ~ 6.44e9: d=1 (8.25e9) is too big, d=2 (5.25e9) fits.
    ("auto-medium", make({"param_shard_size": "auto", "grad_shard_size": "auto", "memory_budget_gb": 6}, bf16={"enabled": True}), 8, 4, {},
     {"num_parameters": PSI}, (2, 2, 8)),
    # 4 GiB ~ 4.29e9: only d=4 (3.75e9) fits.
    ("auto-tight", make({"grad_shard_size": "auto", "memory_budget_gb": 4}, bf16={"enabled": True}), 8, 4, {}, {"num_parameters": PSI},
     (4, 4, 8)),
]


@pytest.mark.parametrize("cfg,world,local,env,kwargs,expected", [g[1:] for g in GOOD], ids=[g[0] for g in GOOD])
def test_good_config_resolves(monkeypatch, cfg, world, local, env, kwargs, expected):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    layout = resolve_layout(cfg, world, local, **kwargs)
    assert isinstance(layout, ResolvedLayout)
    assert (layout.param_shard_size, layout.grad_shard_size, layout.optimizer_shard_size) == expected
    assert layout.world_size == world
    assert layout.num_nodes * layout.node_size == world
    assert not dist.is_initialized()


def test_layout_fields_and_description():
    layout = resolve_layout(make(), 8, 4)
    assert layout == ResolvedLayout(world_size=8, node_size=4, num_nodes=2, param_shard_size=4, grad_shard_size=4,
                                    optimizer_shard_size=8)
    text = layout.describe()
    assert "\n" not in text and "world=8" in text and "2 node(s) x 4 ranks" in text


def test_log_layout_flag_reaches_the_layout():
    assert resolve_layout(make(), 8, 4).log_layout is True
    assert resolve_layout(make({"log_layout": False, "param_shard_size": 2}), 8, 4).log_layout is False


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
    assert (layout.param_shard_size, layout.grad_shard_size, layout.optimizer_shard_size) == (2, 2, 8)


def test_invalid_json_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"async_hzp": {,}')
    with pytest.raises(AsyncHZPConfigError, match="ds_config"):
        section_from_ds_config(path)
    assert not dist.is_initialized()


# ---------------------------------------------------------------- sizing


def test_sizing_worked_example():
    # Ψ = 1e9, world 8, params/grads over 4 ranks, optimizer over 8, bf16 + fp32 Adam.
    got = sizing.model_state_bytes_per_rank(PSI, world=8, d_p=4, d_g=4, d_o=8)
    assert got == {
        "param_shard": 500_000_000,  # 2 B * 1e9 / 4
        "param_primary": 250_000_000,  # 2 B * 1e9 / 8
        "grad_shard": 1_000_000_000,  # 4 B * 1e9 / 4
        "grad_primary": 500_000_000,  # 4 B * 1e9 / 8
        "master": 500_000_000,  # 4 B * 1e9 / 8
        "optimizer_state": 1_000_000_000,  # 8 B * 1e9 / 8
        "total": 3_750_000_000,
    }
    assert sizing.model_state_bytes_per_rank(PSI, 8, 1, 1, 8)["total"] == 8_250_000_000
    assert sizing.model_state_bytes_per_rank(PSI, 8, 2, 2, 8)["total"] == 5_250_000_000


def test_choose_shard_sizes_picks_smallest_fitting_group():
    assert sizing.choose_shard_sizes(PSI, 8, 4, 9e9) == (1, 1, 8)
    assert sizing.choose_shard_sizes(PSI, 8, 4, 8_249_999_999) == (2, 2, 8)
    assert sizing.choose_shard_sizes(PSI, 8, 4, 3_750_000_000) == (4, 4, 8)
    with pytest.raises(AsyncHZPConfigError, match="async_hzp.memory_budget_gb") as info:
        sizing.choose_shard_sizes(PSI, 8, 4, 3_749_999_999)
    assert "3750000000 bytes" in str(info.value)
    # The suggested budget is rounded up, so following the advice works.
    assert "at least 3.50" in str(info.value)
    assert sizing.choose_shard_sizes(PSI, 8, 4, 3.50 * GIB) == (4, 4, 8)


def test_sizing_helpers():
    assert sizing.divisors(12) == [1, 2, 3, 4, 6, 12]
    assert sizing.divisors(1) == [1]
    assert sizing.padded_num_params([10, 8, 1], world=4) == 12 + 8 + 4
    assert sizing.default_budget_bytes(node_size=4) > 0


def test_auto_accounts_for_the_parameter_dtype():
    """fp32 parameters take twice the bytes of bf16 ones, so the same budget needs a larger shard group."""
    from ds_asynchzp import sizing

    psi, world, node = 10**9, 8, 4
    bf16_total = sizing.model_state_bytes_per_rank(psi, world, 1, 1, world, param_bytes=2)["total"]
    budget_gb = bf16_total * 1.01 / sizing.BYTES_PER_GB
    bf16 = make({"param_shard_size": "auto", "grad_shard_size": "auto", "memory_budget_gb": budget_gb})
    bf16["bf16"] = {"enabled": True}
    fp32 = make({"param_shard_size": "auto", "grad_shard_size": "auto", "memory_budget_gb": budget_gb})
    assert resolve_layout(bf16, world, node, num_parameters=psi).param_shard_size == 1
    assert resolve_layout(fp32, world, node, num_parameters=psi).param_shard_size > 1
