"""Checkpoints of the AsyncHZP engine: DeepSpeed's ZeRO-3 format, committed atomically, checked before loading.

The optimizer partitions every parameter over the optimizer group (d_o ranks) exactly as stock ZeRO-3 does over
its world, so a checkpoint is an ordinary ZeRO-3 checkpoint of d_o partitions: `zero_to_fp32`, DeepSpeed's
universal conversion (`ds_to_universal`) and stock ZeRO-3 read it. What this module adds:

* **One writer per file.** With d_o < N the N/d_o optimizer replicas hold identical states under identical file
  names (DeepSpeed names files by partition-group rank). Only the first replica writes, model-state files
  included: concurrent writers of one file corrupt it, and DeepSpeed computes the tied-parameter table that
  `zero_to_fp32` reads only on global rank 0.
* **Atomic commit.** Ranks write into a staging directory next to the tags; once every rank is done, rank 0
  writes a manifest (file sizes, parameter shapes, layout), moves the tag into place with a rename and rewrites
  `latest` with another. A save killed at any point leaves the previous tag and `latest` loadable, also when the
  new save reuses the old tag's name.
* **Checks before loading.** Missing, truncated or foreign files and checkpoints of another model are reported
  as `CheckpointError` naming the file, on every rank alike (every rank inspects the same files), before any
  collective of the load.
* **Weights-only loads at any size.** `load_module_only=True` or `load_optimizer_states=False` read the
  consolidated fp32 weights of the requested tag, at any world size and layout. A full resume at another size
  or d_o goes through a universal checkpoint, whose frozen parameters are restored too (DeepSpeed restores only
  the optimizer's). docs/checkpoints.md has the whole story.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import uuid
import zipfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import deepspeed
import torch

from ..errors import CheckpointError
from .deepspeed_internals import ds_comm, engine_zero_param_shapes

MANIFEST = "asynchzp_manifest.json"
FORMAT = "ds_asynchzp-checkpoint/1"
STAGING_PREFIX = ".asynchzp-staging-"
RETIRED_PREFIX = ".asynchzp-retired-"
# Testing only: the global rank named here SIGKILLs itself inside the save, after its model-state file and
# before its optimizer-state file (a crash in the middle of writing a checkpoint).
FAULT_RANK_ENV = "ASYNCHZP_CHECKPOINT_FAULT_RANK"

_MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_UNIVERSAL_STATES = ("fp32", "exp_avg", "exp_avg_sq")
_REPORTED = 5  # differences listed in one error message
_LAYOUT_KEYS = ("world_size", "node_size", "param_shard_size", "grad_shard_size", "optimizer_shard_size")


# ----------------------------------------------------------------------------------------------------- save
def save_checkpoint(engine, save_fn, save_dir, tag=None, client_state=None, save_latest=True,
                    exclude_frozen_parameters=False):
    """DeepSpeed's `save_checkpoint` (`save_fn`), staged and committed atomically. Collective, as DeepSpeed's."""
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    if tag in ("", ".", "..") or os.sep in tag or "/" in tag or tag.startswith((STAGING_PREFIX, RETIRED_PREFIX)):
        raise ValueError(f"checkpoint tag {tag!r} must be a plain directory name")
    client_state = {} if client_state is None else client_state
    if engine.checkpoint_engine.is_decoupled() or engine.use_node_local_storage():
        # A decoupled engine writes after save_checkpoint returns, and node-local storage has one directory per
        # node: neither can be committed by one rename on rank 0, so they keep DeepSpeed's own (non-atomic) save.
        return save_fn(save_dir, tag, client_state=client_state, save_latest=save_latest,
                       exclude_frozen_parameters=exclude_frozen_parameters)
    nonce = [uuid.uuid4().hex if engine.global_rank == 0 else None]
    ds_comm.broadcast_object_list(nonce, src=0)  # every rank writes into the same staging directory
    staging = os.path.join(save_dir, STAGING_PREFIX + nonce[0])
    writes_model_states = engine.save_non_zero_checkpoint
    # DeepSpeed sets save_zero_checkpoint on the first optimizer replica only (partition-group rank == data-parallel
    # rank); its model-state files have the same names and contents on every replica, so they follow that rule.
    engine.save_non_zero_checkpoint = writes_model_states and engine.save_zero_checkpoint
    try:
        save_fn(staging, tag, client_state=client_state, save_latest=False,
                exclude_frozen_parameters=exclude_frozen_parameters)
    finally:
        engine.save_non_zero_checkpoint = writes_model_states
    # DeepSpeed's save ends with a barrier: every rank's files are complete in the staging directory now.
    status = [None]
    if engine.global_rank == 0:
        try:
            _commit(save_dir, staging, tag, save_latest, nonce[0], _manifest(engine, tag, exclude_frozen_parameters))
        except Exception as error:  # reported to every rank, which would otherwise wait for rank 0 forever
            status[0] = f"{type(error).__name__}: {error}"
    # Nobody returns before the commit (a rank may load right after), and a failed commit fails every rank.
    ds_comm.broadcast_object_list(status, src=0)
    if status[0] is not None:
        raise CheckpointError(f"{os.path.join(save_dir, tag)}: committing the checkpoint failed on rank 0 "
                              f"({status[0]}); the previous checkpoints and 'latest' are unchanged")
    return True


def save_zero_checkpoint(engine, save_fn, save_path, tag):
    """DeepSpeed's per-rank optimizer-state file, written by the first optimizer replica only."""
    if not engine.save_zero_checkpoint:
        return None
    if os.environ.get(FAULT_RANK_ENV) == str(engine.global_rank):
        os.kill(os.getpid(), signal.SIGKILL)
    return save_fn(save_path, tag)


