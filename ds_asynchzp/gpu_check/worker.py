"""One rank of one arm of the GPU check: train the benchmark model on the rank's device and report the losses,
step times and busy communication time from CUDA events, the allocator's counters, and the bytes of the
package's own buffers beyond the model states.

Run by `ds_asynchzp.bench.launch.launch_local` as ``ds_asynchzp.gpu_check.worker:run_arm``. The payload says
the arm: its ds_config, whether a `torch.cuda._sleep` follows every module's forward on the compute stream (it
widens every window in which a missing stream wait would show as a different loss), and how many steps.
DeepSpeed's throughput timer is unsynchronised in every arm: synchronised, it would hide races across steps.
"""

from __future__ import annotations

import os
import time


def _device():
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    # Every rank runs on this one machine (its "nodes" are emulated by LOCAL_WORLD_SIZE), so the global rank picks
    # the GPU: one GPU per rank with NCCL; ranks sharing one GPU (gloo) all land on it.
    index = int(os.environ.get("RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class _JobTimer:
    """CUDA events around every communication job, on the job's stream: device time, not host enqueue time."""

    def __init__(self):
        self.pairs = []

    def install(self):
        from ..scheduler import comm_thread

        comm_thread.add_job_timer(self._time_job)
        return self

    def _time_job(self, flow: str, stream):
        if stream is None:
            return None
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)

        def ended():
            end.record(stream)
            self.pairs.append((flow, start, end))
        return ended

    def uninstall(self):
        from ..scheduler import comm_thread

        comm_thread.remove_job_timer(self._time_job)

    def busy_ms(self, jobs: int) -> dict:
        """Device milliseconds per flow of the first `jobs` jobs."""
        busy = {}
        for flow, start, end in self.pairs[:jobs]:
            busy[flow] = busy.get(flow, 0.0) + start.elapsed_time(end)
        return busy


def _mark(cuda: bool):
    """A point in time: a CUDA event recorded on the current stream, or the host clock."""
    if not cuda:
        return time.perf_counter()
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def run_arm(payload: dict) -> dict:
    import deepspeed
    import torch

    import ds_asynchzp
    from ..measure.memory import model_state_bytes
    from ..bench.data import batch_for
    from ..models.gpt import MODEL_PRESETS, build_model

    device = _device()
    if payload["backend"] == "gloo" and device.type == "cuda":
        # Ranks sharing one GPU: DeepSpeed takes cuda:LOCAL_RANK (process group, engine, zero.Init), a device only
        # rank 0 has. The emulated node's local rank is not read past this point (the package reads
        # LOCAL_WORLD_SIZE), so it becomes the shared device's index; the group joins unbound, and DeepSpeed adopts it.
        os.environ["LOCAL_RANK"] = str(device.index)
        torch.distributed.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend=payload["backend"])
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    model = build_model(MODEL_PRESETS[payload["model"]], seed=payload["seed"])
    cuda = device.type == "cuda"
    if payload.get("sleep_cycles") and cuda:
        cycles = int(payload["sleep_cycles"])
        for module in model.modules():
            module.register_forward_hook(lambda *_: torch.cuda._sleep(cycles))
    timer = _JobTimer().install() if cuda else None
    engine, *_ = ds_asynchzp.initialize(model=model,
                                        model_parameters=[p for p in model.parameters() if p.requires_grad],
                                        config=payload["ds_config"])
    # Nothing inside the measured steps synchronises the host with the device (no .item(), no event wait):
    # losses and step times are read once the run is over, so every race window stays as wide as in training.
    step_losses, marks, memory = [], [], {}
    warmup, steps = payload["warmup_steps"], payload["steps"]
    gas, micro, seq = payload["grad_accum"], payload["micro_batch"], payload["seq_len"]
    for step in range(warmup + steps):
        if step == warmup and cuda:
            torch.cuda.synchronize()
            stats = torch.cuda.memory_stats(device)
            memory["after_warmup"] = {"reserved": stats.get("reserved_bytes.all.current", 0),
                                      "alloc_retries": stats.get("num_alloc_retries", 0)}
        started = _mark(cuda)
        total = None
        for m in range(gas):
            x, y = batch_for(step, m, rank, world, micro, seq, seed=payload["seed"])
            loss = engine(x.to(device), y.to(device))
            engine.backward(loss)
            engine.step()
            total = loss.detach().float() if total is None else total + loss.detach().float()
        step_losses.append(total / gas)
        marks.append((started, _mark(cuda)))
    if cuda:
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats(device)
        memory["end"] = {"reserved": stats.get("reserved_bytes.all.current", 0),
                         "alloc_retries": stats.get("num_alloc_retries", 0)}
        # Everything the allocator ever handed out at once (activations included): the ceiling the package's
        # buffers below sit under.
        memory["max_allocated"] = torch.cuda.max_memory_allocated(device)
    # AsyncHZP's own buffers beyond the model states, as the measured steps left them (None for stock ZeRO-3).
    buffers = engine.optimizer.hzp_buffer_bytes() if hasattr(engine.optimizer, "hzp_buffer_bytes") else None
    states = model_state_bytes(engine)
    states = states["total"] - states.get("error_feedback", 0)   # the residual counts among the buffers
    measured_jobs = len(timer.pairs) if timer is not None else 0
    copies = None
    if payload.get("count_copies") and cuda:
        # One more step, after the measured ones and their memory figures, under the profiler.
        from .copy_count import count_copies

        def one_step():
            for m in range(gas):
                x, y = batch_for(warmup + steps, m, rank, world, micro, seq, seed=payload["seed"])
                engine.backward(engine(x.to(device), y.to(device)))
                engine.step()
            torch.cuda.synchronize()

        copies = count_copies(one_step)
    losses = [float(value.cpu()) for value in step_losses]
    step_ms = [start.elapsed_time(end) if cuda else (end - start) * 1e3 for start, end in marks]
    optimizer = type(engine.optimizer).__name__
    engine.destroy()        # every job finished and every comm stream synchronised: all events are recorded
    busy = timer.busy_ms(measured_jobs) if timer is not None else {}   # the profiled step's jobs left out
    if timer is not None:
        timer.uninstall()
    return {"rank": rank, "losses": losses, "step_ms": step_ms[warmup:], "memory": memory,
            "comm_busy_ms": {flow: ms / max(1, warmup + steps) for flow, ms in busy.items()},
            "optimizer": optimizer, "device": str(device), "package_buffer_bytes": buffers,
            "model_state_bytes": states, "host_device_bytes_counted": copies}
