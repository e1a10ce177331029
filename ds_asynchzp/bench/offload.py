"""The optimizer-offload arms' figures (``zero3-offload``, ``asynchzp-offload``): host<->device bytes per optimizer
step and model-state bytes on the host and on the device per rank, measured where the run can measure them, each
next to the formula of `ds_asynchzp.formulas.traffic` / `ds_asynchzp.formulas.sizing`.

What is measured and what is not, on these CPU ranks:

* AsyncHZP notes each copy it makes between the device and the host in the ledger
  (``summary()["host_device"]``); the worker totals them over the steady steps, like the network bytes.
* Stock ZeRO-3's copies are ``.to()`` calls and copies between tensors that all live in host memory here: nothing
  records them, so its figure is the formula's (`traffic.stock_offload_host_device_bytes`).
* Every tensor lives in the same memory, so "host" and "device" are told apart by role, by where DeepSpeed's
  offload path allocates each one: the fp32 master weights, the Adam moments and the fp32 gradients the host
  optimizer reads (the ``.grad`` of the master partitions) on the host, and stock's gradient partition
  (``grad_partitions_flat_buffer``, role ``grad_primary``) too; parameter and AsyncHZP gradient shards on the
  device.

`add_offload_figures` computes an arm's figures into its results.json entry once the arm has run; the tables
read them from there.
"""

from __future__ import annotations

import json

from ..formulas import sizing, traffic
from ..planner.arm_formulas import DTYPE_BYTES
from ..planner.offload import arm_placement
from .arms import OFFLOAD_ARMS, OFFLOAD_OPTIMIZER, parse_arm_spec
from .plan_check import asynchzp_sizes, bench_element_counts

# Model-state roles (`measure.memory.model_state_bytes`, plus the worker's fp32_grad) that the offload path
# keeps on the host. grad_primary is stock's own gradient partition: the memory module counts it only where it
# is not a view into AsyncHZP's gradient shard, which stays on the device.
HOST_ROLES = ("grad_primary", "master", "optimizer_state", "fp32_grad")
# The formula's name (`sizing.stock_placement_bytes_per_rank`) of each measured host role.
FORMULA_ROLE = {"grad_primary": "grad_shard"}
# DeepSpeed 0.19.8's default of offload_optimizer.pin_memory (runtime/zero/offload_config.py), which both arms keep.
DEEPSPEED_PIN_MEMORY_DEFAULT = True
REFERENCE = "zero3-offload"
MB = 1e6

STOCK_NOT_MEASURED = (
    "stock ZeRO-3's copies are between host tensors on CPU ranks (no-op `.to()` calls or plain memcpy), which "
    "nothing records: its host<->device figure is the formula `(2·a·A + 4 + b)·P/N` of "
    "`formulas/traffic.py` (`stock_offload_host_device_bytes`), not a measurement")
CPU_OFFLOAD_CAVEAT = (
    "**CPU testbed and offload.** These ranks have no accelerator: device and host are the same RAM and there is no "
    "PCIe, so a host<->device copy costs at most a memcpy here, where on a GPU it crosses PCIe (the planner assumes "
    f"{sizing.HOST_DEVICE_BW_BYTES_S / 1e9:g} GB/s per rank). Step times therefore do not show the copies' cost, "
    "and that favours zero3-offload, whose copies grow with gradient accumulation while asynchzp-offload's do not. "
    "Device and host memory are split by role (where DeepSpeed's offload path allocates each tensor), not by "
    "where the tensors are. Both arms run DeepSpeedCPUAdam on the same cores as the rest of the step, each rank "
    "over its d_o share of the trainable parameters.")


