"""Checking a checkpoint before loading it: its files are complete, its metadata names this model.

Only metadata is read (zip directories, the manifest, `torch.load(weights_only=True)` with tensors mapped, not
read), so every rank can inspect the same files before any collective of the load, and all fail alike with a
`CheckpointError` naming the file and what is wrong.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ..errors import CheckpointError
from ..platform.deepspeed_internals import engine_zero_param_shapes, optimizer_state_file_classes

MANIFEST = "asynchzp_manifest.json"
FORMAT = "ds_asynchzp-checkpoint/1"
RETIRED_PREFIX = ".asynchzp-retired-"

_MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_UNIVERSAL_STATES = ("fp32", "exp_avg", "exp_avg_sq")
_REPORTED = 5  # differences listed in one error message


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
    with torch.serialization.safe_globals(optimizer_state_file_classes()):
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
