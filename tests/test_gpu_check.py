"""asynchzp-gpu-check, as far as it runs without a GPU: it refuses cleanly, its checks fail on what they must
catch, its report is written, and every part that can run on CPU ranks does (`--cpu-dry-run`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_asynchzp.formulas import traffic
from ds_asynchzp.gpu_check import cli, copy_count
from ds_asynchzp.models.presets import element_counts
from ds_asynchzp.gpu_check.report import render_markdown, verdict, write_report


def _result(checks):
    return {"date": "2026-11-25", "commit": "abc123", "device": {"name": "NVIDIA H100 80GB HBM3", "count": 1,
                                                                  "memory_gib": 79.1},
            "versions": {"torch": "2.13.0", "deepspeed": "0.19.8", "cuda": "13.0"},
            "settings": {"model": "small", "steps": 50}, "checks": checks}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the refusal cannot be shown")
def test_without_cuda_it_refuses_with_a_clear_message(capsys, tmp_path):
    assert cli.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_report_has_date_commit_device_and_every_check(tmp_path):
    result = _result([
        {"name": "ops against reference", "passed": True, "summary": "20 pairs, all equal",
         "details": {"rows": [{"op": "pack", "dtype": "fp32", "max_abs_err": 0.0}]}},
        {"name": "CUDA sanitizer", "passed": False, "summary": "reports in rank0.log", "details": {}},
        {"name": "communication", "passed": None, "measured": True, "summary": "times", "details": {}},
        {"name": "memory flat after warm-up", "passed": None, "summary": "did not run", "details": {}},
    ])
    json_path, md_path = write_report(result, tmp_path / "out")
    assert json_path.name == "gpu-check-2026-11-25-nvidia-h100-80gb-hbm3.json" and md_path.suffix == ".md"
    assert json.loads(json_path.read_text())["commit"] == "abc123"
    text = md_path.read_text()
    assert "2026-11-25" in text and "`abc123`" in text and "NVIDIA H100" in text
    assert "| CUDA sanitizer | **FAIL** |" in text and "| communication | measured |" in text
    assert "| memory flat after warm-up | not run |" in text and "| pack | fp32 | 0 |" in text
    assert "a check failed" in text and not verdict(result)
    result["checks"][1]["passed"] = True
    assert verdict(result) and "every check passed" in render_markdown(result)


def _ranks(losses, reserved=(100, 100), retries=(0, 0)):
    memory = {"after_warmup": {"reserved": reserved[0], "alloc_retries": retries[0]},
              "end": {"reserved": reserved[1], "alloc_retries": retries[1]}}
    return [{"losses": list(losses), "step_ms": [10.0, 11.0], "memory": memory, "comm_busy_ms": {"gather": 1.0}}]


def _by_name(checks):
    return {check["name"]: check for check in checks}


def test_the_training_checks_fail_on_what_they_must_catch():
    good = {"zero3": _ranks([2.0, 1.5]), "sync": _ranks([2.0, 1.5]), "async": _ranks([2.0, 1.5])}
    checks = _by_name(cli._training_checks(good, {}, [], 2, "nccl"))
    assert all(check["passed"] is not False for check in checks.values()), checks
    assert checks["CUDA sanitizer"]["passed"] and checks["losses equal stock ZeRO-3"]["passed"]
    with_offload = dict(good, **{"zero3-offload": _ranks([2.0, 1.4]), "offload": _ranks([2.0, 1.4])})
    assert _by_name(cli._training_checks(with_offload, {}, [], 2, "nccl"))[
        "offload losses equal stock ZeRO-3 offload"]["passed"]

    # A race changes a loss; memory grows; the sanitizer reports; an arm fails to run.
    racy = dict(good, **{"async": _ranks([2.0, 1.5001], reserved=(100, 120), retries=(0, 3))})
    checks = _by_name(cli._training_checks(racy, {"sanitized": "rank 1: exit code 1"}, ["rank0.log"], 2, "nccl"))
    assert checks["threads and sleeps change no loss"]["passed"] is False
    assert checks["losses equal stock ZeRO-3"]["passed"] is False
    assert checks["memory flat after warm-up"]["passed"] is False
    assert checks["CUDA sanitizer"]["passed"] is False and checks["training arms ran"]["passed"] is False
    drifting = dict(with_offload, offload=_ranks([2.0, 1.4001], reserved=(100, 140)))
    checks = _by_name(cli._training_checks(drifting, {}, [], 2, "nccl"))
    assert checks["offload losses equal stock ZeRO-3 offload"]["passed"] is False
    assert checks["memory flat after warm-up (offload)"]["passed"] is False


def test_a_cpu_dry_run_runs_every_part_that_needs_no_gpu(tmp_path, deepspeed_cpu_ops, capsys):
    code = cli.main(["--cpu-dry-run", "--out", str(tmp_path), "--model", "tiny", "--steps", "2", "--warmup", "1",
                     "--seq-len", "32", "--micro-batch", "2", "--sizes", "64K", "--arm-timeout", "300",
                     "--ab-steps", "2", "--op-cases", "12", "--op-min-time", "0"])
    report = json.loads(next(tmp_path.glob("*.json")).read_text())
    checks = _by_name(report["checks"])
    assert code == 0, json.dumps(report["checks"], indent=1)[:4000]
    # The compiled CPU ops against the reference; the three arms trained to the same losses.
    assert checks["ops against reference"]["passed"], checks["ops against reference"]
    assert {row["op"] for row in checks["ops against reference"]["details"]["rows"]} >= {
        "pack", "unpack", "unpack_gathered", "bucket_add", "bucket_add accumulate", "quantize", "dequantize",
        "dequantize_reduce"}
    assert checks["ops bandwidth"]["details"]["rows"] and checks["ops goals"]["summary"].startswith("not measured")
    assert checks["threads and sleeps change no loss"]["passed"]
    assert checks["losses equal stock ZeRO-3"]["passed"]
    assert checks["offload losses equal stock ZeRO-3 offload"]["passed"]   # DeepSpeedCPUAdam on both sides
    assert "CUDA sanitizer" not in checks and "memory flat after warm-up" not in checks   # CUDA only
    assert {row["arm"] for row in checks["communication"]["details"]["rows"]} == {
        "zero3", "sync", "async", "zero3-offload", "offload"}
    # asynchzp-ab on examples/train.py under the deepspeed launcher, its report next to the check's.
    ab = checks["asynchzp-ab on examples/train.py"]
    assert ab["passed"] and ab["details"]["max_rel_loss_diff"] <= 1e-6, ab
    assert (Path(ab["details"]["report"])).is_file() and Path(ab["details"]["report"]).parent.parent == tmp_path


def test_an_arm_that_fails_or_times_out_keeps_the_others_results(tmp_path, monkeypatch):
    """One arm's time-out (on a GPU the sanitized arm is the slow one) or crash must not lose the other arms'
    checks, and the report carries the end of the failure (the rank logs live in a temporary directory)."""
    from ds_asynchzp.bench import launch

    def fake_launch(target, nproc, node_size, payload, **kwargs):
        name = kwargs["workdir"].rsplit("/", 1)[-1]
        if name == "async":
            raise TimeoutError(f"{target} timed out after 38s; ranks still running: [0, 1]\nlast lines: stuck")
        if name == "sync":
            raise launch.RankFailure("rank 1 of 2 failed: exit code 1\nTraceback ...\nValueError: boom", 1, 1,
                                     "rank1.log")
        return _ranks([2.0, 1.5])

    monkeypatch.setattr(launch, "launch_local", fake_launch)
    args = cli.argparse.Namespace(ranks=2, model="tiny", grad_accum=1, micro_batch=1, warmup=1, steps=2, seq_len=8,
                                  sleep_cycles=0, sanitizer=True, sanitizer_steps=1, arm_timeout=1.0, offload=False)
    checks = _by_name(cli.run_training(args, cuda=False, work=tmp_path))
    ran = checks["training arms ran"]
    assert ran["passed"] is False and "sync:" in ran["summary"] and "async:" in ran["summary"]
    assert "ValueError: boom" in ran["details"]["failure tails"]["sync"]
    assert "timed out" in ran["details"]["failure tails"]["async"]
    assert {row["arm"] for row in checks["communication"]["details"]["rows"]} == {"zero3"}
    text = render_markdown(_result(list(checks.values())))
    assert "ValueError: boom" in text


def test_the_report_shows_the_asynchzp_arms_package_buffers(tmp_path):
    buffers = {"gathered_params_owned": 3 * 2**20, "gathered_params_in_use": 0,
               "gathered_params_peak_in_use": 2 * 2**20, "grad_staging": 4 * 2**20, "gather_scratch": 2**20,
               "reduce_scratch": 2**19, "boundary_scratch": 2**19, "error_feedback": 0, "host_copy_staging": 2**20,
               "total": 10 * 2**20}
    ours = [dict(r, package_buffer_bytes=buffers, model_state_bytes=40 * 2**20,
                 memory=dict(r["memory"], max_allocated=100 * 2**20)) for r in _ranks([2.0, 1.5])]
    results = {"zero3": _ranks([2.0, 1.5]), "sync": ours, "async": ours}
    check = _by_name(cli._training_checks(results, {}, None, 2, "nccl"))["package buffers per rank"]
    assert check["passed"] is None and check["measured"]
    assert [row["arm"] for row in check["details"]["rows"]] == ["sync", "async"]    # stock records none
    text = render_markdown(_result([check]))
    assert "| package buffers per rank | measured |" in text
    table = text.split("## package buffers per rank", 1)[1]
    header = [c.strip() for c in table.strip().splitlines()[0].strip("|").split("|")]
    cells = [c.strip() for c in table.strip().splitlines()[2].strip("|").split("|")]
    row = dict(zip(header, cells))
    assert row["arm"] == "sync" and row["gather pool owned MiB"] == "3" and row["grad staging ring MiB"] == "4"
    assert row["host-copy fp32 MiB"] == "1" and row["total MiB"] == "10"
    assert row["model states MiB"] == "40" and row["max allocated MiB"] == "100"
    assert "trimmed once per step" in table
    assert "package buffers per rank" not in _by_name(cli._training_checks({"zero3": _ranks([2.0])}, {}, None, 2,
                                                                            "nccl"))


def test_quick_fits_a_short_slot_and_explicit_flags_win(monkeypatch, tmp_path):
    seen = {}

    def fake_run_checks(args):
        seen.update(vars(args))
        return _result([])

    monkeypatch.setattr(cli, "run_checks", fake_run_checks)
    assert cli.main(["--cpu-dry-run", "--quick", "--steps", "9", "--out", str(tmp_path)]) == 0
    assert seen["steps"] == 9 and seen["warmup"] == cli.QUICK["warmup"] and seen["ab"] is False
    assert seen["sanitizer_steps"] == 1 and seen["op_cases"] == cli.QUICK["op_cases"]
    cli.main(["--cpu-dry-run", "--out", str(tmp_path)])
    assert seen["steps"] == 50 and seen["ab"] is True and seen["op_cases"] == 300


def test_copies_are_counted_from_the_profilers_memcpy_records():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "args": {"bytes": 4096}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "args": {"bytes": 16}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "args": {"bytes": 8192}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "args": {"bytes": 10**9}},
        {"ph": "X", "cat": "kernel", "name": "void copy_kernel<float>()", "args": {}}]}
    assert copy_count.copy_bytes_in_trace(trace) == {"host_to_device": 4112, "device_to_host": 8192}


def test_the_counted_ratio_is_set_against_the_formulas():
    """Counts equal to the formulas' pass; AsyncHZP's copies 1.5 times the formula's fail."""
    world, node, gas, model, seq = 2, 2, 4, "tiny", 32
    formula = {}
    for arm, formula_arm in (("zero3-offload", "zero3"), ("offload", "asynchzp")):
        counts = element_counts(model, 0, seq, world)
        inputs = traffic.TrafficInputs(world, node, gas, counts["gathered"], counts["reduced"], counts["trainable"])
        copies = traffic.host_device_bytes(formula_arm, inputs, world)
        formula[arm] = {"host_to_device": copies["to_device"], "device_to_host": copies["to_host"]}

    def results(scale):
        return {arm: [{"host_device_bytes_counted": {d: v * (scale if arm == "offload" else 1)
                                                     for d, v in formula[arm].items()}}] * world
                for arm in formula}

    check = copy_count.copy_check(results(1.0), world, node, gas, model, seq)
    assert check["passed"] and "ratio 0.200 (the formulas': 0.200" in check["summary"], check["summary"]
    assert not copy_count.copy_check(results(1.5), world, node, gas, model, seq)["passed"]
    assert copy_count.copy_check({"offload": [{"host_device_bytes_counted": None}]}, world, node, gas, model,
                                 seq) is None


def test_a_job_timer_brackets_every_job_of_a_communication_thread():
    """The GPU check times each communication job on its stream through the thread's job timers: the timer sees
    the job start (thread name and stream) and end, in order, and stops seeing jobs once removed."""
    from ds_asynchzp.scheduler import comm_thread

    seen = []

    def timer(name, stream):
        seen.append(("start", name, stream))
        return lambda: seen.append(("end", name))

    thread = comm_thread.CommThread("probe", timeout=30)
    comm_thread.add_job_timer(timer)
    try:
        assert thread.submit(lambda: seen.append(("job",)) or 7, "a job", "probe_group").wait() == 7
    finally:
        comm_thread.remove_job_timer(timer)
    assert thread.submit(lambda: 8, "untimed job", "probe_group").wait() == 8
    assert thread.stop()
    assert seen == [("start", "probe", None), ("job",), ("end", "probe")]