def save_16bit_model(engine, save_fn, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False):
    """DeepSpeed's consolidated 16-bit weights, written under a temporary name and renamed when complete."""
    temporary = f".{save_filename}.asynchzp-tmp"
    saved = save_fn(save_dir, temporary, exclude_frozen_parameters=exclude_frozen_parameters)
    status = [None]
    if saved and engine.global_rank == 0:  # DeepSpeed writes the file on global rank 0
        try:
            _fsync_file(os.path.join(save_dir, temporary))
            os.replace(os.path.join(save_dir, temporary), os.path.join(save_dir, save_filename))
            _fsync_dir(save_dir)
        except OSError as error:
            status[0] = f"{type(error).__name__}: {error}"
    ds_comm.broadcast_object_list(status, src=0)
    if status[0] is not None:
        raise CheckpointError(f"{os.path.join(save_dir, save_filename)}: writing the 16-bit model failed ({status[0]})")
    return saved


def _manifest(engine, tag: str, exclude_frozen_parameters: bool) -> dict:
    """What a load checks before reading any tensor (the file sizes are added once the files are complete)."""
    layout = getattr(engine.optimizer, "hzp_layout", None)
    model = ModelShapes.of_engine(engine)
    return {
        "format": FORMAT,
        "tag": tag,
        "deepspeed_version": deepspeed.__version__,
        "world_size": engine.seq_dp_world_size,
        "partition_count": ds_comm.get_world_size(group=engine.optimizer.dp_process_group),
        "layout": None if layout is None else {key: getattr(layout, key) for key in _LAYOUT_KEYS},
        "global_steps": engine.global_steps,
        "param_shapes": [[[name, list(shape)] for name, shape in group] for group in model.trainable],
        # As DeepSpeed's model-state files: None when the save left the frozen parameters out.
        "frozen_param_shapes": None if exclude_frozen_parameters else {n: list(s) for n, s in model.frozen.items()},
    }


