"""`asynchzp-ab`: the A/B on the user's own training job.

The arms' ds_configs from a user's config; the refusals before any arm runs; every failure named with its arm while
the finished arms stay in the report (a command that cannot start, a script that never builds an engine through
the package, a rank that dies, a script that ends early); and the runs the tool is for: examples/train.py under the
deepspeed launcher and examples/hf_trainer.py (HF Trainer through register()) on 4 CPU ranks as 2 emulated nodes,
each arm ended by the recorder after --steps, AsyncHZP's losses equal to stock ZeRO-3's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_asynchzp.measure.recording import PROGRESS_MARK, RECORD_KEY
from ds_asynchzp.bench import ab
from ds_asynchzp.bench.arms import arm_ds_config, parse_arm_spec
from ds_asynchzp.bench.launch import free_port
from tests.cluster_harness import CLI as CLUSTER_CLI
from tests.cluster_harness import REPO_ROOT, needs_netns

EXAMPLES = REPO_ROOT / "examples"
AB = [str(Path(sys.executable).with_name("asynchzp-ab"))] if Path(sys.executable).with_name("asynchzp-ab").exists() \
    else [sys.executable, "-m", "ds_asynchzp.bench.ab"]
DEEPSPEED = str(Path(sys.executable).with_name("deepspeed"))
RUN_TIMEOUT_S = 900
# The arms of the acceptance run: stock ZeRO-3, ZeRO++ hpZ, ZeRO++ (hpZ + qwZ + qgZ), AsyncHZP.
ALL_ARMS = "zero3,hpz,zeropp,asynchzp"


def _user_config(**zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, **zero}, "async_hzp": {"enabled": False, "prefetch_depth": 1}}


# --------------------------------------------------------------------------------------------- configs
def test_each_arm_changes_only_its_own_keys_of_the_users_config():
    shared = _user_config(zero_hpz_partition_size=4, zero_quantized_weights=True, reduce_bucket_size=1000)
    zero3 = arm_ds_config(shared, parse_arm_spec("zero3"), 2)
    assert "async_hzp" not in zero3
    assert zero3["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 1000}
    hpz = arm_ds_config(shared, parse_arm_spec("hpz"), 2)["zero_optimization"]
    assert hpz == {"stage": 3, "reduce_bucket_size": 1000, "zero_hpz_partition_size": 2}
    zeropp = arm_ds_config(shared, parse_arm_spec("zeropp"), 2)["zero_optimization"]
    assert (zeropp["zero_hpz_partition_size"], zeropp["zero_quantized_weights"],
            zeropp["zero_quantized_gradients"]) == (2, True, True)
    hzp = arm_ds_config(shared, parse_arm_spec("asynchzp:param_shard_size=1"), 2)
    # The user's section is kept, "enabled": false dropped (the arm always enables it), the override added, and the
    # ranks per node the tool knows (Accelerate rewrites LOCAL_WORLD_SIZE on CPU ranks) unless the section names them.
    assert hzp["async_hzp"] == {"node_size": 2, "prefetch_depth": 1, "param_shard_size": 1}
    own = dict(shared, async_hzp={"node_size": 4})
    assert arm_ds_config(own, parse_arm_spec("asynchzp"), 2)["async_hzp"]["node_size"] == 4
    assert "zero_hpz_partition_size" not in hzp["zero_optimization"]
    assert arm_ds_config(shared, parse_arm_spec("asynchzp-sync"), 2)["async_hzp"]["async_comm"] is False
    assert shared["async_hzp"] == {"enabled": False, "prefetch_depth": 1}, "the user's config is not modified"
    # What each arm changes, as the report lists it: exactly the keys above, the recorder's key aside.
    assert ab.changed_keys(shared, zero3) == {"zero_optimization.zero_hpz_partition_size": None,
                                              "zero_optimization.zero_quantized_weights": None, "async_hzp": None}
    assert ab.changed_keys(shared, {**zero3, "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000,
                                                                   "zero_hpz_partition_size": 2}}) == {
        "zero_optimization.zero_hpz_partition_size": 2, "zero_optimization.zero_quantized_weights": None,
        "async_hzp": None}
    assert ab.changed_keys(shared, dict(hzp, async_hzp_record={"arm": "x"}))["async_hzp"] == hzp["async_hzp"]
    assert ab.changed_keys(shared, shared) == {}


def test_the_record_key_goes_into_every_arm_and_the_command_gets_the_config(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(_user_config()))
    args = ab.parse_args(["--config", str(config), "--steps", "3", "--out", str(tmp_path / "out"), "--",
                          "deepspeed", "--num_gpus", "2", "train.py", "--deepspeed_config={config}"])
    assert args.node_size == 2 and [s.name for s in args.specs] == ALL_ARMS.split(",")
    written = ab.arm_config(args, args.specs[3], tmp_path / "records", 0.0)
    assert written[RECORD_KEY]["arm"] == "asynchzp" and written[RECORD_KEY]["steps"] == 3
    assert written[RECORD_KEY]["expected_optimizer"] == "HierarchicalZeroOptimizer"
    assert written[RECORD_KEY]["read_link_counter"] is False


@pytest.mark.parametrize("argv, message", [
    (["--config", "CFG", "--", "deepspeed", "--num_gpus", "2", "train.py"], "has no {config}"),
    (["--config", "CFG"], "give the launch command after --"),
    (["--config", "CFG", "--", "python", "train.py", "{config}"], "give --node-size"),
    (["--config", "CFG", "--steps", "2", "--warmup-steps", "2", "--", "x", "--num_gpus", "1", "{config}"],
     "--warmup-steps 2 must be < --steps 2"),
    (["--config", "CFG", "--arms", "zero3,nope", "--", "x", "--num_gpus", "1", "{config}"], "unknown arm"),
    (["--config", "STAGE2", "--", "x", "--num_gpus", "1", "{config}"], "zero_optimization.stage is 2"),
    (["--config", "RECORDED", "--", "x", "--num_gpus", "1", "{config}"], f"holds '{RECORD_KEY}'"),
    (["--config", "MISSING", "--", "x", "--num_gpus", "1", "{config}"], "cannot read it"),
    (["--config", "CFG", "--arms", "asynchzp:param_shard_size=0", "--", "x", "--num_gpus", "2", "{config}"],
     "arm asynchzp:param_shard_size=0: "),
])
def test_bad_input_is_refused_before_any_arm_runs(tmp_path, capsys, argv, message):
    files = {"CFG": _user_config(), "STAGE2": {"zero_optimization": {"stage": 2}},
             "RECORDED": {**_user_config(), RECORD_KEY: {}}}
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    argv = [str(tmp_path / a) if a in (*files, "MISSING") else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        ab.parse_args(["--out", str(tmp_path / "out"), *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists(), "nothing runs before the input is checked"


# ------------------------------------------------------------------------------------------- running
def _run_ab(*argv: str, timeout: float = RUN_TIMEOUT_S, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    run_env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([*AB, *argv], cwd=REPO_ROOT, env=run_env, capture_output=True, text=True, timeout=timeout)


def test_a_command_that_cannot_start_or_never_builds_an_engine_is_named_with_its_arm(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(_user_config()))
    missing = _run_ab("--config", str(config), "--arms", "zero3", "--node-size", "1", "--out", str(tmp_path / "a"),
                      "--", "no-such-launcher-xyz", "{config}", timeout=60)
    assert missing.returncode == 1, missing.stderr
    assert "arm zero3: cannot run the launch command 'no-such-launcher-xyz'" in missing.stderr
    silent = _run_ab("--config", str(config), "--arms", "zero3,asynchzp", "--node-size", "1", "--out",
                     str(tmp_path / "b"), "--", sys.executable, "-c", "import sys; print(sys.argv[1])", "{config}",
                     timeout=60)
    assert silent.returncode == 1
    for arm in ("zero3", "asynchzp"):
        assert f"arm {arm}: the job ended (exit 0) without recording a step" in silent.stderr, silent.stderr
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    assert results["arms"] == {} and set(results["failed_arms"]) == {"zero3", "asynchzp"}
    # A script that ends normally before --steps (rank 0's recorder printed one step of three).
    short = _run_ab("--config", str(config), "--arms", "zero3", "--steps", "3", "--node-size", "1", "--out",
                    str(tmp_path / "c"), "--", sys.executable, "-c",
                    f"print('{PROGRESS_MARK} 1/3 arm zero3 loss 1.0')", "{config}", timeout=60)
    assert short.returncode == 1
    assert "arm zero3: the script ended after 1 of 3 optimizer steps: give --steps 1 or less" in short.stderr


@pytest.mark.usefixtures("deepspeed_cpu_ops")
def test_a_dead_rank_fails_its_arm_and_the_finished_arm_stays_in_the_report(tmp_path):
    """Under torchrun, one node of 2 ranks: zero3 trains; under asynchzp rank 1 dies in its second optimizer step
    (planted by tests/_ab_faulty_train.py)."""
    out, before = tmp_path / "out", _workspaces()
    try:
        done = _run_ab("--config", str(EXAMPLES / "ds_config_zero3.json"), "--arms", "zero3,asynchzp",
                       "--steps", "3", "--out", str(out), "--", sys.executable, "-m", "torch.distributed.run",
                       "--nproc-per-node", "2", "--master-port", str(free_port()), "tests/_ab_faulty_train.py",
                       "--deepspeed_config", "{config}", "--steps", "20", "--die-arm", "asynchzp",
                       "--marks", str(tmp_path / "marks" / "{arm}"))
    finally:
        for path in _workspaces() - before:
            path.unlink(missing_ok=True)  # the dead job's: its ranks never reached the recorder's clean-up
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "arm asynchzp: the launch command exited with code 1 after 1 of 3 optimizer steps. Last lines of" \
        in done.stderr, done.stderr[-3000:]
    assert "1 arm(s) failed: asynchzp" in done.stderr
    results = json.loads((out / "results.json").read_text())
    assert list(results["arms"]) == ["zero3"] and set(results["failed_arms"]) == {"asynchzp"}
    assert len(results["arms"]["zero3"]["losses"]) == 3
    report = (out / "report.md").read_text()
    assert "`asynchzp`: **failed**" in report and "| zero3 " in report
    # The arm that finished ended the script as sys.exit(0) would: its finally blocks and exit handlers ran, in
    # the folder the command named with {arm}, with the arm's name in the environment.
    marks = sorted(p.name for p in (tmp_path / "marks" / "zero3").iterdir())
    assert marks == ["rank0.atexit", "rank0.finally", "rank1.atexit", "rank1.finally"], marks
    assert (tmp_path / "marks" / "zero3" / "rank1.atexit").read_text() == "zero3"
    assert "note: whatever the script writes" not in done.stderr   # the command kept the arms apart


def test_folders_shared_by_every_arm_are_warned_of_before_the_first(capsys):
    command = ["deepspeed", "train.py", "--deepspeed_config", "{config}", "--output_dir", "out",
               "--save_dir=ckpt/{arm}", "--logging-dir", "logs"]
    assert ab.shared_output_folders(command) == ["--output_dir out", "--logging-dir logs"]
    ab.warn_of_shared_folders(command)
    err = capsys.readouterr().err
    assert "warning" in err and "--output_dir out; --logging-dir logs" in err and "ckpt" not in err
    ab.warn_of_shared_folders(["deepspeed", "train.py", "--deepspeed_config", "{config}"])
    assert "note: whatever the script writes" in capsys.readouterr().err
    ab.warn_of_shared_folders(["deepspeed", "train.py", "--deepspeed_config", "{config}", "--output_dir", "o/{arm}"])
    assert capsys.readouterr().err == ""


def _check_acceptance_run(out: Path, steps: int) -> dict:
    results = json.loads((out / "results.json").read_text())
    arms = results["arms"]
    assert list(arms) == ALL_ARMS.split(","), results.get("failed_arms")
    for arm, entry in arms.items():
        # Every arm was ended by the recorder after --steps (the script asked for more), on all 4 ranks.
        assert len(entry["losses"]) == steps and len(entry["per_rank"]) == 4, arm
        assert entry["median_step_time_s"] > 0 and entry["peak_memory_bytes"] > 0, arm
        assert entry["model_state_bytes"]["total"] > 0, arm
        assert results["runs"][arm]["exit_code"] == 0
        log = Path(results["runs"][arm]["log"]).read_text()
        assert f"{steps} optimizer steps recorded" in log, arm
    zero3, hzp = arms["zero3"], arms["asynchzp"]
    assert hzp["losses"][-1] < hzp["losses"][0], hzp["losses"]
    assert hzp["optimizer_class"] == "HierarchicalZeroOptimizer"
    assert zero3["optimizer_class"] == "DeepSpeedZeroOptimizer_Stage3"
    # fp32, the same sums: within 1e-6 relative (the parity bound; bit-identical on this placement in practice).
    for a, b in zip(hzp["losses"], zero3["losses"]):
        assert abs(a - b) <= 1e-6 * abs(b), (hzp["losses"], zero3["losses"])
    flows = hzp["bytes_per_step_by_flow"]
    assert flows and sum(v["inter_node"] for v in flows.values()) > 0
    assert hzp["bytes_per_step"]["inter_node"] < 0.5 * zero3["bytes_per_step"]["inter_node"]
    # The node links' own counters were read (asynchzp-cluster): what crossed between the emulated nodes.
    assert hzp["wire_bytes_inter_node_per_step"] < zero3["wire_bytes_inter_node_per_step"]
    report = (out / "report.md").read_text()
    assert report.splitlines()[2].startswith("**Summary.**") and "the speed" in report.splitlines()[2]
    assert "## Bytes by flow (measured)" in report and "| asynchzp | " in report
    return results


def _workspaces() -> set:
    return set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))


def _cluster(*command: str) -> list[str]:
    return [*CLUSTER_CLI, "--nodes", "2", "--ranks-per-node", "2", "--bw", "200mbit", "--", DEEPSPEED, "--num_gpus",
            "2", *command]


@needs_netns
@pytest.mark.usefixtures("deepspeed_cpu_ops")
def test_train_example_under_the_deepspeed_launcher_on_two_emulated_nodes(tmp_path):
    out, before = tmp_path / "out", _workspaces()
    done = _run_ab("--config", str(EXAMPLES / "ds_config_zero3.json"), "--arms", ALL_ARMS, "--steps", "3",
                   "--out", str(out), "--", *_cluster("examples/train.py", "--deepspeed_config", "{config}",
                                                      "--steps", "50"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = _check_acceptance_run(out, 3)
    assert _workspaces() <= before, "DeepSpeed's CPU communication workspaces of the ended jobs were left behind"
    assert max(abs(a - b) for a, b in zip(results["arms"]["asynchzp"]["losses"],
                                          results["arms"]["zero3"]["losses"])) == 0.0


@needs_netns
@pytest.mark.usefixtures("deepspeed_cpu_ops")
def test_hf_trainer_example_through_register_on_two_emulated_nodes(tmp_path):
    out = tmp_path / "out"
    done = _run_ab("--config", str(EXAMPLES / "ds_config_hf_trainer.json"), "--arms", ALL_ARMS, "--steps", "3",
                   "--out", str(out), "--", *_cluster("examples/hf_trainer.py", "--deepspeed_config", "{config}",
                                                      "--steps", "50", "--output-dir", str(tmp_path / "trainer")))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = _check_acceptance_run(out, 3)
    # Accelerate writes LOCAL_WORLD_SIZE=1 for the Trainer: the layout must still be 2 nodes of 2, from the launcher.
    layout = results["arms"]["asynchzp"]["layout"]
    assert (layout["num_nodes"], layout["node_size"], layout["param_shard_size"]) == (2, 2, 2), layout
    assert "was lost" not in Path(results["runs"]["asynchzp"]["log"]).read_text()


def test_ctrl_c_stops_the_running_arm_and_says_where_the_finished_ones_are(tmp_path):
    import os
    import signal
    import time

    config = tmp_path / "ds.json"
    config.write_text(json.dumps(_user_config()))
    marker = tmp_path / "child.pid"
    child = f"import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    proc = subprocess.Popen([*AB, "--config", str(config), "--arms", "zero3", "--node-size", "1", "--out",
                             str(tmp_path / "out"), "--", sys.executable, "-c", child, "{config}"],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), "the arm's command never started"
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted; the arms that finished are in" in err
    time.sleep(0.5)
    assert not os.path.exists(f"/proc/{int(marker.read_text())}"), "the arm's command outlived the tool"