def offload_section(ds_config: dict) -> dict | None:
    """The ds_config's ``zero_optimization.offload_optimizer`` section when it puts the optimizer on the host."""
    section = (ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    return section if str(section.get("device", "")).lower() == "cpu" else None


def measured_host_bytes(model_states: dict, fp32_grad_bytes: int) -> dict:
    """Host bytes by role of an offload arm's rank: its measured model-state roles that the offload path keeps on
    the host, plus the fp32 gradients the host optimizer reads (measured apart: the model-state roles do not
    hold them)."""
    host = {role: int(model_states.get(role) or 0) for role in HOST_ROLES if role != "fp32_grad"}
    host["fp32_grad"] = int(fp32_grad_bytes)
    return {**host, "total": sum(host.values())}


def host_state_bytes(record: dict, ds_config: dict) -> dict | None:
    """A rank record's model states on the host by role (`measured_host_bytes`), under optimizer offload; else
    None."""
    if offload_section(ds_config) is None or record.get("model_state_bytes") is None:
        return None
    return measured_host_bytes(record["model_state_bytes"], record["fp32_grad_bytes"])


def _base(results: dict, arm: str) -> str:
    recorded = ((results.get("config") or {}).get("arm_specs") or {}).get(arm) or {}
    return recorded.get("base") or parse_arm_spec(arm).base


def is_offload_arm(results: dict, arm: str) -> bool:
    return _base(results, arm) in OFFLOAD_ARMS


def _is_asynchzp(results: dict, arm: str) -> bool:
    return traffic.offload_twin(_base(results, arm)).startswith("asynchzp")


def predicted_figures(results: dict, arm: str) -> dict:
    """The formulas' host<->device bytes per optimizer step and host / device model-state bytes per rank of one
    offload arm, for this run's model (padded as DeepSpeed pads it over the arm's optimizer group): the
    planner's own (`traffic.host_device_bytes`, `planner.offload.arm_placement`), which know the offload arms."""
    config = results["config"]
    world, node_size = int(config.get("world_size") or config["nproc"]), int(config["node_size"])
    asynchzp = _is_asynchzp(results, arm)
    d_p, d_g, d_o = asynchzp_sizes(results, arm, node_size, world) if asynchzp else (world, world, world)
    elements = bench_element_counts(config, d_o)
    # The benchmark never sets data_types.grad_accum_dtype: gradients accumulate in the model dtype.
    b = a = DTYPE_BYTES[config.get("dtype", "fp32")]
    t = traffic.TrafficInputs(world=world, node_size=node_size, grad_accum=int(config["grad_accum"]),
                              gathered_elements=elements["gathered"], reduced_elements=elements["reduced"],
                              trainable_elements=elements["trainable"], param_bytes=b, grad_comm_bytes=b)
    base = _base(results, arm)
    copies = traffic.host_device_bytes(base, t, d_o if asynchzp else None, a)
    placed = arm_placement(base, elements["trainable"], world, node_size, d_p, d_g, d_o, b, a, offload_optimizer=True)
    return {"host_device": copies, "host": placed["host"], "device": placed["device"], "d_o": d_o,
            "grad_accum": t.grad_accum}


def add_offload_figures(results: dict, arm: str) -> None:
    """Put an offload arm's figures into its results.json entry (``offload``); other arms are left as they are."""
    entry = results["arms"][arm]
    if not is_offload_arm(results, arm):
        return
    predicted = predicted_figures(results, arm)
    measured_copies = entry.get("host_device_bytes_per_step")
    stock = not _is_asynchzp(results, arm)
    host = entry.get("host_state_bytes")
    states = entry.get("model_state_bytes") or {}
    device = None
    if host is not None and states:
        device = {role: v for role, v in states.items() if role != "total" and role not in HOST_ROLES}
        device["total"] = sum(device.values())
    entry["offload"] = {
        "offload_optimizer": {**OFFLOAD_OPTIMIZER, "pin_memory": DEEPSPEED_PIN_MEMORY_DEFAULT},
        "host_device_bytes_per_step": {
            # Stock's copies are not recorded by anything: its figure is the formula's alone.
            "measured": None if stock else measured_copies,
            "predicted": predicted["host_device"],
            "shown": "predicted" if stock else "measured",
        },
        "host_bytes_per_rank": {"measured": host, "predicted": predicted["host"]},
        "device_bytes_per_rank": {"measured": device, "predicted": predicted["device"]},
        "optimizer_shard_size": predicted["d_o"],
    }


# -------------------------------------------------------------------------------------------------- tables
def _mb(value) -> str:
    return "n/a" if value is None else f"{value / MB:.3f}"


def _shown_copies(figures: dict) -> float | None:
    """The host<->device bytes per step the table shows: the measurement, or the formula where none exists."""
    copies = figures["host_device_bytes_per_step"]
    chosen = copies.get(copies.get("shown", "measured"))
    return None if chosen is None else chosen["total"]


def _copies_cell(copies: dict, key: str) -> str:
    measured, predicted = copies.get("measured"), copies.get("predicted") or {}
    if measured is None:
        return f"{_mb(predicted.get(key))} (formula; not measurable)"
    return f"{_mb(measured.get(key))} (formula {_mb(predicted.get(key))})"


def _host_roles_cell(host: dict | None) -> str:
    if not host:
        return "n/a"
    return ", ".join(f"{FORMULA_ROLE.get(r, r)} {host[r] / MB:.3f}" for r in HOST_ROLES if host.get(r))


def _max_rel_diff(losses: list, reference: list) -> float:
    return max(abs(x - y) / abs(y) if y else abs(x - y) for x, y in zip(losses, reference))


def format_offload_table(results: dict) -> list[str]:
    """Markdown lines: one row per offload arm (host<->device bytes per step, host and device model-state MB per
    rank, each measured next to its formula), the arms' offload settings and the testbed's caveat; empty when
    the run has no offload arm."""
    arms = {a: e for a, e in (results.get("arms") or {}).items() if e.get("offload")}
    if not arms:
        return []
    ref = arms.get(REFERENCE)
    ref_copies = _shown_copies(ref["offload"]) if ref else None
    header = ["arm", "d_o", "to host MB/step", "to device MB/step", "host<->device MB/step", "vs zero3-offload",
              "host MB/rank (formula)", "host by role MB", "device MB/rank (formula)",
              r"max \|loss rel diff\| vs zero3-offload"]
    rows = []
    for arm, entry in arms.items():
        figures = entry["offload"]
        copies, host, device = (figures["host_device_bytes_per_step"], figures["host_bytes_per_rank"],
                                figures["device_bytes_per_rank"])
        shown = _shown_copies(figures)
        rows.append([
            arm, str(figures.get("optimizer_shard_size", "n/a")),
            _copies_cell(copies, "to_host"), _copies_cell(copies, "to_device"), _copies_cell(copies, "total"),
            f"{shown / ref_copies:.3f}" if shown is not None and ref_copies else "n/a",
            f"{_mb((host['measured'] or {}).get('total'))} ({_mb(host['predicted'].get('total'))})",
            _host_roles_cell(host["measured"]),
            f"{_mb((device['measured'] or {}).get('total'))} ({_mb(device['predicted'].get('total'))})",
            f"{_max_rel_diff(entry['losses'], ref['losses']):.2e}" if ref else "n/a",
        ])
    settings = {json.dumps(e["offload"]["offload_optimizer"], sort_keys=True) for e in arms.values()}
    ga = (results.get("config") or {}).get("grad_accum", "?")
    return ["## Optimizer offload: host memory and host<->device copies", "",
            *_table(header, rows), "",
            f"Per rank per optimizer step ({ga} micro-steps) for the copies, per rank for memory (rank 0, measured "
            "before the last step); MB = 10^6 bytes. asynchzp-offload's copies are measured by the ledger (the "
            "copies AsyncHZP notes, steady steps, mean over ranks), with the formula of `formulas/traffic.py` "
            "(`asynchzp_host_device_bytes`, `4·P_r/d_o` out, `b·P_t/d_o` back) in brackets; "
            f"{STOCK_NOT_MEASURED}. Host memory: "
            "the bytes of the tensors the offload path keeps on the host (fp32 master, Adam moments, the fp32 "
            "gradients the host optimizer reads, and stock's gradient partition, named grad_shard as in "
            "`formulas/sizing.py`), with `sizing.placement_bytes_per_rank` / `stock_placement_bytes_per_rank` "
            "in brackets; device: the other model-state roles. vs zero3-offload: the arm's host<->device bytes "
            "over zero3-offload's (each as shown). Offload settings, the same in every offload arm: "
            + ", ".join(f"`offload_optimizer={s}`" for s in sorted(settings))
            + " (`pin_memory` left to DeepSpeed's default); every other setting is the arm's twin's "
            f"({', '.join(f'{k} = {v}' for k, v in OFFLOAD_ARMS.items())} with the optimizer on the host).", "",
            CPU_OFFLOAD_CAVEAT, ""]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    rule = "|" + "|".join(":" + "-" * (w + 1) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return [line(header), rule, *(line(r) for r in rows)]