def _commit(save_dir: str, staging: str, tag: str, save_latest: bool, nonce: str, manifest: dict) -> None:
    staged = os.path.join(staging, tag)
    manifest["files"] = {rel: os.path.getsize(os.path.join(staged, rel)) for rel in _files_under(staged)}
    _write_atomic(os.path.join(staged, MANIFEST), json.dumps(manifest, indent=1))
    for rel in _files_under(staged):
        _fsync_file(os.path.join(staged, rel))
    _fsync_dir(staged)
    _repair(save_dir)
    final = os.path.join(save_dir, tag)
    retired = None
    if os.path.lexists(final):
        # The old tag leaves only once the new one is complete; a kill between the two renames leaves it in
        # the retired directory, where loading finds it (and the next save puts it back).
        retired = os.path.join(save_dir, RETIRED_PREFIX + nonce)
        os.mkdir(retired)
        os.rename(final, os.path.join(retired, tag))
    os.rename(staged, final)
    for name in os.listdir(staging):  # the recovery scripts (zero_to_fp32.py) DeepSpeed puts next to the tags
        if os.path.isfile(os.path.join(staging, name)):
            os.replace(os.path.join(staging, name), os.path.join(save_dir, name))
    if save_latest:
        _write_atomic(os.path.join(save_dir, "latest"), tag)
    _fsync_dir(save_dir)
    if retired is not None:
        shutil.rmtree(retired)
    for name in os.listdir(save_dir):  # this save's staging directory and those of saves killed earlier
        if name.startswith(STAGING_PREFIX):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def _repair(save_dir: str) -> None:
    """Undo a save killed between moving an old tag aside and moving the new one in: restore the old tag."""
    for name in sorted(os.listdir(save_dir)):
        retired = os.path.join(save_dir, name)
        if not name.startswith(RETIRED_PREFIX) or not os.path.isdir(retired):
            continue
        for tag in os.listdir(retired):
            if os.path.lexists(os.path.join(save_dir, tag)):
                shutil.rmtree(os.path.join(retired, tag))
            else:
                os.rename(os.path.join(retired, tag), os.path.join(save_dir, tag))
        os.rmdir(retired)


def _files_under(directory: str) -> List[str]:
    found = []
    for root, _, files in os.walk(directory):
        found.extend(os.path.relpath(os.path.join(root, f), directory) for f in files)
    return sorted(found)


def _write_atomic(path: str, text: str) -> None:
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        _fsync_file(path)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the renames are still atomic


# ----------------------------------------------------------------------------------------------- inspection
@dataclass
class ModelShapes:
    """What a checkpoint must match: the trainable parameters per optimizer sub-group in flat-buffer order, the
    frozen ones, and every state-dict key of the module (tied parameters under each of their names)."""

    trainable: List[List[Tuple[str, tuple]]]
    frozen: Dict[str, tuple]
    state_keys: List[str] = field(default_factory=list)

    @classmethod
    def of_engine(cls, engine) -> "ModelShapes":
        trainable = [[(name, tuple(shape)) for name, shape in group.items()]
                     for group in engine_zero_param_shapes(engine)]
        names = {name for group in trainable for name, _ in group}
        frozen = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in engine.module.named_parameters()
                  if name not in names}
        return cls(trainable, frozen, list(engine.module.state_dict().keys()))


@dataclass
class CheckpointInfo:
    """What inspecting one tag directory found (only metadata; no tensor is read)."""

    directory: str
    universal: bool
    model_files: List[str]
    optim_files: List[str]
    manifest: Optional[dict]
    param_shapes: Optional[List[List[Tuple[str, tuple]]]]  # None: the metadata could not be read safely
    frozen_param_shapes: Optional[Dict[str, tuple]]
    world_size: Optional[int]

    @property
    def partition_count(self) -> int:
        return len(self.model_files) if self.universal else len(self.optim_files)


