"""The parts of the A/B report that differ between the two tools, and the paragraph every report opens with.

``asynchzp-bench`` trains the package's own model, so its report describes that workload (`report._workload`);
``asynchzp-ab`` runs the user's command, so its report gives per arm the command line, the ds_config file, the
device and the exit code instead (`job_provenance`, `job_workload`). Both open with `opening`: what was measured,
the speed-up against ZeRO-3 and where it comes from, and the testbed's caveat, each figure read from the results.
"""

from __future__ import annotations

import json

from .link_table import topology_text
from .table import REFERENCE_ARM, max_rel_loss_diff

NA = "n/a"
# The arm the opening paragraph speaks for: the package's own placement, communication on its threads.
HEADLINE_ARM = "asynchzp"


def is_job_run(results: dict) -> bool:
    """Whether the results are asynchzp-ab's (a user's command) rather than the bench's own model."""
    return bool((results.get("config") or {}).get("command"))


def _where(results: dict) -> str:
    config = results.get("config") or {}
    world = config.get("world_size") or config.get("nproc")
    node = config.get("node_size")
    nodes = f"{world // node} nodes of {node}" if isinstance(world, int) and isinstance(node, int) and node else NA
    network = config.get("network") or {}
    if network.get("mode") == "emulated":
        net = f"emulated nodes joined by {network.get('inter_node_bw', NA)} links, {topology_text(config)}"
    elif network.get("mode") == "loopback":
        net = "loopback (no link between the simulated nodes costs anything)"
    else:
        net = "the network the command launched on"
    return f"{world} ranks as {nodes}, over {net}"


def _on_cpu(results: dict) -> bool:
    devices = {d for run in (results.get("runs") or {}).values() for d in run.get("device") or []}
    return not devices or devices == {"cpu"}


def _ratio_text(head, ref) -> str:
    return f"{head / ref:.2f}x" if head is not None and ref else NA


def _link_bytes_sentence(s_ref: dict, s_head: dict) -> str:
    """The bytes between nodes, counted on the node links where they were counted (``wire``: the emulated
    cluster's link counters, frame headers included), the model's figure beside (``link``: the ledger's, gloo's
    rings on the run's links); on loopback only the model's, and it says so."""
    counted, model = (s_head.get("wire"), s_ref.get("wire")), (s_head.get("link"), s_ref.get("link"))
    if None not in counted:
        return (f"Its node links carried {_ratio_text(*counted)} ZeRO-3's bytes, counted on the links "
                f"({counted[0] / 1e6:.3f} MB against {counted[1] / 1e6:.3f} MB per rank per step, headers included; "
                f"the model predicts {_ratio_text(*model)})")
    if None not in model:
        return (f"Nothing was counted on links in this run; by the model its node links would carry "
                f"{_ratio_text(*model)} ZeRO-3's bytes ({model[0] / 1e6:.3f} MB against {model[1] / 1e6:.3f} MB "
                "per rank per step, gloo's rings)")
    return (f"It sent {_ratio_text(s_head['inter'], s_ref['inter'])} ZeRO-3's bytes in collectives whose group spans "
            f"nodes ({s_head['inter'] / 1e6:.3f} MB against {s_ref['inter'] / 1e6:.3f} MB per rank per step, the "
            "ring model; no link figure was recorded)")


