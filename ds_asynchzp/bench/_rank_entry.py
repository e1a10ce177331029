"""Child side of :mod:`ds_asynchzp.bench.launch`: run one rank's target and record the outcome.

Invoked as ``python -m ds_asynchzp.bench._rank_entry TARGET PAYLOAD_JSON RESULT_JSON``.
The outcome is written to RESULT_JSON as ``{"ok": true, "result": ...}`` or
``{"ok": false, "error": "<traceback>"}``; the exit code is 0 or 1 accordingly.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import signal
import sys
import traceback

from ds_asynchzp.measure.json_files import write_text_atomically
from ds_asynchzp.bench.launch import CPU_INFO_ENV, reuse_cpu_info


def resolve_target(target: str):
    """Import ``"package.module:attr[.attr...]"`` and return the named object."""
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"target must look like 'package.module:function', got {target!r}")
    obj = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


def _close_communication() -> None:
    """Stop any engine's communication threads and peer monitor the target left running. The process ends with
    os._exit (below), which skips the atexit hook that would do it; a monitor left unclosed would make this rank,
    ending normally, look lost to a peer still finishing."""
    context = sys.modules.get("ds_asynchzp.scheduler.context")
    if context is None:
        return
    try:
        context.close_all()
    except Exception:  # noqa: BLE001 - the outcome is already decided; report, do not change it
        traceback.print_exc()


def main(argv: list[str] | None = None) -> int:
    target, payload_path, result_path = sys.argv[1:] if argv is None else argv

    # A crash in native code (segfault, abort) still leaves a Python stack in the log.
    faulthandler.enable()
    # Before it stops a rank still running, the launcher asks for every thread's stack with SIGUSR1: the log
    # then shows where a hung rank was stuck.
    if hasattr(faulthandler, "register"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)

    try:
        # The launcher's description of this machine, for DeepSpeed's op builders (launch.py `_cpu_info_json`).
        reuse_cpu_info(os.environ.get(CPU_INFO_ENV, ""))
        with open(payload_path, encoding="utf-8") as f:
            payload = json.load(f)
        result = resolve_target(target)(payload)
        # Serialise inside the try: a non-JSON result is the worker's bug and is reported as such.
        text = json.dumps({"ok": True, "result": result})
        exit_code = 0
    except BaseException:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from the worker are failures too
        error = traceback.format_exc()
        sys.stderr.write(error)
        text = json.dumps({"ok": False, "error": error})
        exit_code = 1

    _close_communication()
    # Written whole: the launcher never reads a half-written file from a rank killed mid-write.
    write_text_atomically(result_path, text)
    sys.stdout.flush()
    sys.stderr.flush()
    return exit_code


if __name__ == "__main__":
    code = main()
    # Skip interpreter teardown: once the outcome is on disk, destroying live gloo process groups whose peers
    # have already exited can abort the process ("terminate called without an active exception") and turn a
    # finished rank into a failure.
    os._exit(code)