def inspect_checkpoint(directory: str, universal: bool = False, need_optimizer: bool = True) -> CheckpointInfo:
    """Check one tag directory before anything is loaded: every file it needs exists, is a complete torch file
    (and has the size the manifest recorded), and the metadata says what was saved. `need_optimizer`: a
    universal checkpoint must hold the optimizer states too. Raises CheckpointError."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    names = sorted(os.listdir(directory))
    manifest = _read_manifest(directory) if MANIFEST in names else None
    if manifest is not None:
        for rel, size in manifest["files"].items():
            path = os.path.join(directory, rel)
            if not os.path.isfile(path):
                raise CheckpointError(f"{path}: missing; the manifest of this checkpoint lists it")
            if os.path.getsize(path) != size:
                raise CheckpointError(f"{path}: {os.path.getsize(path)} bytes, the save wrote {size}: the file was "
                                      "truncated or rewritten after the checkpoint was committed")
    model_files = _numbered(directory, names, _MODEL_FILE, "model-state")
    optim_files = _numbered(directory, names, _OPTIM_FILE, "optimizer-state")
    if not model_files:
        hint = (" (a ZeRO stage 0-2 checkpoint, which this ZeRO-3 engine cannot load)"
                if "mp_rank_00_model_states.pt" in names else "")
        raise CheckpointError(f"{directory}: not a DeepSpeed ZeRO-3 checkpoint: no zero_pp_rank_*_mp_rank_00_"
                              f"model_states.pt file{hint}; it holds {names[:8]}")
    for path in model_files + optim_files:
        check_torch_file(path)
    if universal:
        if not os.path.isdir(os.path.join(directory, "zero")):
            raise CheckpointError(f"{directory}: not a universal checkpoint (no zero/ directory); convert it with "
                                  f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {directory} "
                                  "--output_folder <new folder>")
        if need_optimizer:
            check_torch_file(os.path.join(directory, "zero", "optimizer_state.pt"))
    elif os.path.isdir(os.path.join(directory, "zero")) and not optim_files:
        raise CheckpointError(f"{directory}: a universal checkpoint; load it with "
                              '"checkpoint": {"load_universal": true} in the ds_config')
    elif len(optim_files) != len(model_files):
        # The optimizer-state files hold the fp32 weights too: every load of a non-universal checkpoint needs them.
        raise CheckpointError(f"{directory}: {len(model_files)} model-state files but {len(optim_files)} "
                              "optimizer-state files (*zero_pp_rank_*_optim_states.pt); a ZeRO-3 save writes one "
                              "of each per partition")
    param_shapes = frozen = world = None
    if manifest is not None:
        param_shapes = [[(name, tuple(shape)) for name, shape in group] for group in manifest["param_shapes"]]
        if manifest["frozen_param_shapes"] is not None:
            frozen = {name: tuple(shape) for name, shape in manifest["frozen_param_shapes"].items()}
        world = manifest["world_size"]
    else:
        state = _safe_load(model_files[0])
        if state is not None:
            if not isinstance(state, dict) or "param_shapes" not in state or "buffer_names" not in state:
                raise CheckpointError(f"{model_files[0]}: not a DeepSpeed model-state file (no param_shapes)")
            param_shapes = [[(name, tuple(shape)) for name, shape in group.items()] for group in state["param_shapes"]]
            saved_frozen = state.get("frozen_param_shapes")
            frozen = None if saved_frozen is None else {n: tuple(s) for n, s in saved_frozen.items()}
            world = state.get("dp_world_size")
        if not universal:
            _check_partition_count(optim_files)
    return CheckpointInfo(directory, universal, model_files, optim_files, manifest, param_shapes, frozen, world)


def check_torch_file(path: str) -> None:
    """A complete file of `torch.save`: a zip archive (whose directory sits at its end, so a truncated file has
    none) holding a pickle, every member inside the file. Reads the archive's directory only."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing")
    size = os.path.getsize(path)
    if size == 0:
        raise CheckpointError(f"{path}: empty (0 bytes): the write was interrupted")
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError) as error:
        raise CheckpointError(f"{path}: not a complete torch.save file ({size} bytes; {error}): truncated, or "
                              "written by something else") from None
    if not any(m.filename.endswith("data.pkl") for m in members):
        raise CheckpointError(f"{path}: a zip archive but not a torch.save file (no data.pkl)")
    for member in members:
        if member.header_offset + member.compress_size > size:
            raise CheckpointError(f"{path}: truncated ({size} bytes; member {member.filename} ends past the end)")


def check_model(info: CheckpointInfo, model: ModelShapes, *, strict: bool, rigid: bool) -> None:
    """The checkpoint holds this model: same parameter names and shapes (strict: no key missing or extra); a rigid
    (full optimizer) load also needs the same trainable parameters in the same flat order. Raises CheckpointError."""
    if info.param_shapes is None:
        return  # metadata holds objects torch.load(weights_only=True) refuses; DeepSpeed's own checks remain
    where = info.model_files[0] if info.manifest is None else os.path.join(info.directory, MANIFEST)
    saved = dict(name_shape for group in info.param_shapes for name_shape in group)
    saved.update(info.frozen_param_shapes or {})
    current = dict(name_shape for group in model.trainable for name_shape in group)
    current.update(model.frozen)
    problems = [f"{name}: saved {list(saved[name])}, this model {list(current[name])}"
                for name in current if name in saved and tuple(saved[name]) != tuple(current[name])]
    required = set(current) if info.frozen_param_shapes is not None else \
        {name for group in model.trainable for name, _ in group}  # frozen ones were excluded from the save
    if strict or info.universal or rigid:
        problems += [f"{name}: not in the checkpoint" for name in sorted(required - set(saved))]
    if strict:
        problems += [f"{name}: in the checkpoint, not in this model" for name in sorted(set(saved) - set(current))]
    if problems:
        more = f" (and {len(problems) - _REPORTED} more)" if len(problems) > _REPORTED else ""
        raise CheckpointError(f"{where}: saved from another model: " + "; ".join(problems[:_REPORTED]) + more)
    if rigid:
        saved_order = [[name for name, _ in group] for group in info.param_shapes]
        current_order = [[name for name, _ in group] for group in model.trainable]
        if saved_order != current_order:
            raise CheckpointError(f"{where}: the trainable parameters (or their order or optimizer sub-groups) "
                                  "differ from this model's, so the optimizer states do not line up; load the "
                                  "weights alone with load_optimizer_states=False")


