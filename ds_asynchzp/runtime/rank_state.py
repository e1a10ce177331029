"""Per-rank state of ours in a checkpoint: today the error-feedback residual of the quantized gradient exchange.

DeepSpeed's files hold what every optimizer partition owns; the residual is each rank's own (the part of the
rows it sent that quantization dropped), so every rank writes one small file of its own into the checkpoint,
`asynchzp_rank<R>_state.pt`, staged and committed with the rest. A full resume at the same world size and
layout restores it. Anywhere else (another world size or layout, a universal or weights-only load) the rows
it describes belong to other ranks or no longer exist: the residual starts from zero, which costs one step's
worth of quantization error, and rank 0 says so.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from ..errors import CheckpointError

FILE_FORMAT = "ds_asynchzp-rank-state/2"  # error_feedback: {family name: residual state}
_FORMAT_1 = "ds_asynchzp-rank-state/1"      # error_feedback: the dense family's residual state alone


def file_name(rank: int) -> str:
    return f"asynchzp_rank{rank}_state.pt"


def _layout_of(optimizer) -> Optional[dict]:
    """What the residual's rows depend on: the sizes (`resolved_layout.LAYOUT_KEYS`) and the quantization's wire
    format, under the keys the files already on disk hold."""
    layout = getattr(optimizer, "hzp_layout", None)
    return None if layout is None else {**layout.sizes.as_saved(), **layout.quantization.residual_format()}


def _feedbacks(engine) -> dict:
    """Family name -> error-feedback residual, for the families that keep one."""
    method = getattr(engine.optimizer, "hzp_error_feedbacks", None)
    return method() if method is not None else {}


def save(engine, tag_dir: str) -> None:
    """Write this rank's state into `tag_dir` (created if needed), if it has any."""
    feedbacks = _feedbacks(engine)
    if not feedbacks:
        return
    os.makedirs(tag_dir, exist_ok=True)
    state = {"format": FILE_FORMAT, "rank": engine.global_rank, "layout": _layout_of(engine.optimizer),
             "error_feedback": {name: feedback.state_dict() for name, feedback in feedbacks.items()}}
    torch.save(state, os.path.join(tag_dir, file_name(engine.global_rank)))


def load(engine, tag_dir: str, same_layout: bool) -> None:
    """Restore this rank's state from `tag_dir` when the checkpoint was saved at this layout (`same_layout`, and
    the file agrees); otherwise start it from zero."""
    feedbacks = _feedbacks(engine)
    if not feedbacks:
        return
    path = os.path.join(tag_dir, file_name(engine.global_rank))
    reason = None
    if not same_layout:
        reason = "the checkpoint was saved at another world size or layout"
    elif not os.path.isfile(path):
        reason = f"the checkpoint has no {file_name(engine.global_rank)} (saved without error feedback)"
    if reason is None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            raise CheckpointError(f"{path}: unreadable ({type(error).__name__}: {str(error)[:300]})") from None
        if isinstance(state, dict) and state.get("format") == _FORMAT_1:
            state = dict(state, format=FILE_FORMAT, error_feedback={"dense": state.get("error_feedback")})
        if not isinstance(state, dict) or state.get("format") != FILE_FORMAT:
            raise CheckpointError(f"{path}: not a per-rank state file of format {FILE_FORMAT} (or {_FORMAT_1})")
        if state.get("layout") != _layout_of(engine.optimizer):
            reason = f"{path} was saved under layout {state.get('layout')}"
        else:
            try:
                for name, feedback in feedbacks.items():
                    feedback.load_state_dict(state["error_feedback"][name])
            except (KeyError, ValueError, TypeError) as error:
                raise CheckpointError(f"{path}: {error!r}") from None
            return
    for feedback in feedbacks.values():
        feedback.reset()
    if engine.global_rank == 0:
        print(f"[ds_asynchzp] error feedback starts from zero: {reason}", flush=True)
