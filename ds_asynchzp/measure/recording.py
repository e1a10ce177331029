"""Record an A/B arm inside the user's own training job, and end the job after its steps.

``asynchzp-ab`` writes each arm's ds_config with a top-level ``"async_hzp_record"`` key (`RECORD_KEY`): where the
rank records go, the arm's name, how many optimizer steps to record; and it names `observer` in the environment
variable ``DS_ASYNCHZP_OBSERVERS`` (`runtime.observers`), so that `ds_asynchzp.initialize` (directly, or through
``register()`` from HF Trainer, Accelerate or TRL) calls it, for every arm, stock ones too:

* before the engine is built, it counts every collective (`ledger`) and, on CPU ranks, lets stock ZeRO++'s
  quantizer run (`install_cpu_zeropp_quantizer`: DeepSpeed has it as CUDA kernels only);
* after, it checks the engine is the arm's (an AsyncHZP arm must get the hierarchical optimizer), then watches the
  engine's ``forward``, ``backward`` and ``step`` so that a `StepRecorder` sees every optimizer step as the engine
  does: the losses handed to ``backward``, the time from the step's first forward to its optimizer step (the
  device synchronised), the ledger's bytes;
* after the last recorded step, every rank writes ``<out>/rank<N>.json``, waits for the others and ends the
  script as ``sys.exit(0)`` would (`end_script`): its ``finally`` blocks and exit handlers run, with the engine
  still up, the code after its training loop does not; the engine is shut down at exit. The script need not know it is being measured.

The key is the tool's; DeepSpeed ignores top-level keys it does not know, so a stock arm's config is otherwise
the user's own.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from dataclasses import dataclass

from ..config_compat import offloads_optimizer
from ..platform import ledger
from ..runtime.observers import watch_engine
from .json_files import write_json_atomically
from .step_recorder import StepRecorder

RECORD_KEY = "async_hzp_record"
PROGRESS_MARK = "asynchzp-ab-step"
# Seconds a script may take to end after its arm's last recorded step before the process is ended for it.
EXIT_GRACE_S = 60.0
ZEROPP_QUANTIZER_KEYS = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")


@dataclass(frozen=True)
class RecordSettings:
    """The ``async_hzp_record`` key of an arm's ds_config."""

    out_dir: str
    arm: str
    steps: int
    warmup_steps: int = 1
    # Substring of the optimizer class the arm must build (checked, so an arm never measures another).
    expected_optimizer: str | None = None
    # Emulated nodes: local rank 0 of each node reads its node link's transmit counter.
    read_link_counter: bool = False
    node_size: int | None = None
    launched_at: float | None = None

    @classmethod
    def from_ds_config(cls, ds_config: dict) -> "RecordSettings | None":
        raw = ds_config.get(RECORD_KEY)
        if raw is None:
            return None
        if not isinstance(raw, dict) or not raw.get("out_dir") or not raw.get("arm") or not raw.get("steps"):
            raise ValueError(f"ds_config key {RECORD_KEY!r} is written by asynchzp-ab and needs out_dir, arm and "
                             f"steps; got {raw!r}. Remove the key to train without recording.")
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in raw.items() if k in known})


def uses_zeropp_quantizer(ds_config: dict) -> bool:
    """Whether stock ZeRO++ will load DeepSpeed's quantizer (qwZ or qgZ is on)."""
    zero = ds_config.get("zero_optimization") or {}
    return any(zero.get(key) for key in ZEROPP_QUANTIZER_KEYS)


def stock_scale_ops(ds_config: dict) -> tuple:
    """The ops whose floating-point collectives carry stock ZeRO++'s scales: qwZ gathers INT8 weights and
    their scales; qgZ's all-to-alls send INT4 gradients and their scales."""
    zero = ds_config.get("zero_optimization") or {}
    return tuple(op for key, op in (("zero_quantized_weights", "all_gather"),
                                    ("zero_quantized_gradients", "all_to_all")) if zero.get(key))


def prepare_rank(ds_config: dict, node_size: int | None) -> None:
    """Before the engine is built (deepspeed.comm initialised): count every collective; on CPU ranks, stand the
    package's quantizer in for stock ZeRO++'s CUDA-only one."""
    from ..platform.deepspeed_internals import install_cpu_zeropp_quantizer

    ledger.install(node_size)
    if uses_zeropp_quantizer(ds_config):
        install_cpu_zeropp_quantizer()  # changes nothing where DeepSpeed has its own (CUDA)
    scale_ops = stock_scale_ops(ds_config)
    if scale_ops:
        ledger.get().count_floating_as_scales(scale_ops)