def check_universal_states(info: CheckpointInfo, model: ModelShapes, need_optimizer: bool) -> None:
    """Every trainable parameter of this model has its files in the universal checkpoint."""
    states = _UNIVERSAL_STATES if need_optimizer else ("fp32",)
    for group in model.trainable:
        for name, _ in group:
            for state in states:
                check_torch_file(os.path.join(info.directory, "zero", name, f"{state}.pt"))


def check_partitioning(info: CheckpointInfo, world_size: int, partition_count: int) -> None:
    """A full (non-universal) resume reads partition q of the saved flat states into partition q: the world and
    the optimizer partitioning must be the saved ones."""
    if info.world_size == world_size and info.partition_count == partition_count:
        return
    raise CheckpointError(
        f"{info.directory}: saved at data-parallel world {info.world_size} with optimizer states in "
        f"{info.partition_count} partitions; this engine has world {world_size} and {partition_count} partitions "
        "(optimizer_shard_size). Convert it once with python -m deepspeed.checkpoint.ds_to_universal "
        f"--input_folder {info.directory} --output_folder <new folder> and load that with "
        '"checkpoint": {"load_universal": true}, or load the weights alone with load_optimizer_states=False')


def resolve_tag(load_dir: str, tag: str) -> str:
    """The directory that holds `tag`: `load_dir`, or the retired copy a save killed mid-commit left behind."""
    if os.path.isdir(os.path.join(load_dir, tag)):
        return load_dir
    if os.path.isdir(load_dir):
        for name in sorted(os.listdir(load_dir)):
            if name.startswith(RETIRED_PREFIX) and os.path.isdir(os.path.join(load_dir, name, tag)):
                return os.path.join(load_dir, name)
        tags = sorted(n for n in os.listdir(load_dir) if os.path.isdir(os.path.join(load_dir, n))
                      and not n.startswith("."))
        raise CheckpointError(f"{os.path.join(load_dir, tag)}: no such checkpoint tag; {load_dir} holds {tags}")
    raise CheckpointError(f"{load_dir}: no such checkpoint directory")


def _numbered(directory: str, names: List[str], pattern, kind: str) -> List[str]:
    """Files of one kind in partition order; a gap in the numbering names the missing file."""
    found = {}
    for name in names:
        match = pattern.match(name)
        if match:
            if int(match.group(2)) != 0:
                raise CheckpointError(f"{os.path.join(directory, name)}: saved with model parallelism "
                                      "(mp_rank > 0), which this engine does not support")
            found[int(match.group(1))] = os.path.join(directory, name)
    for rank in range(len(found)):
        if rank not in found:
            raise CheckpointError(f"{directory}: the {kind} file of partition {rank} is missing "
                                  f"(found partitions {sorted(found)})")
    return [found[rank] for rank in range(len(found))]


def _read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as handle:
            manifest = json.load(handle)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable manifest ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a manifest of format {FORMAT}")
    return manifest


