"""The ``asynchzp-bench`` command: flag validation, and one small end-to-end comparison on CPU ranks."""

from __future__ import annotations

import json

import pytest

from ds_asynchzp.bench import arms, cli, zero3_knobs
from ds_asynchzp.bench.aggregate import aggregate_arm, merge_repeats
from ds_asynchzp.bench.table import format_family_table, format_table


def _fails_with(capsys, argv: list[str], fragment: str) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2  # argparse's usage-error code
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize("argv, fragment", [
    (["--nproc", "6", "--node-size", "4"], "not a multiple of --node-size"),
    (["--arms", "zero3,zero9"], "unknown arm(s) 'zero9'"),
    (["--arms", "zero3,zero3"], "listed twice"),
    (["--arms", ","], "at least one arm"),
    (["--model", "huge"], "invalid choice: 'huge'"),
    (["--steps", "3", "--warmup-steps", "3"], "--warmup-steps 3 must be < --steps 3"),
    (["--steps", "0"], "must be >= 1"),
    (["--dtype", "fp8"], "invalid choice: 'fp8'"),
    (["--lr", "-1"], "must be > 0"),
    (["--comm-delay-ms", "-0.5"], "must be a finite number >= 0"),
    (["--comm-delay-ms", "nan"], "must be a finite number >= 0"),
    (["--comm-delay-ms", "soon"], "not a number: 'soon'"),
])
def test_bad_flags_fail_before_any_rank_starts(capsys, monkeypatch, tmp_path, argv, fragment):
    def no_launch(*args, **kwargs):
        raise AssertionError("ranks were started despite invalid flags")

    monkeypatch.setattr("ds_asynchzp.bench.launch.launch_local", no_launch)
    _fails_with(capsys, [*argv, "--out", str(tmp_path / "out")], fragment)
    assert not (tmp_path / "out").exists()


def test_fp16_is_refused_up_front_where_the_cpu_lacks_it(capsys, monkeypatch):
    monkeypatch.setattr(cli, "cpu_supports_fp16", lambda: False)
    _fails_with(capsys, ["--dtype", "fp16"], "--dtype fp16")
    monkeypatch.setattr(cli, "cpu_supports_fp16", lambda: True)
    assert cli.parse_args(["--dtype", "fp16"]).dtype == "fp16"


def test_zero3_knob_presets_turn_stock_scheduling_on_by_default():
    """The default preset lets stock ZeRO-3 prefetch and overlap (a fair baseline), every parameter partitioned
    and released; the live cache holds a few blocks of the chosen model; the other presets are what they say."""
    from ds_asynchzp.models.gpt import build_model

    tuned = cli.shared_zero3_knobs(cli.parse_args(["--model", "small"]))
    block = zero3_knobs.largest_block_parameters(build_model("small"))
    assert block == sum(p.numel() for p in build_model("small").blocks[0].parameters())
    assert tuned["overlap_comm"] is True and tuned["stage3_prefetch_bucket_size"] > 0
    assert tuned["stage3_max_live_parameters"] == zero3_knobs.TUNED_LIVE_BLOCKS * block
    assert tuned["stage3_param_persistence_threshold"] == tuned["stage3_max_reuse_distance"] == 0
    assert cli.shared_zero3_knobs(cli.parse_args(["--zero3-knobs", "deepspeed"])) == {"stage": 3}
    quiet = cli.shared_zero3_knobs(cli.parse_args(["--zero3-knobs", "no-overlap"]))
    assert quiet["overlap_comm"] is False and quiet["stage3_prefetch_bucket_size"] == 0
    # Every arm gets the preset, hpZ and ZeRO++ add their own keys only.
    args = cli.parse_args(["--zero3-knobs", "deepspeed", "--arms", "zero3,hpz,zeropp,asynchzp"])
    for arm in args.arms:
        zero = cli.ds_config_for(arm, args)["zero_optimization"]
        assert {k: v for k, v in zero.items() if not k.startswith("zero_")} == {"stage": 3}, arm


@pytest.mark.parametrize("preset, depth", [("tuned", 2), ("deepspeed", 2), ("no-overlap", 0)])
def test_asynchzp_replay_follows_deepspeeds_prefetch_switch(preset, depth):
    """AsyncHZP's own replay of the fetch order is on where DeepSpeed's prefetch is, off where the knobs turn
    DeepSpeed's off, and what the arm says where it says it."""
    from ds_asynchzp.config import resolve_layout

    args = cli.parse_args(["--zero3-knobs", preset, "--arms", "asynchzp,asynchzp:prefetch_depth=1"])
    assert resolve_layout(cli.ds_config_for("asynchzp", args), 4, 2).scheduling.prefetch_depth == depth
    assert resolve_layout(cli.ds_config_for("asynchzp:prefetch_depth=1", args), 4, 2).scheduling.prefetch_depth == 1


