"""``asynchzp-ab``: the A/B of ZeRO-3, ZeRO++ and AsyncHZP on the user's own training job.

    asynchzp-ab --arms zero3,hpz,zeropp,asynchzp --steps 20 --config ds_config.json --out ab_out -- \\
        deepspeed --num_gpus 8 train.py --deepspeed_config {config}

Per arm, in order: the arm's ds_config is written from the user's (`arms.arm_ds_config`, as the bench writes its
own), with an ``"async_hzp_record"`` key; ``{config}`` in the command becomes its path and ``{arm}`` the arm's
name (also in ``$ASYNCHZP_AB_ARM``), so that each arm writes its outputs apart (output folders shared by every arm
are warned of before the first); the command runs. Inside every rank the engine that ``ds_asynchzp.initialize`` or
``register()`` builds records each optimizer step and, after ``--steps`` of them, writes the rank's record and ends
the script as ``sys.exit(0)`` would (`measure.recording`). The
records become the bench's results.json entries (`aggregate`), table (`table`) and report (`report`).

Any launcher works that starts the script on every rank with the tool's environment and filesystem: ``deepspeed``,
``torchrun``, ``asynchzp-cluster -- deepspeed ...`` (emulated nodes; then the node links' byte counters are read
too). The record directory must be visible to every rank (on a real cluster: a shared filesystem).

An arm that fails (the command cannot start, the script never builds an engine through the package, a rank dies,
the script ends before ``--steps``) is named with the reason and its log's last lines; the arms that finished stay
in results.json and the report, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..measure.json_files import write_json_atomically
from ..measure.recording import PROGRESS_MARK, RECORD_KEY
from ..runtime.observers import ENVIRONMENT_VARIABLE
from .aggregate import aggregate_arm, merge_repeats
from .arg_types import non_negative_int, positive_float, positive_int
from .arms import ARMS, ArmSpecError, arm_dir_name, arm_ds_config, parse_arm_specs
from .environment import environment
from .offload import host_state_bytes

PROG = "asynchzp-ab"
DEFAULT_ARMS = "zero3,hpz,zeropp,asynchzp"
PLACEHOLDER = "{config}"
# In the command, the arm's name (as its log and record folders spell it), so that each arm writes its own outputs;
# the arm's environment carries it too, for a script to read.
ARM_PLACEHOLDER = "{arm}"
ARM_VARIABLE = "ASYNCHZP_AB_ARM"
# Flags by which launch commands commonly name where a script writes its outputs and checkpoints (HF Trainer,
# TRL, Accelerate, the DeepSpeed examples); a value without {arm} is shared by all arms.
OUTPUT_FLAGS = ("--output_dir", "--output-dir", "--save_dir", "--save-dir", "--checkpoint_dir", "--checkpoint-dir",
                "--ckpt_dir", "--ckpt-dir", "--logging_dir", "--logging-dir", "--save", "--out_dir", "--out-dir")
# The recorder every arm's ranks load (also the package's entry point of the same value, in pyproject.toml).
RECORDER = "ds_asynchzp.measure.recording:observer"
# Launcher flags that give the ranks per node, in the order they are looked for.
NODE_SIZE_FLAGS = ("--num_gpus", "--num-gpus", "--nproc_per_node", "--nproc-per-node")
LOG_TAIL_LINES = 25
STOP_GRACE_S = 15.0


class UsageError(Exception):
    """Something to fix before any arm runs; the message names the flag or key and the fix."""


class ArmFailure(Exception):
    """One arm did not record its steps; the message names the arm and why."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{PROG} --config DS_CONFIG --out DIR [options] -- COMMAND ... {PLACEHOLDER} ...",
        description="Run your own training command once per arm (stock ZeRO-3, ZeRO++, AsyncHZP) and compare them: "
                    "loss, step time, bytes inside and between nodes by flow, memory. The script must build its "
                    "engine with ds_asynchzp.initialize, or call ds_asynchzp.register() before its framework "
                    "calls deepspeed.initialize.",
        epilog=__doc__.split("\n\n")[1])
    parser.add_argument("--arms", default=DEFAULT_ARMS,
                        help=f"comma-separated arms, in order; known: {', '.join(ARMS)}; an AsyncHZP arm takes "
                             "overrides of its async_hzp section, BASE:key=value[:key=value]... "
                             "(default: %(default)s)")
    parser.add_argument("--config", required=True, type=Path,
                        help="your ZeRO-3 ds_config (JSON); each arm's is written from it into OUT/configs/")
    parser.add_argument("--steps", type=positive_int, default=20,
                        help="optimizer steps recorded per arm; then the job ends (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=non_negative_int, default=1,
                        help="first optimizer steps left out of step-time and byte statistics; must be < --steps "
                             "(default: %(default)s)")
    parser.add_argument("--node-size", type=positive_int, default=None,
                        help="ranks per node (hpZ's partition, the intra/inter-node split); default: the command's "
                             + "/".join(NODE_SIZE_FLAGS))
    parser.add_argument("--out", type=Path, default=Path("ab_out"), help="output directory (default: %(default)s)")
    parser.add_argument("--timeout", type=positive_float, default=1800.0,
                        help="seconds allowed per arm before its command is stopped (default: %(default)s)")
    parser.add_argument("--no-report", action="store_true", help="skip report.md and the plots")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help=f"after --: the launch command; {PLACEHOLDER} stands for the arm's ds_config path, "
                             f"{ARM_PLACEHOLDER} for the arm's name (e.g. --output_dir out/{ARM_PLACEHOLDER})")
    return parser


