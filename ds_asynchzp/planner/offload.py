"""Optimizer offload in the plan (``asynchzp-plan --offload-optimizer``, ``offload_optimizer.device: "cpu"``).

For every arm: where its model states live per rank, device and host, with offload and without it, and the
``host_device`` flow (bytes copied between the device and its host per optimizer step). The numbers come from
:func:`ds_asynchzp.formulas.sizing.placement_bytes_per_rank` (AsyncHZP) and
:func:`~ds_asynchzp.formulas.sizing.stock_placement_bytes_per_rank` (ZeRO-3, hpZ, ZeRO++), and from
:func:`ds_asynchzp.formulas.traffic.host_device_bytes`; the network flows are the arms' usual ones, which
offload does not change.

The copies are timed at :data:`ds_asynchzp.formulas.sizing.HOST_DEVICE_BW_BYTES_S`, the rate ``"auto"``
assumes, so the time column and the ``"auto"`` pick agree.
"""

from __future__ import annotations

from ..formulas import sizing, traffic

STOCK_ARMS = ("zero3", "hpz", "zeropp")
ASSUMPTIONS = [
    "offload: master weights, Adam moments and fp32 gradients on the host (DeepSpeedCPUAdam); stock arms also "
    "keep their gradient partition there (pinned), asynchzp keeps its gradient shard on the device",
    f"offload: host<->device copies at {sizing.HOST_DEVICE_BW_BYTES_S / 1e9:g} GB/s per rank (PCIe 4.0 x16, "
    "pinned), not overlapped; stock: (2*a*A + 4 + b)*P/N per step, asynchzp: (4 + b)*P/d_o whatever A "
    "(every planned element is reduced and trained)",
    "offload: with d_o < N every optimizer replica keeps and steps its own host copy (host bytes are per rank; "
    "a node's host holds node-size times that); the host optimizer's compute time is not modelled",
]


def arm_placement(arm: str, num_params: int, world: int, node_size: int, d_p: int, d_g: int, d_o: int,
                  param_bytes: int, grad_accum_bytes: int, offload_optimizer: bool, reference_models: int = 0,
                  reference_copies: bool = True) -> dict:
    """``{"device": parts, "host": parts}`` of one arm per rank. hpZ and ZeRO++ add their node-wide secondary
    parameter partition on the device; quantized arms store what their unquantized twins store, and an offload
    arm (``zero3-offload``, ``asynchzp-offload``) what its twin stores (`traffic.offload_twin`), placed as
    ``offload_optimizer`` says; ``reference_models`` (with ``reference_copies``) add their ``reference_params``."""
    twin = traffic.offload_twin(arm)
    common = dict(offload_optimizer=offload_optimizer, param_bytes=param_bytes, grad_accum_bytes=grad_accum_bytes,
                  reference_models=reference_models)
    if twin in STOCK_ARMS:
        return sizing.stock_placement_bytes_per_rank(num_params, world, **common,
                                                     secondary_size=None if twin == "zero3" else node_size)
    if twin.startswith("asynchzp"):
        return sizing.placement_bytes_per_rank(num_params, world, d_p, d_g, d_o, **common,
                                               reference_copies=reference_copies)
    raise ValueError(f"no placement for arm {arm!r}")


def arm_entry(arm: str, t: traffic.TrafficInputs, d_p: int, d_g: int, d_o: int, grad_accum_bytes: int,
              device_memory: int | None, network_s: float | None) -> dict:
    """The ``offload_optimizer`` part of an arm's plan entry: device and host bytes with offload (and without,
    for comparison), whether the device part fits ``device_memory``, the ``host_device`` bytes and seconds per
    optimizer step, and the step's communication seconds with them (``network_s`` plus the copies)."""
    args = (arm, t.trainable_elements, t.world, t.node_size, d_p, d_g, d_o, t.param_bytes, grad_accum_bytes)
    refs = dict(reference_models=t.reference_models, reference_copies=t.reference_copies)
    with_offload, without = arm_placement(*args, True, **refs), arm_placement(*args, False, **refs)
    copies = traffic.host_device_bytes(arm, t, d_o if arm.startswith("asynchzp") else None, grad_accum_bytes)
    copy_s = copies["total"] / sizing.HOST_DEVICE_BW_BYTES_S
    return {
        "device_bytes": with_offload["device"],
        "host_bytes": with_offload["host"],
        "without_offload": {"device_bytes": without["device"], "host_bytes": without["host"]},
        "fits_device_memory": None if device_memory is None else with_offload["device"]["total"] <= device_memory,
        traffic.HOST_DEVICE + "_bytes_per_step": copies,
        traffic.HOST_DEVICE + "_s": copy_s,
        "comm_time_s": None if network_s is None else network_s + copy_s,
    }


def summary(result: dict) -> str:
    """One paragraph: whether asynchzp's gradients stay inside the node, and its cross-node and host<->device
    bytes per step next to stock ZeRO-3's and hpZ's, all with offload."""
    arms, layout, node = result["arms"], result["layout"], result["inputs"]["node_size"]

    def figures(arm: str) -> str:
        entry = arms[arm]
        copies = entry["offload_optimizer"][traffic.HOST_DEVICE + "_bytes_per_step"]["total"]
        return (f"{entry['bytes_per_step']['inter_node'] / 1e9:,.1f} GB across nodes and {copies / 1e9:,.1f} GB "
                "host<->device per step")

    where = ("inside the node" if layout["d_g"] <= node and node % layout["d_g"] == 0 else "across nodes")
    copies = {arm: arms[arm]["offload_optimizer"][traffic.HOST_DEVICE + "_bytes_per_step"]["total"]
              for arm in ("asynchzp", "zero3")}
    world = result["inputs"]["world"]
    replicas = world // layout["d_o"]
    return (f"with optimizer offload, asynchzp (d_p={layout['d_p']} d_g={layout['d_g']} d_o={layout['d_o']}) keeps "
            f"its gradient shards {where} (d_g={layout['d_g']}, {node} ranks per node): {figures('asynchzp')}; "
            f"stock ZeRO-3 offload: {figures('zero3')}; ZeRO++ hpZ offload: {figures('hpz')}. Host<->device bytes "
            f"{copies['asynchzp'] / copies['zero3']:.2f}x stock's: (N/d_o)*(4 + b)/(2*a*A + 4 + b), so they grow "
            f"with the optimizer replicas N/d_o ({replicas} here)"
            + ("" if replicas == 1 else "; d_o = N would divide them by " + str(replicas)))
