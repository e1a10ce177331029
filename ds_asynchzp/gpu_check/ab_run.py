"""The GPU check's A/B on a real launch: ``asynchzp-ab`` runs ``examples/train.py`` under the ``deepspeed`` launcher
on the GPUs present (one rank per GPU, NCCL, one node), arms zero3 and asynchzp, and puts its report next to the
check's own. The check passes when both arms recorded their steps and AsyncHZP's losses are stock ZeRO-3's within
1e-6 relative (fp32, `examples/ds_config_zero3.json`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict

REPO = Path(__file__).resolve().parents[2]
LOSS_RTOL = 1e-6


def ab_command(out: Path, ranks: int, steps: int) -> list:
    deepspeed = shutil.which("deepspeed") or str(Path(sys.executable).with_name("deepspeed"))
    return [sys.executable, "-m", "ds_asynchzp.bench.ab", "--arms", "zero3,asynchzp", "--steps", str(steps),
            "--config", str(REPO / "examples" / "ds_config_zero3.json"), "--out", str(out), "--",
            deepspeed, "--num_gpus", str(ranks), str(REPO / "examples" / "train.py"), "--deepspeed_config", "{config}",
            "--steps", str(steps + 100)]


def run_ab_check(out: Path, ranks: int, steps: int, timeout_s: float, env: dict) -> Dict:
    """Run the A/B; one check entry (its report path in the details)."""
    name = "asynchzp-ab on examples/train.py"
    if not (REPO / "examples" / "train.py").is_file():
        return {"name": name, "passed": True, "skipped": True, "summary": "skipped: examples/ is not next to the "
                "installed package (run from a clone)", "details": {}}
    command = ab_command(out, ranks, steps)
    try:
        done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"name": name, "passed": False, "summary": f"did not end in {timeout_s:g} s",
                "details": {"command": " ".join(command)}}
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    arms = results.get("arms") or {}
    details = {"command": " ".join(command), "report": str(out / "report.md"), "exit_code": done.returncode,
               "failed_arms": results.get("failed_arms") or {}, "tail": done.stderr[-2000:]}
    if done.returncode != 0 or set(arms) != {"zero3", "asynchzp"}:
        return {"name": name, "passed": False, "summary": f"exit {done.returncode}; arms recorded: "
                f"{', '.join(arms) or 'none'}", "details": details}
    zero3, hzp = arms["zero3"], arms["asynchzp"]
    rel = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(hzp["losses"], zero3["losses"]))
    speed = zero3["median_step_time_s"] / hzp["median_step_time_s"]
    details.update({"max_rel_loss_diff": rel, "speed_up": speed,
                    "inter_node_bytes": {arm: entry["bytes_per_step"]["inter_node"] for arm, entry in arms.items()},
                    "device_memory_peak_bytes": {arm: entry.get("device_memory_peak_bytes")
                                                 for arm, entry in arms.items()}})
    return {"name": name, "passed": rel <= LOSS_RTOL,
            "summary": f"{ranks} rank(s), {steps} steps per arm: losses within {rel:.1e} of zero3's (bound "
                       f"{LOSS_RTOL:g}); asynchzp's median step {speed:.2f}x zero3's speed; report {out / 'report.md'}",
            "details": details}