def _flag_value(command: list[str], flags: tuple) -> str | None:
    for i, word in enumerate(command):
        for flag in flags:
            if word == flag and i + 1 < len(command):
                return command[i + 1]
            if word.startswith(flag + "="):
                return word.split("=", 1)[1]
    return None


def shared_output_folders(command: list[str]) -> list[str]:
    """The command's output and checkpoint folders (`OUTPUT_FLAGS`) that every arm would share."""
    shared = []
    for i, word in enumerate(command):
        flag, _, value = word.partition("=")
        if flag in OUTPUT_FLAGS:
            value = value or (command[i + 1] if i + 1 < len(command) else "")
            if value and ARM_PLACEHOLDER not in value:
                shared.append(f"{flag} {value}")
    return shared


def warn_of_shared_folders(command: list[str]) -> None:
    """Before the first arm: folders all arms write into (a later arm would overwrite an earlier one's checkpoints,
    its `latest` tag, its outputs)."""
    shared = shared_output_folders(command)
    if shared:
        print(f"{PROG}: warning: every arm runs the same command, so these folders are shared by all arms: "
              f"{'; '.join(shared)}. A later arm overwrites an earlier one's outputs and checkpoints (and their "
              f"'latest' tag), the user's own too. Put {ARM_PLACEHOLDER} in them (it becomes the arm's name), or read "
              f"${ARM_VARIABLE} in the script.", file=sys.stderr, flush=True)
    elif not any(ARM_PLACEHOLDER in word for word in command):
        print(f"{PROG}: note: whatever the script writes (outputs, checkpoints) goes to the same place for every arm; "
              f"{ARM_PLACEHOLDER} in the command, or ${ARM_VARIABLE} in the script, keeps the arms apart.",
              file=sys.stderr, flush=True)


def _is_cluster_command(command: list[str]) -> bool:
    return bool(command) and os.path.basename(command[0]) == "asynchzp-cluster"


def load_shared_config(path: Path) -> dict:
    """The user's ds_config, refused with the key and the fix where no arm could run from it."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"--config {path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise UsageError(f"--config {path}: must hold a JSON object (a ds_config)")
    stage = (config.get("zero_optimization") or {}).get("stage")
    if stage != 3:
        raise UsageError(f"--config {path}: zero_optimization.stage is {stage!r}; every arm is ZeRO-3 (stock, ZeRO++ "
                         "or AsyncHZP): set \"zero_optimization\": {\"stage\": 3}")
    if RECORD_KEY in config:
        raise UsageError(f"--config {path}: holds {RECORD_KEY!r}, which {PROG} writes per arm; remove the key")
    return config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check everything that can be checked before any arm runs; errors exit 2 through argparse."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error(f"give the launch command after --, with {PLACEHOLDER} where the ds_config path goes, e.g. "
                     f"-- deepspeed --num_gpus 8 train.py --deepspeed_config {PLACEHOLDER}")
    if not any(PLACEHOLDER in word for word in command):
        parser.error(f"the launch command has no {PLACEHOLDER}: put it where the script takes its ds_config path "
                     f"(e.g. --deepspeed_config {PLACEHOLDER}), so each arm runs with its own config")
    args.command = command
    try:
        args.specs = parse_arm_specs(args.arms)
    except ArmSpecError as exc:
        parser.error(f"--arms: {exc}")
    if args.warmup_steps >= args.steps:
        parser.error(f"--warmup-steps {args.warmup_steps} must be < --steps {args.steps}, otherwise no "
                     "steady-state step is left to average")
    if args.node_size is None:
        found = _flag_value(command, NODE_SIZE_FLAGS)
        if found is None or not found.isdigit() or int(found) < 1:
            parser.error("cannot tell the ranks per node from the command (no " + "/".join(NODE_SIZE_FLAGS)
                         + " with a number): give --node-size")
        args.node_size = int(found)
    try:
        args.shared_config = load_shared_config(args.config)
        for spec in args.specs:
            _check_section(arm_ds_config(args.shared_config, spec, args.node_size), spec.name)
    except UsageError as exc:
        parser.error(str(exc))
    return args


def _check_section(config: dict, arm: str) -> None:
    from ds_asynchzp.config import section_from_ds_config
    from ds_asynchzp.errors import AsyncHZPConfigError

    try:
        section_from_ds_config(config)
    except AsyncHZPConfigError as exc:
        raise UsageError(f"arm {arm}: {exc}") from None


# ------------------------------------------------------------------------------------------- one arm
def arm_config(args: argparse.Namespace, spec, record_dir: Path, launched_at: float) -> dict:
    config = arm_ds_config(args.shared_config, spec, args.node_size)
    config[RECORD_KEY] = {"out_dir": str(record_dir.resolve()), "arm": spec.name, "steps": args.steps,
                          "warmup_steps": args.warmup_steps, "expected_optimizer": ARMS[spec.base][1],
                          "read_link_counter": _is_cluster_command(args.command), "node_size": args.node_size,
                          "launched_at": launched_at}
    return config


def _stream(proc: subprocess.Popen, log: Path, label: str, progress: list) -> None:
    """Copy the command's output to its log; show the recorder's progress lines (rank 0's) on the console."""
    with log.open("w", encoding="utf-8", errors="replace") as f:
        for line in proc.stdout:
            f.write(line)
            f.flush()
            if PROGRESS_MARK in line:
                progress.append(line)
                print(f"{label}: {line.split(PROGRESS_MARK, 1)[1].strip()}", flush=True)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the command's process group (asynchzp-cluster then stops its nodes), SIGKILL after a grace."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(log: Path) -> str:
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in lines[-LOG_TAIL_LINES:]) or "    (empty)"