def _check_partition_count(optim_files: List[str]) -> None:
    """Without a manifest, the last partitions' files could be missing unnoticed: the optimizer states record
    how many partitions the save had."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    with torch.serialization.safe_globals([ZeroStageEnum, LossScaler, DynamicLossScaler]):
        state = _safe_load(optim_files[0])
    zero_state = state.get("optimizer_state_dict") if isinstance(state, dict) else None
    count = zero_state.get("partition_count") if isinstance(zero_state, dict) else None
    count = max(count) if isinstance(count, list) else count
    if isinstance(count, int) and count != len(optim_files):
        raise CheckpointError(f"{optim_files[0]}: saved by one of {count} partitions, but "
                              f"{os.path.dirname(optim_files[0])} holds {len(optim_files)} optimizer-state files")


def _safe_load(path: str):
    """Metadata through torch.load(weights_only=True) (tensors are mapped, not read); None when the file holds
    objects that loader refuses (a client_state of arbitrary objects): the checks that need them are skipped."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        return None
    except Exception as error:
        raise CheckpointError(f"{path}: unreadable ({type(error).__name__}: {str(error)[:300]})") from None


# ---------------------------------------------------------------------------------------------------- load
def load_checkpoint(engine, load_fn, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                    load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
    """DeepSpeed's `load_checkpoint` (`load_fn`) after checking the files; weights-only loads at any size."""
    universal = engine.load_universal_checkpoint()
    kwargs = dict(load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                  load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                  custom_load_fn=custom_load_fn)
    if tag is None:
        latest = os.path.join(load_dir, "latest_universal" if universal else "latest")
        if not os.path.isfile(latest):
            return load_fn(load_dir, None, **kwargs)  # DeepSpeed's own answer: a warning and (None, None)
        with open(latest) as handle:
            tag = handle.read().strip()
        if not tag:
            raise CheckpointError(f"{latest}: empty")
    parent = resolve_tag(load_dir, tag)
    weights_only = load_module_only or not load_optimizer_states
    info = inspect_checkpoint(os.path.join(parent, tag), universal=universal, need_optimizer=not weights_only)
    model = ModelShapes.of_engine(engine)
    check_model(info, model, strict=load_module_strict and custom_load_fn is None,
                rigid=not universal and not weights_only)
    if universal:
        check_universal_states(info, model, need_optimizer=not weights_only)
    if weights_only:
        return _load_weights(engine, info, model, load_module_strict, load_lr_scheduler_states, load_module_only,
                             custom_load_fn)
    if universal:
        result = load_fn(parent, tag, **kwargs)
        _restore_frozen(engine, info, model)
        return result
    check_partitioning(info, engine.seq_dp_world_size,
                       ds_comm.get_world_size(group=engine.optimizer.dp_process_group))
    return load_fn(parent, tag, **kwargs)


class _UniversalFp32:
    """One parameter of a universal checkpoint, read when needed (like zero_to_fp32's lazy tensors)."""

    def __init__(self, path: str):
        self.path = path

    def contiguous(self) -> torch.Tensor:
        saved = torch.load(self.path, map_location="cpu", weights_only=True)
        return (saved["param"] if isinstance(saved, dict) else saved).contiguous()


def _fp32_state(engine, info: CheckpointInfo, model: ModelShapes) -> dict:
    """Name -> full fp32 value (lazy: `.contiguous()` reads it), tied parameters under each of their names."""
    if not info.universal:
        # DeepSpeed's zero_to_fp32 reader, for this tag (DeepSpeed's own load path reads `latest` instead).
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        parent, tag = os.path.split(info.directory)
        return get_fp32_state_dict_from_zero_checkpoint(parent, tag, lazy_mode=True)
    state = {name: _UniversalFp32(os.path.join(info.directory, "zero", name, "fp32.pt"))
             for group in model.trainable for name, _ in group}
    state.update(_frozen_state(engine, info, model))
    saved = engine.checkpoint_engine.load(info.model_files[0], map_location="cpu")
    for alias, source in (saved.get("shared_params") or {}).items():
        if source in state:
            state[alias] = state[source]
    return state


def _frozen_state(engine, info: CheckpointInfo, model: ModelShapes) -> dict:
    """Frozen parameters from the fragments of the model-state files (one per saved partition, concatenated in
    partition order), for the frozen parameters of this model that the checkpoint holds."""
    names = [name for name in model.frozen if name in (info.frozen_param_shapes or {})]
    if not names:
        return {}
    # DeepSpeed's own reader, as its load uses for these files: a client_state may hold any object.
    fragments = [engine.checkpoint_engine.load(path, map_location="cpu").get("frozen_param_fragments") or {}
                 for path in info.model_files]
    state = {}
    for name in names:
        missing = [path for path, part in zip(info.model_files, fragments) if name not in part]
        if missing:
            raise CheckpointError(f"{missing[0]}: no fragment of frozen parameter {name}")
        numel = int(torch.Size(info.frozen_param_shapes[name]).numel())
        state[name] = torch.cat([part[name].reshape(-1) for part in fragments])[:numel].view(
            info.frozen_param_shapes[name])
    return state


def _load_weights(engine, info: CheckpointInfo, model: ModelShapes, strict: bool, load_lr_scheduler_states: bool,
                  load_module_only: bool, custom_load_fn):
    """Weights from the consolidated fp32 state (any world size, any layout), set through GatheredParameters so
    that every shard follows; the fp32 master copies are refreshed from them, as DeepSpeed does on this path.
    Unless module-only, the scheduler, step counters and client state come from the model-state file."""
    state = _fp32_state(engine, info, model)
    module = engine.module
    if strict and custom_load_fn is None:
        missing = sorted(set(model.state_keys) - set(state))
        if missing:  # before any collective; check_model caught parameters, this also catches buffers
            raise CheckpointError(f"{info.directory}: no saved value for {missing[:_REPORTED]}")
    engine.optimizer.checkpoint_event_prologue()
    if custom_load_fn is not None:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
            custom_load_fn(src={k: v.contiguous() for k, v in state.items()}, dst=module)
    else:
        _set_weights(module, state)
    engine.optimizer.refresh_fp32_params()
    engine.optimizer.checkpoint_event_epilogue()
    saved = engine.checkpoint_engine.load(info.model_files[0], map_location="cpu")
    engine.loaded_checkpoint_dp_world_size = saved["dp_world_size"]
    kept = ["module"]
    if not load_module_only:
        if load_lr_scheduler_states and engine.lr_scheduler is not None and saved.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])
        engine.global_steps = saved["global_steps"]
        engine.global_samples = saved.get("global_samples", engine.global_steps * engine.train_batch_size())
        engine.skipped_steps = saved["skipped_steps"]
        engine.loaded_checkpoint_mp_world_size = saved["mp_world_size"]
        if (engine.training_dataloader is not None and engine.curriculum_learning_enabled()
                and saved.get("data_sampler") is not None):
            engine.training_dataloader.data_sampler.load_state_dict(saved["data_sampler"])
        if engine.random_ltd_enabled() and engine.random_ltd_scheduler is not None and "random_ltd" in saved:
            engine.random_ltd_scheduler.load_state_dict(saved["random_ltd"])
        kept += ["skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler", "random_ltd"]
        if load_lr_scheduler_states:
            kept.append("lr_scheduler")
    return info.model_files[0], {key: value for key, value in saved.items() if key not in kept}


