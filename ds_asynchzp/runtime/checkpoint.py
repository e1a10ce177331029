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
  the optimizer's).
* **Optimizer offload.** Stage 3 saves and loads the host optimizer's states (DeepSpeedCPUAdam's) as the device
  optimizer's, in the same files, as stock does.

docs/checkpoints.md has the whole story.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import uuid
from typing import List

import deepspeed
import torch

from ..errors import CheckpointError
from .checkpoint_files import (FORMAT, MANIFEST, RETIRED_PREFIX, _REPORTED, CheckpointInfo, ModelShapes,
                               check_model, check_partitioning, check_torch_file, check_universal_states,
                               inspect_checkpoint, resolve_tag)
from . import rank_state
from ..platform.deepspeed_internals import ds_comm

STAGING_PREFIX = ".asynchzp-staging-"
# Testing only: the global rank named here SIGKILLs itself inside the save, after its model-state file and
# before its optimizer-state file (a crash in the middle of writing a checkpoint).
FAULT_RANK_ENV = "ASYNCHZP_CHECKPOINT_FAULT_RANK"


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
    # Our per-rank files go in first: DeepSpeed's save ends with the barrier after which rank 0 commits.
    rank_state.save(engine, os.path.join(staging, tag))
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
        "layout": None if layout is None else layout.sizes.as_saved(),   # under resolved_layout.LAYOUT_KEYS
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
        result = _load_weights(engine, info, model, load_module_strict, load_lr_scheduler_states, load_module_only,
                               custom_load_fn)
        rank_state.load(engine, info.directory, same_layout=False)
        return result
    if universal:
        result = load_fn(parent, tag, **kwargs)
        _restore_frozen(engine, info, model)
        rank_state.load(engine, info.directory, same_layout=False)
        return result
    check_partitioning(info, engine.seq_dp_world_size,
                       ds_comm.get_world_size(group=engine.optimizer.dp_process_group))
    result = load_fn(parent, tag, **kwargs)
    rank_state.load(engine, info.directory, same_layout=info.world_size == engine.seq_dp_world_size)
    return result


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