def opening(results: dict, stats: dict) -> list[str]:
    """One short paragraph: what was measured, the speed-up of asynchzp over zero3 and where it comes from."""
    arms = results.get("arms") or {}
    config = results.get("config") or {}
    what = (f"the command `{config.get('command')}`" if is_job_run(results)
            else f"the `{config.get('model', NA)}` model (ZeRO-3 knobs `{config.get('zero3_knobs', NA)}`)")
    text = f"**Summary.** {', '.join(arms)} trained {what} on {_where(results)}, side by side in one run."
    ref, head = arms.get(REFERENCE_ARM), arms.get(HEADLINE_ARM)
    if ref is not None and head is not None:
        s_ref, s_head = stats[REFERENCE_ARM], stats[HEADLINE_ARM]
        speed = s_ref["step_median"] / s_head["step_median"] if s_head["step_median"] else None
        text += (f" AsyncHZP's median optimizer step took {s_head['step_median']:.3f} s against ZeRO-3's "
                 f"{s_ref['step_median']:.3f} s: **{speed:.2f}x** the speed. " + _link_bytes_sentence(s_ref, s_head)
                 + ": its micro-steps gather and reduce inside the node, and only one gradient reduction and one "
                 "parameter refresh per optimizer step cross nodes")
        exposed_ref, exposed_head = s_ref.get("exposed"), s_head.get("exposed")
        if exposed_ref is not None and exposed_head is not None:
            text += (f"; the training thread waited on communication {exposed_head:.3f} s per step against "
                     f"{exposed_ref:.3f} s")
        diff = max_rel_loss_diff(head["losses"], ref["losses"])
        text += (f". Its losses are ZeRO-3's {'bit for bit' if diff == 0 else f'within {diff:.1e} (relative)'}.")
    elif head is None:
        text += f" No `{HEADLINE_ARM}` arm ran, so there is no AsyncHZP speed-up to state."
    else:
        text += f" No `{REFERENCE_ARM}` arm ran, so there is no reference to compare with."
    if _on_cpu(results):
        text += (" These are CPU ranks: stock ZeRO-3 cannot overlap communication there (no streams) while "
                 "AsyncHZP's threads can, which favours AsyncHZP beyond what a GPU shows (see the caveat below); "
                 "times are ratios of this host, not GPU times.")
    return [text, ""]


def job_provenance(results: dict) -> list[str]:
    """asynchzp-ab's provenance: versions, and per arm the launch line, its ds_config, device and exit."""
    env, config = results.get("env") or {}, results.get("config") or {}
    lines = ["## Provenance", "",
             f"- Date (UTC): {env.get('date', NA)}; git commit: `{env.get('git_commit') or NA}`",
             f"- Versions: torch {env.get('torch', NA)}, deepspeed {env.get('deepspeed', NA)}, ds_asynchzp "
             f"{env.get('ds_asynchzp', NA)}, Python {env.get('python', NA)}; host: {env.get('host_cpus', NA)} CPUs",
             f"- Launch command (`{{config}}`: each arm's ds_config): `{config.get('command', NA)}`",
             f"- Shared ds_config: `{config.get('shared_config', NA)}`; every arm's is it with the arm's keys "
             "(below) and the recorder's `async_hzp_record` key", ""]
    for arm, run in (results.get("runs") or {}).items():
        lines.append(f"- `{arm}`: device {', '.join(run.get('device') or [NA])}; exit {run.get('exit_code', NA)} in "
                     f"{run.get('wall_time_s', 0):.1f} s; ds_config `{run.get('ds_config', NA)}`; log "
                     f"`{run.get('log', NA)}`; ran `{run.get('command', NA)}`")
    for arm, why in (results.get("failed_arms") or {}).items():
        lines.append(f"- `{arm}`: **failed**: {why}")
    return lines + [""]


def job_workload(results: dict) -> list[str]:
    """What every arm ran: the user's job, the steps recorded, and what each arm changed."""
    config, arms = results.get("config") or {}, results.get("arms") or {}
    lines = ["## Workload", "",
             f"- Job: the command above, {config.get('world_size', NA)} ranks in nodes of "
             f"{config.get('node_size', NA)}; model, data, batch and precision are the script's and its config's, "
             "the same in every arm",
             f"- Steps: {config.get('steps', NA)} optimizer steps recorded per arm, then the job was ended; the first "
             f"{config.get('warmup_steps', NA)} left out of step-time and byte statistics",
             "- Loss: per optimizer step, the mean of the losses the script handed to `engine.backward`, mean over "
             "ranks; step time: from the step's first forward to the end of its optimizer step (device "
             "synchronised), slowest rank", "", "Arms:", ""]
    specs, runs = config.get("arm_specs") or {}, results.get("runs") or {}
    for arm, entry in arms.items():
        spec = specs.get(arm) or {}
        keys = (runs.get(arm) or {}).get("arm_keys") or {}
        peaks = entry.get("device_memory_peak_bytes")
        memory = (f"; device memory peak {peaks['allocated'] / 2**20:.0f} MiB allocated, "
                  f"{peaks['reserved'] / 2**20:.0f} MiB reserved" if peaks else "")
        lines.append(f"- `{arm}` ({spec.get('base', arm)}): optimizer `{entry.get('optimizer_class', NA)}`"
                     + "; its keys: " + (", ".join(f"`{k}={json.dumps(v)}`" for k, v in keys.items()) or "none")
                     + memory)
    return lines + [""]