def _restore_frozen(engine, info: CheckpointInfo, model: ModelShapes) -> None:
    """DeepSpeed's universal load restores the optimizer's parameters only: set the frozen ones too."""
    state = _frozen_state(engine, info, model)
    if state:
        engine.optimizer.checkpoint_event_prologue()
        _set_weights(engine.module, state)
        engine.optimizer.checkpoint_event_epilogue()


def _set_weights(module, state: dict) -> None:
    """Copy full values (keys of `state`; others stay) into the module, one submodule's parameters at a time
    through GatheredParameters(modifier_rank=0): DeepSpeed re-partitions them, and AsyncHZP's parameter-update
    hook rewrites their shards, so every copy of every parameter follows. One submodule is gathered at a time."""
    for prefix, submodule in module.named_modules():
        prefix = f"{prefix}." if prefix else ""
        params = [(prefix + n, p) for n, p in submodule.named_parameters(recurse=False) if prefix + n in state]
        buffers = [(prefix + n, b) for n, b in submodule.named_buffers(recurse=False) if prefix + n in state]
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0), torch.no_grad():
            for name, param in params:
                param.data.copy_(state[name].contiguous().to(param.dtype).view(param.data.shape))
        with torch.no_grad():
            for name, buffer in buffers:
                buffer.copy_(state[name].contiguous())


__all__ = ["save_checkpoint", "save_zero_checkpoint", "save_16bit_model", "load_checkpoint", "inspect_checkpoint",
           "check_torch_file", "check_model", "check_partitioning", "resolve_tag", "ModelShapes", "CheckpointInfo",
           "MANIFEST", "FAULT_RANK_ENV"]