def _read_records(record_dir: Path) -> list:
    records = []
    for path in sorted(record_dir.glob("rank*.json")):
        records.append(json.loads(path.read_text(encoding="utf-8")))
    return records


def _arm_environment(arm: str) -> dict:
    """The command's environment: the arm's name (`ARM_VARIABLE`), and the recorder among the runtime's observers
    (`runtime.observers`), for ranks that inherit it; an installed package also names the recorder by its entry
    point, for launchers that start ranks without the caller's environment."""
    env = dict(os.environ, **{ARM_VARIABLE: arm})
    names = [n for n in env.get(ENVIRONMENT_VARIABLE, "").split(",") if n.strip()]
    if RECORDER not in names:
        env[ENVIRONMENT_VARIABLE] = ",".join(names + [RECORDER])
    return env


def run_arm(args: argparse.Namespace, spec, label: str) -> tuple[list, dict]:
    """Run the command under one arm; its rank records and its provenance, or `ArmFailure`."""
    out = Path(args.out)
    name = arm_dir_name(spec.name)
    record_dir, log = out / "records" / name, out / "logs" / f"{name}.log"
    for directory in (record_dir, out / "configs", out / "logs"):
        directory.mkdir(parents=True, exist_ok=True)
    for stale in record_dir.glob("rank*.json"):
        stale.unlink()  # a record left by an earlier run must not pass for this one's
    launched_at = time.time()
    config = arm_config(args, spec, record_dir, launched_at)
    config_path = out / "configs" / f"{name}.json"
    write_json_atomically(config_path, config)
    command = [word.replace(PLACEHOLDER, str(config_path.resolve())).replace(ARM_PLACEHOLDER, name)
               for word in args.command]
    provenance = {"command": shlex.join(command), "ds_config": str(config_path), "log": str(log),
                  "arm_keys": changed_keys(args.shared_config, config)}
    print(f"{label}: {shlex.join(command)}", flush=True)
    started = time.monotonic()
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", start_new_session=True, env=_arm_environment(name))
    except OSError as exc:
        raise ArmFailure(f"arm {spec.name}: cannot run the launch command {command[0]!r}: {exc}") from None
    progress: list = []
    reader = threading.Thread(target=_stream, args=(proc, log, label, progress), daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        reader.join(timeout=10)
        raise ArmFailure(f"arm {spec.name}: no end after --timeout {args.timeout:g} s ({len(progress)} of "
                         f"{args.steps} optimizer steps recorded); stopped. Last lines of {log}:\n{_tail(log)}") \
            from None
    except BaseException:
        _stop(proc)  # Ctrl-C: no rank, and no emulated node, outlives the tool
        raise
    reader.join(timeout=10)
    provenance.update(exit_code=code, wall_time_s=time.monotonic() - started)
    records = _read_records(record_dir)
    world = records[0]["world_size"] if records else None
    if code == 0 and records and len(records) == world:
        provenance["device"] = sorted({r.get("device") or "n/a" for r in records})
        for record in records:
            record["host_state_bytes"] = host_state_bytes(record, config)
        return records, provenance
    raise ArmFailure(_failure(spec.name, code, records, progress, args.steps, log))


def _failure(arm: str, code: int, records: list, progress: list, steps: int, log: Path) -> str:
    done = len(progress)
    if code == 0 and not progress:
        why = ("the job ended (exit 0) without recording a step: the script must build its engine with "
               "ds_asynchzp.initialize (or call ds_asynchzp.register() before its framework calls "
               "deepspeed.initialize), and train with that engine")
    elif code == 0 and done < steps:
        why = (f"the script ended after {done} of {steps} optimizer steps: give --steps {done} or less, or let the "
               "script train longer")
    else:
        wrote = sorted(r["rank"] for r in records)
        world = records[0]["world_size"] if records else None
        missing = ("" if world is None else
                   f"; ranks without a record: {sorted(set(range(world)) - set(wrote))}")
        why = f"the launch command exited with code {code} after {done} of {steps} optimizer steps{missing}"
    return f"arm {arm}: {why}. Last lines of {log}:\n{_tail(log)}"


def _flatten(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value and key != "async_hzp":
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def changed_keys(shared: dict, config: dict) -> dict:
    """What an arm's ds_config changes in the shared one, as dotted keys (None: removed); the recorder's key and the
    async_hzp section (given whole) aside."""
    before, after = _flatten(shared), _flatten({k: v for k, v in config.items() if k != RECORD_KEY})
    changed = {k: v for k, v in after.items() if before.get(k, object()) != v}
    changed.update({k: None for k in before if k not in after})
    return changed


# --------------------------------------------------------------------------------------------- driving
def run_config(args: argparse.Namespace) -> dict:
    cluster = _is_cluster_command(args.command)
    return {
        "tool": PROG,
        "arms": [s.name for s in args.specs],
        "command": shlex.join(args.command),
        "shared_config": str(args.config),
        "node_size": args.node_size,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "timeout_s": args.timeout,
        "out": str(args.out),
        "arm_specs": {s.name: {"base": s.base, "overrides": dict(s.overrides)} for s in args.specs},
        "network": ({"mode": "emulated", "inter_node_bw": _flag_value(args.command, ("--bw",)) or "default",
                     "inter_node_delay_ms": _flag_value(args.command, ("--delay",)), "mtu": None}
                    if cluster else {"mode": "as launched"}),
    }


def run_ab(args: argparse.Namespace) -> dict:
    """Every arm in order; results.json is rewritten after each, so a later failure keeps the rest."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"config": run_config(args), "env": environment(), "arms": {}, "runs": {}, "failed_arms": {}}
    warn_of_shared_folders(args.command)
    for index, spec in enumerate(args.specs, 1):
        label = f"[{index}/{len(args.specs)}] {spec.name}"
        try:
            records, provenance = run_arm(args, spec, label)
        except ArmFailure as exc:
            print(f"{label}: FAILED: {exc}", file=sys.stderr, flush=True)
            results["failed_arms"][spec.name] = str(exc).split("\n", 1)[0]
            write_json_atomically(out / "results.json", results)
            continue
        entry = merge_repeats([aggregate_arm(records, args.warmup_steps, None)])
        entry["wall_time_s"] = provenance["wall_time_s"]
        results["arms"][spec.name] = entry
        results["runs"][spec.name] = provenance
        results["config"].setdefault("world_size", records[0]["world_size"])
        write_json_atomically(out / "results.json", results)
        print(f"{label}: done in {provenance['wall_time_s']:.1f}s, final loss {entry['losses'][-1]:.6f}, median "
              f"step {entry['median_step_time_s']:.3f}s", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from .report import write_report
    from .table import format_table

    out = Path(args.out)
    try:
        results = run_ab(args)
    except KeyboardInterrupt:
        # The running arm's command was stopped (its process group, emulated nodes included) before this.
        print(f"\n{PROG}: interrupted; the arms that finished are in {out / 'results.json'}", file=sys.stderr,
              flush=True)
        return 130
    if results["arms"]:
        table = format_table(results)
        (out / "summary.md").write_text(table + "\n", encoding="utf-8")
        print("\n" + table)
        if not args.no_report:
            print(f"report: {write_report(results, out)}", flush=True)
    failed = results["failed_arms"]
    if failed:
        kept = f"; finished arms are in {out / 'results.json'}" if results["arms"] else ""
        print(f"{PROG}: {len(failed)} arm(s) failed: {', '.join(failed)}{kept}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