def check_engine(engine, ds_config: dict, expected_optimizer: str | None, arm: str) -> None:
    """The engine is the arm's: its optimizer class contains `expected_optimizer`; an offload arm steps with
    DeepSpeed's host Adam. Otherwise the arm would not measure what it claims to."""
    from ..platform.deepspeed_internals import autoep_groups

    name = type(engine.optimizer).__name__
    if expected_optimizer and expected_optimizer not in name:
        hint = (" (does the script call ds_asynchzp.initialize, or ds_asynchzp.register() before the framework "
                "builds its engine?)" if expected_optimizer == "HierarchicalZeroOptimizer" else "")
        raise RuntimeError(f"arm {arm}: expects an optimizer whose class name contains {expected_optimizer!r}, but "
                           f"the engine built {type(engine.optimizer).__module__}.{name}{hint}; the arm would not "
                           "measure what it claims to")
    host = type(getattr(engine.optimizer, "optimizer", None)).__name__
    if offloads_optimizer(ds_config) and "CPUAdam" not in host:
        raise RuntimeError(f"arm {arm}: the arm offloads the optimizer, but the engine steps with {host}, not "
                           "DeepSpeedCPUAdam; the arm would not measure what it claims to")
    # AutoEP's groups, so the ledger can tell expert and token traffic from dense traffic.
    ledger.get().set_expert_groups(*autoep_groups())


class EngineRecording:
    """Watches one engine's forward, backward and step (`runtime.observers.watch_engine`) and drives a
    `StepRecorder`."""

    def __init__(self, engine, ds_config: dict, settings: RecordSettings, started: float):
        from ..platform.deepspeed_internals import ds_comm

        self.engine, self.ds_config, self.settings = engine, ds_config, settings
        self.rank, self.world = ds_comm.get_rank(), ds_comm.get_world_size()
        self._barrier = ds_comm.barrier
        self.startup = {"initialize_s": time.perf_counter() - started}
        if settings.launched_at is not None:
            # From the tool starting the launch command to this rank's engine: interpreters, imports, launcher.
            self.startup["launch_to_engine_s"] = max(0.0, time.time() - settings.launched_at
                                                     - self.startup["initialize_s"])
        self.recorder = StepRecorder(engine, steps=settings.steps, warmup_steps=settings.warmup_steps,
                                     node_size=ledger.get().node_size, rank=self.rank, world=self.world,
                                     read_link_counter=settings.read_link_counter, barrier=ds_comm.barrier)
        self._losses: list = []
        self._boundary = False
        self._finished = False
        # Registered before the script's own handlers that follow, so it runs after them.
        atexit.register(_teardown, engine)
        watch_engine(engine, self)

    def forward_begun(self, engine) -> None:
        import torch

        # A forward with gradients opens an optimizer step; evaluation forwards (no grad) do not.
        if not self.recorder.in_step and torch.is_grad_enabled() and not self._finished:
            self.recorder.begin_step()
        ledger.set_phase("forward")

    def backward_begun(self, engine, loss) -> None:
        if self._finished:
            return
        if not self.recorder.in_step:
            self.recorder.begin_step()
        self._losses.append(loss.detach())
        ledger.set_phase("backward")

    def step_begun(self, engine) -> None:
        self._boundary = engine.is_gradient_accumulation_boundary() and not self._finished
        if self._boundary:
            self.recorder.before_last_step()
        ledger.set_phase("step")

    def forward_ended(self, engine) -> None:
        ledger.set_phase("")

    backward_ended = forward_ended

    def step_ended(self, engine) -> None:
        ledger.set_phase("")
        if self._boundary and self.recorder.in_step and not self._finished:
            self._end_step()

    def _end_step(self) -> None:
        import torch
        from deepspeed.accelerator import get_accelerator

        get_accelerator().synchronize()  # a device's queued work belongs to the step it was issued in
        losses = self._losses
        self._losses = []
        loss = float(torch.stack([l.float().reshape(()) for l in losses]).mean()) if losses else float("nan")
        self.recorder.end_step(loss)
        done = self.recorder.index
        if self.rank == 0:
            print(f"{PROGRESS_MARK} {done}/{self.settings.steps} arm {self.settings.arm} loss {loss:.6f}", flush=True)
        if done >= self.settings.steps:
            self._finish()

    def _finish(self) -> None:
        """Write this rank's record, wait for every rank's, and end the script as a normal exit would (`end_script`):
        the arm has what it came for. The engine stays up for the script's `finally` blocks and exit handlers (a
        checkpoint saved there works); `_teardown` shuts it down at exit."""
        if self._finished:
            return
        self._finished = True
        record = self.recorder.finish(self.ds_config)
        record.update({"arm": self.settings.arm, "startup_s": self.startup})
        os.makedirs(self.settings.out_dir, exist_ok=True)
        write_json_atomically(os.path.join(self.settings.out_dir, f"rank{self.rank}.json"), record, indent=None)
        # No rank leaves while a peer may still be in the last step's collectives.
        self._barrier()
        if self.rank == 0:
            print(f"[ds_asynchzp] asynchzp-ab: arm {self.settings.arm}: {self.settings.steps} optimizer steps "
                  f"recorded in {self.settings.out_dir}; ending the job", flush=True)
        end_script(self.settings.arm)