def test_defaults_and_arm_configs_share_the_zero3_knobs():
    args = cli.parse_args([])
    assert (args.arms, args.nproc, args.node_size, args.model, args.steps, args.grad_accum) == (
        ["zero3", "hpz", "asynchzp"], 4, 2, "small", 6, 4)
    configs = {arm: cli.ds_config_for(arm, args) for arm in args.arms}
    for config in configs.values():
        zero = dict(config["zero_optimization"])
        zero.pop("zero_hpz_partition_size", None)
        assert zero == cli.shared_zero3_knobs(args)
        assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
        assert "bf16" not in config and "fp16" not in config
    assert configs["hpz"]["zero_optimization"]["zero_hpz_partition_size"] == 2
    assert configs["asynchzp"]["async_hzp"] == {"node_size": 2}
    assert "async_hzp" not in configs["zero3"] and "async_hzp" not in configs["hpz"]
    assert cli.ds_config_for("zero3", cli.parse_args(["--dtype", "bf16"]))["bf16"] == {"enabled": True}
    fp16_args = cli.parse_args(["--dtype", "bf16"])
    fp16_args.dtype = "fp16"  # parse_args would refuse fp16 on a CPU without it
    assert cli.ds_config_for("zero3", fp16_args)["fp16"] == {
        "enabled": True, "initial_scale_power": 8}


def test_arm_specs_name_a_base_arm_and_its_async_hzp_overrides():
    args = cli.parse_args(["--arms", "zero3,hpz,asynchzp,asynchzp:optimizer_shard_size=4",
                           "--nproc", "4", "--node-size", "2"])
    assert args.arms == ["zero3", "hpz", "asynchzp", "asynchzp:optimizer_shard_size=4"]
    spec = arms.parse_arm_spec("asynchzp:param_shard_size=1:grad_shard_size=2")
    assert (spec.name, spec.base, spec.overrides) == ("asynchzp:param_shard_size=1:grad_shard_size=2", "asynchzp",
                                                      {"param_shard_size": 1, "grad_shard_size": 2})
    assert arms.parse_arm_spec("asynchzp:param_shard_size=auto").overrides == {"param_shard_size": "auto"}
    assert arms.parse_arm_spec("zero3").overrides == {}


