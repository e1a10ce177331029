"""With optimizer offload and `async_hzp.offload_pipeline` (the default), the host step of a sub-group in pieces,
each piece's copy back and refresh running under the host step of the next.

Stage 3 steps a sub-group whole: DeepSpeedCPUAdam over all of it, then a blocking copy of the stepped master
weights into the parameter shard's own row, then (here) the sub-group's refresh. While a rank's shard fits one
`sub_group_size` (1e9 elements by default) that is one sub-group, so nothing overlaps the host step. Here Stage 3's
step of the sub-group runs as it is (DeepSpeedCPUAdam.step: its state, step count and torch's step hooks), and its
one call of the C++ update is cut into pieces at the refresh's chunk edges, each of at least `MIN_PIECE_ELEMENTS`
(`deepspeed_internals.cpu_adam_update_in_pieces`); a sub-group smaller than two of them is one piece. For each
piece in column order:

1. the host blocks until the copies to the host of the gradient chunks that hold it have ended;
2. its gradients are scaled (Stage 3's unscale and clip factor, the same value for every piece);
3. the C++ update steps it;
4. it is cast into a pinned staging slot in the parameter dtype and copied into the own row on the copy-back stream
   (`comm.host_copy.ParamsToDevice`), its padding zeroed in the slot;
5. the refresh of every chunk it completes is submitted (`StepBoundary.refresh_through`): its job waits for the
   copy by the buffer's event.

The values are those of the whole step, bit for bit: scaling and Adam are element-wise, every call of one step
gets the same bias corrections, and every edge but the sub-group's end is a multiple of `VECTOR_ALIGNMENT` from
its start, so no element moves between DeepSpeedCPUAdam's vector loop and its scalar tail.

The host step still begins only once the window is summed across nodes: DeepSpeed 0.19.8 takes the global
gradient norm first in every precision and skips the step when it is not finite (`_get_norm_groups`,
`is_invalid_grad_norm`), with or without clipping, and a step begun on some chunks could not be taken back.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from ..comm.host_copy import ParamsToDevice
from ..platform import ledger
from ..platform.deepspeed_internals import (cpu_adam_update_in_pieces, host_step_in_pieces_refusal, offload_master,
                                            stage3_sub_groups)

# Elements: a multiple of every vector width DeepSpeed's CPU Adam is built for (AVX-512: 16 fp32, AVX2: 8,
# NEON: 4), with room for a wider one.
VECTOR_ALIGNMENT = 64
# Elements a piece holds at least (adjacent chunks are merged up to it). A piece costs the host about 0.3-0.4 ms
# of its own (the loop's bookkeeping, an OpenMP fork and join in the C++ update, the staging cast, the refresh's
# submission), measured on the 2-core test host, where a piece per chunk (33 pieces of 110K elements, a 3 ms host
# step) made the step's end 15 ms longer (docs/benchmarks/2026-11-29-offload-pipeline-2x2-medium-fp32). At the
# C++ update's 1.4 G elements/s measured there, 2^22 elements are about 3 ms of host step: ten times that cost.
MIN_PIECE_ELEMENTS = 1 << 22


def piece_edges(start: int, end: int, chunk_ends: List[int], alignment: int = VECTOR_ALIGNMENT,
                min_elements: int = 1) -> List[int]:
    """The end columns of the pieces of columns [start, end): chunk ends inside it, moved down to a multiple of
    `alignment` from `start`, each kept where the piece it ends holds at least `min_elements` and leaves at least
    that many to `end`; then `end`."""
    edges = []
    for chunk_end in chunk_ends:
        if start < chunk_end < end:
            edge = start + (chunk_end - start) // alignment * alignment
            if edge - (edges[-1] if edges else start) >= max(1, min_elements) and end - edge >= min_elements:
                edges.append(edge)
    return edges + [end]


def unscale_factor(loss_scale, clip_grad: float, total_norm):
    """What Stage 3's `unscale_and_clip_grads` multiplies a sub-group's gradients by (its arithmetic, unchanged)."""
    combined_scale = loss_scale
    if clip_grad > 0.:
        clip = ((total_norm / loss_scale) + 1e-6) / clip_grad
        clip = torch.clamp(clip, min=1.0)
        combined_scale = clip * loss_scale
    return 1. / combined_scale


class PipelinedHostStep:
    """The host step in pieces of the sub-groups that allow it (`host_step_in_pieces_refusal`), for one optimizer."""

    def __init__(self, optimizer, copy_back_stream, say_once):
        self.optimizer = optimizer
        self.to_device = ParamsToDevice(copy_back_stream)
        self._say_once = say_once
        self._refusals: Dict[int, Optional[str]] = {}
        self._factor = None          # this step's unscale factor (`unscale_and_clip_grads`)
        self._began = False          # a piece was copied this step

    def takes(self, sub_group_id: int) -> bool:
        """Whether this sub-group's host step runs in pieces (decided once; a refusal is said once)."""
        if sub_group_id not in self._refusals:
            why = host_step_in_pieces_refusal(self.optimizer, sub_group_id)
            self._refusals[sub_group_id] = why
            if why is not None:
                self._say_once("offload_pipeline", f"async_hzp.offload_pipeline: {why}, so the host steps each "
                               "such sub-group whole and copies it back as stock ZeRO-3 does")
        return self._refusals[sub_group_id] is None

    def begin_step(self) -> None:
        """Before Stage 3's step. A step that raised left its copies back unwaited: the current stream waits now."""
        self.end_step()

    def set_factor(self, factor) -> None:
        self._factor = factor

    def step(self, sub_group_id: int, stage3_step: Callable[[int], None]) -> None:
        """Stage 3's `_optimizer_step` of one sub-group (`stage3_step`), its C++ update piece by piece, each piece
        copied back and its chunks' refresh submitted as soon as it is stepped."""
        opt = self.optimizer
        first = stage3_sub_groups(opt)[sub_group_id][0]
        placement = opt._hzp_placement_of[first.ds_id]
        buffer = placement.trainable
        start = buffer.columns[first.ds_id].offset
        master = offload_master(opt, sub_group_id)
        edges = piece_edges(start, start + master.numel(), placement.boundary.chunk_ends(buffer),
                            min_elements=MIN_PIECE_ELEMENTS)
        self.to_device.reserve(max(hi - lo for lo, hi in zip([start, *edges], edges)), buffer.data.dtype)
        if not self._began:
            self.to_device.begin()
            self._began = True
        done = []

        def run_pieces(update) -> None:
            self._pieces(placement, start, edges, master, update)
            done.append(True)

        with cpu_adam_update_in_pieces(opt, run_pieces):
            stage3_step(sub_group_id)
        if not done:   # stock's step skipped the sub-group (no gradient): its weights still go back, unchanged
            self._pieces(placement, start, edges, master, None)

    def _pieces(self, placement, start: int, edges: List[int], master: torch.Tensor, update) -> None:
        buffer, lo = placement.trainable, start
        for hi in edges:
            if update is not None:
                self.optimizer.hzp_offload.host_wait_columns(placement, lo, hi)
                with ledger.boundary_phase("host_step"):
                    master.grad[lo - start:hi - start].mul_(self._factor)
                    update(lo - start, hi - start)
            self.to_device.copy(master.data[lo - start:hi - start], buffer, lo,
                                placement.shards.padding_in(buffer, lo, hi))
            placement.boundary.refresh_through(buffer, hi)
            lo = hi

    def end_step(self) -> None:
        """After the step's last sub-group (or a step that raised): the current stream waits for the copies back."""
        if self._began:
            self.to_device.end()
            self._began = False
        self._factor = None


__all__ = ["PipelinedHostStep", "piece_edges", "unscale_factor", "MIN_PIECE_ELEMENTS", "VECTOR_ALIGNMENT"]