def _teardown(engine) -> None:
    """At interpreter exit, after the script's own exit handlers registered once the engine was built (they run
    earlier): the engine (its threads stop and its peer monitor says this rank ended cleanly, so a peer still in its
    own exit code is not ended for it), the process group, and the shared-memory workspace DeepSpeed's CPU
    communication op leaves per rank (66 MiB of RAM each), which nothing else removes once the job is ended here."""
    import torch

    destroy = getattr(engine, "destroy", None)
    if destroy is not None:
        try:
            destroy()
        except Exception as error:  # the script may have shut it down itself; exit goes on
            print(f"[ds_asynchzp] asynchzp-ab: engine shutdown at exit: {type(error).__name__}: {error}",
                  file=sys.stderr, flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if os.environ.get("LOCAL_RANK") == "0" and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        from ..platform.deepspeed_internals import cpu_comm_workspaces

        for path in cpu_comm_workspaces(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])):
            path.unlink(missing_ok=True)


def end_script(arm: str, grace_s: float = EXIT_GRACE_S) -> None:
    """End the user's script after its last recorded step as `sys.exit(0)` would: `SystemExit` unwinds it, so its
    `finally` blocks and `with` exits run (the engine still up), then its `atexit` handlers, then `_teardown`; code
    after the training loop does not run. Where the script does not end (it caught `SystemExit`, or a thread it did not make a daemon
    keeps it alive), a daemon thread ends the process after `grace_s` and says what that cut off."""

    def cut_off() -> None:
        time.sleep(grace_s)
        alive = [t.name for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon
                 and t is not threading.main_thread()]
        print(f"[ds_asynchzp] asynchzp-ab: arm {arm}: the script was still running {grace_s:g} s after its last "
              "recorded step (it caught SystemExit, or threads kept it alive: "
              f"{', '.join(alive) or 'none besides the main thread'}); ending the process now, without the rest of "
              "its code or its exit handlers", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)

    threading.Thread(target=cut_off, name="asynchzp-ab-exit", daemon=True).start()
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(0)


class ReferenceLabel:
    """Watches an engine without an optimizer (a reference model, a teacher): the collectives its forwards issue on
    the training thread carry the ledger's model label ``"reference"`` (`platform.ledger.model_scope`), so the
    record splits them out (``by_model``) where node links and, under stock ZeRO-3, process groups cannot; and they
    count in the forward phase (`formulas.flows`), the phase before restored after. A forward that raises ends
    its label as one that returns does."""

    LABEL = "reference"

    def __init__(self, engine):
        self._open = threading.local()   # per thread: the scopes entered and the phases to restore
        watch_engine(engine, self)

    def forward_begun(self, engine) -> None:
        comm_ledger = ledger.get()
        scope = ledger.model_scope(self.LABEL)
        scope.__enter__()
        stack = getattr(self._open, "stack", None)
        if stack is None:
            stack = self._open.stack = []
        stack.append((scope, comm_ledger.phase if comm_ledger is not None else ""))
        ledger.set_phase("forward")

    def forward_ended(self, engine) -> None:
        stack = getattr(self._open, "stack", None)
        if stack:
            scope, phase = stack.pop()
            ledger.set_phase(phase)
            scope.__exit__(None, None, None)

    forward_failed = forward_ended


class ArmRecorder:
    """The observer `asynchzp-ab` names: records the first engine with an optimizer built under a ds_config that
    holds `RECORD_KEY`; the forwards of an engine without one (a reference model) are labelled
    (`ReferenceLabel`), not recorded as steps."""

    def __init__(self):
        self._begun: tuple[RecordSettings, float] | None = None
        self.recording: EngineRecording | None = None

    def before_engine(self, ds_config: dict) -> None:
        """The settings of a recorded arm, with communication initialised as `deepspeed.initialize` would and the
        ledger counting."""
        settings = RecordSettings.from_ds_config(ds_config)
        if settings is None or self.recording is not None:
            self._begun = None
            return   # one engine per job is recorded: the first with an optimizer
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        from ..platform.deepspeed_internals import ds_comm

        started = time.perf_counter()
        if not ds_comm.is_initialized():
            deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
        prepare_rank(ds_config, settings.node_size)
        self._begun = (settings, started)

    def after_engine(self, engine, ds_config: dict) -> None:
        """Check the engine is the arm's and record its optimizer steps."""
        from ..platform.deepspeed_internals import is_parameter_only_engine

        begun, self._begun = self._begun, None
        if is_parameter_only_engine(engine):
            # A parameter-only engine (a reference model), built before or after the recorded one: nothing
            # steps, but its forwards' bytes are the arm's too.
            if RecordSettings.from_ds_config(ds_config) is not None and ledger.get() is not None:
                ReferenceLabel(engine)
            return
        if begun is None:
            return  # not a recorded arm
        settings, started = begun
        check_engine(engine, ds_config, settings.expected_optimizer, settings.arm)
        self.recording = EngineRecording(engine, ds_config, settings, started)


def observer() -> ArmRecorder:
    """The factory `asynchzp-ab` names in ``DS_ASYNCHZP_OBSERVERS``."""
    return ArmRecorder()