@pytest.mark.parametrize("arms, fragments", [
    ("zero3,asynchzp:foo=1", ["'asynchzp:foo=1'", "unknown key 'foo'", "valid keys: node_size, param_shard_size"]),
    ("zero3:param_shard_size=2", ["'zero3:param_shard_size=2'", "takes no overrides", "'param_shard_size'",
                                  "valid keys"]),
    ("hpz:node_size=2", ["'hpz:node_size=2'", "takes no overrides"]),
    ("asynchzp:param_shard_size=1,asynchzp:param_shard_size=1", ["listed twice: asynchzp:param_shard_size=1"]),
    ("asynchzp:param_shard_size=1:grad_shard_size=2,asynchzp:grad_shard_size=2:param_shard_size=1",
     ["listed twice", "same configuration"]),
    ("asynchzp:param_shard_size=1:param_shard_size=2", ["key 'param_shard_size' given twice"]),
    ("asynchzp:param_shard_size", ["'asynchzp:param_shard_size'", "not key=value"]),
    ("asynchzp:param_shard_size=two", ["key 'param_shard_size'", "not an integer or \"auto\""]),
    ("asynchzp:enabled=false", ["key 'enabled' cannot be overridden"]),
    ("asynchzp-sync:enabled=false", ["key 'enabled' cannot be overridden"]),
    # async_comm is what tells the two AsyncHZP arms apart: the error names the arm to run instead.
    ("asynchzp:async_comm=false", ["'asynchzp:async_comm=false'", "key 'async_comm' cannot be overridden",
                                   "run the arm 'asynchzp-sync' instead"]),
    ("asynchzp-sync:param_shard_size=1:async_comm=true", ["key 'async_comm' cannot be overridden",
                                                          "run the arm 'asynchzp:param_shard_size=1' instead"]),
    ("asynchzp-sync:async_comm=false", ["already runs with async_comm false"]),
    ("asynchzp:async_comm=0", ["key 'async_comm' cannot be overridden", "asynchzp-sync arm for synchronous"]),
    ("asynchzp-sync:param_shard_size=3", ["'asynchzp-sync:param_shard_size=3'", "async_hzp.param_shard_size"]),
    ("zero9:param_shard_size=1", ["unknown arm(s) 'zero9'"]),
    # Values go through the engine's own config check before any rank starts.
    ("asynchzp:param_shard_size=3", ["'asynchzp:param_shard_size=3'", "async_hzp.param_shard_size"]),
    # The offload arms: the stock one takes no overrides, the AsyncHZP one those of asynchzp, checked alike.
    ("zero3-offload:param_shard_size=2", ["'zero3-offload:param_shard_size=2'", "takes no overrides"]),
    ("asynchzp-offload:enabled=false", ["'asynchzp-offload:enabled=false'", "key 'enabled' cannot be overridden"]),
    ("asynchzp-offload:async_comm=false", ["key 'async_comm' cannot be overridden",
                                           "the asynchzp-offload arm runs with async_comm true"]),
    ("asynchzp-offload:param_shard_size=3", ["'asynchzp-offload:param_shard_size=3'", "async_hzp.param_shard_size"]),
    ("asynchzp-offload:offload_optimizer=cpu", ["unknown key 'offload_optimizer'"]),
    ("zero3-offload,zero3-offload", ["listed twice: zero3-offload"]),
])
def test_bad_arm_specs_fail_before_any_rank_starts(capsys, monkeypatch, tmp_path, arms, fragments):
    def no_launch(*args, **kwargs):
        raise AssertionError("ranks were started despite an invalid arm spec")

    monkeypatch.setattr("ds_asynchzp.bench.launch.launch_local", no_launch)
    with pytest.raises(SystemExit) as exc:
        cli.main(["--arms", arms, "--nproc", "4", "--node-size", "2", "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--arms:" in err
    for fragment in fragments:
        assert fragment in err
    assert not (tmp_path / "out").exists()


def test_override_arm_config_payload_and_recorded_overrides():
    args = cli.parse_args(["--arms", "zero3,asynchzp,asynchzp:param_shard_size=1:grad_shard_size=2",
                           "--nproc", "4", "--node-size", "2"])
    name = "asynchzp:param_shard_size=1:grad_shard_size=2"
    config = cli.ds_config_for(name, args)
    assert config["async_hzp"] == {"node_size": 2, "param_shard_size": 1, "grad_shard_size": 2}
    # Everything else is the plain asynchzp arm's config.
    assert {k: v for k, v in config.items() if k != "async_hzp"} == {
        k: v for k, v in cli.ds_config_for("asynchzp", args).items() if k != "async_hzp"}
    payload = cli._payload(name, args)
    assert payload["arm"] == name and payload["expected_optimizer"] == "HierarchicalZeroOptimizer"
    assert payload["ds_config"] == config
    overrides = cli.run_config(args)["arm_overrides"]
    assert overrides == {"asynchzp": {"async_hzp": {"node_size": 2}},
                         name: {"async_hzp": {"node_size": 2, "param_shard_size": 1, "grad_shard_size": 2}}}
    assert cli.run_config(args)["arm_specs"][name] == {"base": "asynchzp",
                                                       "overrides": {"param_shard_size": 1, "grad_shard_size": 2}}
    assert ":" not in arms.arm_dir_name(name)


def test_asynchzp_sync_arm_is_the_asynchzp_placement_with_synchronous_communication():
    name = "asynchzp-sync:param_shard_size=1"
    args = cli.parse_args(["--arms", f"zero3,asynchzp,asynchzp-sync,{name}", "--nproc", "4", "--node-size", "2"])
    assert args.arms == ["zero3", "asynchzp", "asynchzp-sync", name]
    spec = arms.parse_arm_spec(name)
    assert (spec.base, spec.overrides) == ("asynchzp-sync", {"param_shard_size": 1})
    assert spec.identity != arms.parse_arm_spec("asynchzp:param_shard_size=1").identity  # not a duplicate
    assert cli.ARMS["asynchzp-sync"][0] == ("AsyncHZP placement, communication synchronous on the training "
                                            "thread (A/B of the scheduling)")

    sync, threaded = cli.ds_config_for("asynchzp-sync", args), cli.ds_config_for("asynchzp", args)
    assert sync["async_hzp"] == {"node_size": 2, "async_comm": False}
    assert "async_comm" not in threaded["async_hzp"]  # the section's default: true
    # Nothing else differs between the two arms.
    assert {k: v for k, v in sync.items() if k != "async_hzp"} == {
        k: v for k, v in threaded.items() if k != "async_hzp"}
    assert cli.ds_config_for(name, args)["async_hzp"] == {"node_size": 2, "async_comm": False, "param_shard_size": 1}
    for arm in ("asynchzp-sync", name):
        assert cli._payload(arm, args)["expected_optimizer"] == "HierarchicalZeroOptimizer"
    config = cli.run_config(args)
    assert config["arm_overrides"]["asynchzp-sync"] == {"async_hzp": {"node_size": 2, "async_comm": False}}
    assert config["arm_specs"][name] == {"base": "asynchzp-sync", "overrides": {"param_shard_size": 1}}
    assert "async_comm" not in arms.override_keys()


def test_offload_arms_add_optimizer_offload_alone():
    """zero3-offload and asynchzp-offload are zero3 and asynchzp with the optimizer on the host: the same knobs,
    model and data, the one offload section (DeepSpeed's default pin_memory), recorded as the arm's override."""
    name = "asynchzp-offload:param_shard_size=1"
    args = cli.parse_args(["--arms", f"zero3,asynchzp,zero3-offload,asynchzp-offload,{name}", "--nproc", "4",
                           "--node-size", "2"])
    assert args.arms == ["zero3", "asynchzp", "zero3-offload", "asynchzp-offload", name]
    assert "offload" not in arms.DEFAULT_ARMS  # opt-in: the default run stays as fast as before
    for arm, twin in (("zero3-offload", "zero3"), ("asynchzp-offload", "asynchzp"), (name, "asynchzp")):
        config, plain = cli.ds_config_for(arm, args), cli.ds_config_for(twin, args)
        assert config["zero_optimization"].pop("offload_optimizer") == {"device": "cpu"}
        if arm == name:
            assert config["async_hzp"] == {"node_size": 2, "param_shard_size": 1}
            config["async_hzp"] = plain["async_hzp"]
        assert config == plain, arm
        assert cli._payload(arm, args)["expected_optimizer"] == cli._payload(twin, args)["expected_optimizer"]
        assert arms.placement_arm(arms.parse_arm_spec(arm).base) == twin
    assert "offload_optimizer" not in cli.ds_config_for("asynchzp", args)["zero_optimization"]
    overrides = cli.run_config(args)["arm_overrides"]
    assert overrides["zero3-offload"] == {"zero_optimization.offload_optimizer": {"device": "cpu"}}
    assert overrides["asynchzp-offload"] == {"zero_optimization.offload_optimizer": {"device": "cpu"},
                                             "async_hzp": {"node_size": 2}}
    # A later edit of one arm's ds_config cannot reach another's.
    cli.ds_config_for("zero3-offload", args)["zero_optimization"]["offload_optimizer"]["device"] = "nvme"
    assert cli.ds_config_for("asynchzp-offload", args)["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}


def test_comm_delay_reaches_every_payload_and_the_recorded_config():
    assert cli.parse_args([]).comm_delay_ms == 0.0
    args = cli.parse_args(["--arms", "zero3,asynchzp,asynchzp-sync", "--comm-delay-ms", "2.5"])
    assert [cli._payload(arm, args)["comm_delay_ms"] for arm in args.arms] == [2.5, 2.5, 2.5]
    assert cli.run_config(args)["comm_delay_ms"] == 2.5
    assert json.loads(json.dumps(cli.run_config(args)))["comm_delay_ms"] == 2.5  # as results.json holds it


def test_layouts_recorded_by_the_step_recorder():
    from ds_asynchzp.measure import step_recorder

    args = cli.parse_args(["--nproc", "8", "--node-size", "4"])
    zero3, text = step_recorder.stock_layout(cli.ds_config_for("zero3", args), 8, 4)
    assert zero3 == {"world_size": 8, "node_size": 4, "num_nodes": 2, "param_shard_size": 8, "grad_shard_size": 8,
                     "optimizer_shard_size": 8, "auto_reason": None}
    assert "ZeRO-3" in text
    hpz, text = step_recorder.stock_layout(cli.ds_config_for("hpz", args), 8, 4)
    assert (hpz["param_shard_size"], hpz["grad_shard_size"], hpz["optimizer_shard_size"]) == (4, 8, 8)
    assert "hpZ" in text

    class Layout:
        def as_dict(self):
            return {"world_size": 8, "node_size": 4, "num_nodes": 2, "param_shard_size": 2, "grad_shard_size": 4,
                    "optimizer_shard_size": 8, "auto_reason": "fits"}

        def describe(self):
            return "async_hzp layout: ..."

    class Engine:
        def __init__(self, optimizer):
            self.optimizer = optimizer

    hzp_engine = Engine(type("Opt", (), {"hzp_layout": Layout()})())
    assert step_recorder.layout_of(hzp_engine, {}, 8, 4) == (Layout().as_dict(), "async_hzp layout: ...")
    stock_engine = Engine(object())
    assert step_recorder.layout_of(stock_engine, cli.ds_config_for("zero3", args), 8, 4)[0] == zero3


def _fake_rank(rank: int, losses, times, inter, rss: int, node_tx=None, exposed=None, busy=None) -> dict:
    node_tx = node_tx or [None] * len(losses)
    steps = [{"loss": l, "time_s": t, "intra_node": 10.0, "inter_node": b, "calls": 3, "link_bytes": b / 2,
              "comm_s": t / 2, "node_tx_bytes": tx,
              "by_op": {"all_gather": {"intra_node": 10.0, "inter_node": b, "calls": 3}}}
             for l, t, b, tx in zip(losses, times, inter, node_tx)]
    # Workers that record them add exposed and busy communication per step.
    for key, values in (("exposed_comm_s", exposed), ("comm_busy_s", busy)):
        for step, value in zip(steps, values or []):
            step[key] = value
    return {"rank": rank, "optimizer_class": "DeepSpeedZeroOptimizer_Stage3", "steps": steps,
            "startup_s": {"spawn_s": 1.0 + rank}, "model_state_bytes": {"total": 100 + rank},
            "peak_rss_bytes": rss}


def test_aggregation_rules_and_table():
    args = cli.parse_args(["--nproc", "2", "--node-size", "1", "--steps", "3", "--warmup-steps", "1",
                           "--micro-batch", "1", "--seq-len", "8", "--grad-accum", "1"])
    ranks = [_fake_rank(1, [3.0, 2.0, 1.0], [9.0, 1.0, 3.0], [999.0, 4.0, 6.0], 50),
             _fake_rank(0, [1.0, 2.0, 3.0], [5.0, 2.0, 2.0], [999.0, 8.0, 10.0], 70)]
    entry = aggregate_arm(ranks, args.warmup_steps, cli.tokens_per_optimizer_step(args))
    assert entry["losses"] == [2.0, 2.0, 2.0]  # mean over ranks
    assert entry["step_time_s"] == [9.0, 2.0, 3.0]  # slowest rank
    assert entry["median_step_time_s"] == 2.5  # warm-up step left out
    # Per rank steady-state mean (5 and 9), then the mean over ranks; the warm-up step's 999 is left out.
    assert entry["bytes_per_step"] == {"intra_node": 10.0, "inter_node": 7.0}
    assert entry["bytes_per_step_by_op"]["all_gather"]["inter_node"] == 7.0
    assert entry["peak_memory_bytes"] == 70 and entry["model_state_bytes"] == {"total": 100}
    assert entry["tokens_per_s"] == 2 * 1 * 8 * 1 / 2.5
    assert entry["link_bytes_inter_node_per_step"] == 3.5
    assert entry["wire_bytes_inter_node_per_step"] is None  # loopback: no link counters
    # Ranks that recorded no exposed or busy time (older workers): None, not a figure of another meaning.
    assert entry["exposed_comm_s"] is entry["comm_busy_s"] is None
    assert entry["exposed_comm_s_per_step"] is entry["comm_busy_s_per_step"] is None
    assert entry["comm_time_s"] == [3.5, 0.75, 1.25]  # summed call durations, mean over ranks, kept as before
    assert entry["timeline"] is None and entry["buffer_allocations"] is None
    assert entry["layout"] is None  # ranks that recorded no layout (older workers)
    layouts = [dict(r, layout={"world_size": 2, "rank": r["rank"]}, layout_text=f"rank {r['rank']}") for r in ranks]
    with_layout = aggregate_arm(layouts, args.warmup_steps, cli.tokens_per_optimizer_step(args))
    assert with_layout["layout"] == {"world_size": 2, "rank": 0} and with_layout["layout_text"] == "rank 0"
    assert merge_repeats([with_layout])["layout"] == with_layout["layout"]

    other = dict(entry, losses=[2.0, 2.0, 2.2], bytes_per_step={"intra_node": 0.0, "inter_node": 3.5})
    table = format_table({"config": {}, "arms": {"zero3": entry, "asynchzp": other}})
    asynchzp_row = next(line for line in table.splitlines() if line.startswith("| asynchzp"))
    assert "1.00e-01" in asynchzp_row and "0.500" in asynchzp_row  # loss rel diff, inter ratio
    assert "n/a" in format_table({"config": {}, "arms": {"asynchzp": other}})


def test_exposed_and_busy_time_per_step_are_the_slowest_ranks():
    tokens = 16
    timeline = {"duration_s": 2.0, "collectives": [], "waits": []}
    ranks = [_fake_rank(1, [1.0] * 4, [1.0] * 4, [0.0] * 4, 1, exposed=[9.0, 0.1, 0.6, 0.2],
                        busy=[9.0, 1.0, 1.5, 3.0]),
             dict(_fake_rank(0, [1.0] * 4, [1.0] * 4, [0.0] * 4, 1, exposed=[5.0, 0.3, 0.4, 0.5],
                             busy=[5.0, 2.0, 1.0, 1.0]),
                  timeline=timeline, timeline_step=2, buffer_allocations={"param_gather": 3})]
    ranks[0]["timeline"] = {"duration_s": 9.0, "collectives": [], "waits": []}  # rank 1's: not kept
    entry = aggregate_arm(ranks, 1, tokens)
    assert entry["exposed_comm_s"] == [9.0, 0.3, 0.6, 0.5]  # per step, the largest over ranks
    assert entry["comm_busy_s"] == [9.0, 2.0, 1.5, 3.0]
    assert entry["exposed_comm_s_per_step"] == 0.5  # median of the steady steps (0.3, 0.6, 0.5)
    assert entry["comm_busy_s_per_step"] == 2.0  # median of (2.0, 1.5, 3.0)
    assert entry["timeline"] is timeline and (entry["timeline_step"], entry["timeline_rank"]) == (2, 0)
    assert entry["buffer_allocations"] == {"param_gather": 3}

    # Repeats: the median of each repeat's median; the first repeat's lists, timeline and allocations stay on top.
    def scaled(k: float) -> list:
        return [dict(r, timeline=None, buffer_allocations=None,
                     steps=[dict(st, exposed_comm_s=st["exposed_comm_s"] * k, comm_busy_s=st["comm_busy_s"] * k)
                            for st in r["steps"]]) for r in ranks]

    merged = merge_repeats([entry, aggregate_arm(scaled(3.0), 1, tokens), aggregate_arm(scaled(5.0), 1, tokens)])
    assert merged["exposed_comm_s_per_step"] == pytest.approx(1.5)  # medians 0.5, 1.5, 2.5
    assert merged["comm_busy_s_per_step"] == pytest.approx(6.0)  # medians 2.0, 6.0, 10.0
    assert merged["exposed_comm_s"] == entry["exposed_comm_s"]
    assert merged["timeline"] is timeline and merged["buffer_allocations"] == {"param_gather": 3}
    assert [r["exposed_comm_s_per_step"] for r in merged["repeats"]] == pytest.approx([0.5, 1.5, 2.5])
    assert merged["repeats"][2]["comm_busy_s"] == pytest.approx([45.0, 10.0, 7.5, 15.0])
    older = aggregate_arm([_fake_rank(0, [1.0] * 2, [1.0] * 2, [0.0] * 2, 1)], 1, tokens)
    assert merge_repeats([older, older])["comm_busy_s_per_step"] is None

    table = format_table({"config": {}, "arms": {"asynchzp": merged}})
    row = next(line for line in table.splitlines() if line.startswith("| asynchzp"))
    assert "1.500" in row and "6.000" in row


def test_small_run_matches_zero3_with_less_inter_node_traffic(tmp_path, capsys):
    steps = 3
    code = cli.main(["--arms", "zero3,asynchzp", "--nproc", "4", "--node-size", "2", "--model", "tiny",
                     "--steps", str(steps), "--grad-accum", "2", "--warmup-steps", "1", "--seq-len", "32",
                     "--network", "loopback", "--out", str(tmp_path), "--timeout", "300"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "[1/2] zero3: 4 ranks" in printed and "[2/2] asynchzp: 4 ranks" in printed

    results = json.loads((tmp_path / "results.json").read_text())
    assert {"config", "env", "arms"} <= results.keys()
    config = results["config"]
    assert config["zero3_knobs"] == "tuned"
    assert config["zero_optimization"] == zero3_knobs.zero3_knobs("tuned", config["zero_optimization"][
        "stage3_max_live_parameters"] // zero3_knobs.TUNED_LIVE_BLOCKS)
    assert config["tokens_per_optimizer_step"] == 4 * 2 * 32 * 2
    assert {"torch", "deepspeed", "ds_asynchzp", "python", "git_commit", "host_cpus", "date"} <= results["env"].keys()
    assert list(results["arms"]) == ["zero3", "asynchzp"]

    required = {"losses", "step_time_s", "bytes_per_step", "bytes_per_step_by_op", "peak_memory_bytes",
                "model_state_bytes", "optimizer_class", "tokens_per_s"}
    for entry in results["arms"].values():
        assert required <= entry.keys()
        assert len(entry["losses"]) == steps and len(entry["step_time_s"]) == steps
        assert entry["peak_memory_bytes"] > 0 and entry["model_state_bytes"]["total"] > 0
        assert entry["tokens_per_s"] > 0

    zero3, hzp = results["arms"]["zero3"], results["arms"]["asynchzp"]
    assert zero3["optimizer_class"] == "DeepSpeedZeroOptimizer_Stage3"
    assert "HierarchicalZeroOptimizer" in hzp["optimizer_class"]
    for ours, reference in zip(hzp["losses"], zero3["losses"]):
        assert ours == pytest.approx(reference, rel=1e-6)
    assert hzp["bytes_per_step"]["inter_node"] < zero3["bytes_per_step"]["inter_node"]
    # Every cross-node byte belongs to one flow of ZeRO++'s volume table: stock ZeRO-3 gathers in forward and
    # backward and reduces gradients; AsyncHZP crosses nodes in its step-boundary reduction and refresh only.
    for entry in (zero3, hzp):
        by_flow = entry["bytes_per_step_by_flow"]
        assert sum(v["inter_node"] for v in by_flow.values()) == pytest.approx(entry["bytes_per_step"]["inter_node"])
    inter = {flow: v["inter_node"] for flow, v in zero3["bytes_per_step_by_flow"].items()}
    assert min(inter["forward gather"], inter["backward gather"], inter["gradient reduction"]) > 0
    inter = {flow: v["inter_node"] for flow, v in hzp["bytes_per_step_by_flow"].items()}
    assert inter.get("forward gather", 0) == inter.get("backward gather", 0) == 0
    assert min(inter["gradient reduction"], inter["parameter refresh"]) > 0
    # The resolved layouts: stock ZeRO-3 shards everything over the world; AsyncHZP params and grads per node.
    sizes = ("world_size", "node_size", "param_shard_size", "grad_shard_size", "optimizer_shard_size")
    assert [zero3["layout"][k] for k in sizes] == [4, 2, 4, 4, 4]
    assert [hzp["layout"][k] for k in sizes] == [4, 2, 2, 2, 4]
    assert hzp["layout_text"]

    summary = (tmp_path / "summary.md").read_text()
    assert "| asynchzp" in summary and "inter ratio vs zero3" in summary
    assert "2/2/4" in summary and "master MB" in summary  # asynchzp's d_p/d_g/d_o and memory per role

    # AsyncHZP's own buffers beyond the model states (rank 0, at the end of the measured steps); stock has none.
    buffers, rings = hzp["package_buffer_bytes"], hzp["staging_rings"]
    assert zero3["package_buffer_bytes"] is None and buffers["total"] > 0
    assert [r["slots"] for r in rings] == [4] and rings[0]["capacity"] > 0
    assert buffers["grad_staging"] == sum(r["slots"] * r["capacity"] * r["element_size"] for r in rings)
    assert 0 < buffers["gathered_params_peak_in_use"] <= buffers["gathered_params_owned"]
    assert len(hzp["package_buffer_bytes_total_by_rank"]) == 4
    if (tmp_path / "report.md").exists():   # the report needs matplotlib
        assert "## Package buffers per rank" in (tmp_path / "report.md").read_text()


def test_node_link_counters_and_repeats():
    """Link counters come from one reader per node; repeats keep the first run's bytes and add min/median timings."""
    args = cli.parse_args(["--nproc", "2", "--node-size", "1", "--steps", "2", "--warmup-steps", "1",
                           "--micro-batch", "1", "--seq-len", "8", "--grad-accum", "1"])
    tokens = cli.tokens_per_optimizer_step(args)
    fast = [_fake_rank(0, [1.0, 1.0], [1.0, 2.0], [0.0, 8.0], 1, node_tx=[5, 100]),
            _fake_rank(1, [1.0, 1.0], [1.0, 2.0], [0.0, 8.0], 1, node_tx=[5, 300])]
    slow = [dict(r, steps=[dict(st, time_s=st["time_s"] * 2) for st in r["steps"]]) for r in fast]
    first, second = aggregate_arm(fast, 1, tokens), aggregate_arm(slow, 1, tokens)
    # Both nodes' steady-step counters (100 + 300) over 2 ranks.
    assert first["wire_bytes_inter_node_per_step"] == 200.0
    merged = merge_repeats([first, second])
    assert merged["step_time_stats_s"] == {"min": 2.0, "median": 3.0}
    assert merged["tokens_per_s_per_rank"]["min"] == tokens / 2 / 4.0
    assert merged["tokens_per_s"] == merged["tokens_per_s_per_rank"]["median"] * 2
    assert [r["losses_identical_to_first"] for r in merged["repeats"]] == [True, True]
    assert merged["bytes_per_step"] == first["bytes_per_step"]


def test_quantized_arms_set_their_key_alone_and_zeropp_runs_on_cpu():
    args = cli.parse_args(["--arms", "zero3,asynchzp,asynchzp-q,asynchzp-qw,asynchzp-qg:gradient_quantization_bits=4,"
                           "zeropp", "--nproc", "4", "--node-size", "2"])
    plain = cli.ds_config_for("asynchzp", args)
    for arm, key in (("asynchzp-q", "quantize_cross_node"), ("asynchzp-qw", "quantized_weights")):
        config = cli.ds_config_for(arm, args)
        assert config["async_hzp"] == dict(plain["async_hzp"], **{key: True})
        assert {k: v for k, v in config.items() if k != "async_hzp"} == {
            k: v for k, v in plain.items() if k != "async_hzp"}
    assert cli.ds_config_for("asynchzp-qg:gradient_quantization_bits=4", args)["async_hzp"] == {
        "node_size": 2, "quantized_gradients": True, "gradient_quantization_bits": 4}
    zeropp = cli.ds_config_for("zeropp", args)["zero_optimization"]
    assert zeropp["zero_quantized_weights"] and zeropp["zero_quantized_gradients"]
    assert zeropp["zero_hpz_partition_size"] == 2 and "async_hzp" not in cli.ds_config_for("zeropp", args)
    assert cli.arm_unavailable("zeropp", args) is None   # the worker installs the CPU quantizer
    assert cli.arm_unavailable("asynchzp-q", args) is None
    # An arm's own key cannot be overridden (it names the arm).
    with pytest.raises(arms.ArmSpecError, match="quantize_cross_node"):
        arms.parse_arm_spec("asynchzp-q:quantize_cross_node=false")


def test_moe_model_adds_autoep_and_the_family_table():
    args = cli.parse_args(["--arms", "zero3,hpz,asynchzp", "--model", "moe", "--ep-size", "2", "--nproc", "4",
                           "--node-size", "2"])
    for arm in args.arms:
        assert cli.ds_config_for(arm, args)["expert_parallel"] == {"enabled": True, "autoep_size": 2,
                                                                   "preset_model": "mixtral"}
    assert "refuses ZeRO++ hpZ" in cli.arm_unavailable("hpz", args)
    assert cli.run_config(args)["ep_size"] == 2
    dense_only = {"dense": {"intra_node": 1e6, "inter_node": 2e6}}
    families = {"dense": {"intra_node": 1e6, "inter_node": 2e6}, "expert": {"intra_node": 3e6, "inter_node": 4e6},
                "tokens": {"intra_node": 5e6, "inter_node": 0.0}}
    entry = {"bytes_per_step_by_family": families,
             "families": {"dense": {}, "expert:ep_size_2": {"world": 2, "node_size": 1, "param_shard_size": 1,
                                                           "grad_shard_size": 1, "optimizer_shard_size": 2}}}
    table = format_family_table({"arms": {"zero3": {"bytes_per_step_by_family": families}, "asynchzp": entry}})
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    cells = [c.strip() for c in rows["asynchzp"].split("|")]
    assert cells[2:8] == ["1.000", "2.000", "3.000", "4.000", "5.000", "0.000"], cells
    assert "1/1/2 of 2 (2 node(s) x 1)" in rows["asynchzp"]
    assert "stock: over the expert-data-parallel group" in rows["zero3"]
    assert format_family_table({"arms": {"zero3": {"bytes_per_step_by_family": dense_only}}}) is None
    with pytest.raises(SystemExit):
        cli.parse_args(["--model", "moe", "--ep-size", "3", "--nproc", "4"])
    with pytest.raises(SystemExit):  # expert groups of 2 ranks on one node and 1 on the other
        cli.parse_args(["--model", "moe", "--ep-size", "2", "--nproc", "6", "--node-size", "3"])


def test_network_auto_is_emulated_where_namespaces_can_be_made_else_loopback_with_the_reason(monkeypatch):
    from ds_asynchzp import netem

    args = cli.parse_args(["--arms", "zero3"])
    assert args.network == "auto"
    monkeypatch.setattr(netem, "preflight", lambda need_tun=False: None)
    assert "2 emulated nodes" in cli.resolve_network(args) and args.network == "emulated"

    def unavailable(need_tun=False):
        raise netem.EmulationUnavailable("emulated cluster needs root")

    monkeypatch.setattr(netem, "preflight", unavailable)
    args = cli.parse_args(["--arms", "zero3"])
    note = cli.resolve_network(args)
    assert args.network == "loopback" and "needs root" in note and "--network emulated" in note
    sweep = cli.parse_args(["--arms", "zero3", "--inter-node-bw", "100mbit,1gbit"])
    with pytest.raises(cli.NetworkUnavailable, match="a sweep"):
        cli.resolve_network(sweep)
    assert cli.resolve_network(cli.parse_args(["--network", "loopback"])) is None
