"""The gradient accumulation shard: every rank's d_o / d_g atoms of every trainable parameter's gradient.

Per micro-step, each bucket's reduce-scatter result (this rank's atoms, summed over its grad shard group) is
added here by the reduce thread, in the gradient-accumulation dtype (DeepSpeed's `data_types.grad_accum_dtype`, by default the
model dtype, as in stock ZeRO-3). At the accumulation boundary the rows are summed into their owners' own
atoms across nodes; the own row is Stage 3's gradient partition buffer, so the optimizer step, the norm,
`safe_get_full_grad` and the overflow check read it in place.

The accumulation window has an explicit state, so that a discarded backward (`zero_grad`) never leaks into the
next step and a gradient can never be added after its window was reduced.
"""

from __future__ import annotations

import enum
from typing import Sequence

import torch

from ..layout import HierarchicalLayout
from .sharded_buffer import ShardedBuffer


class Window(enum.Enum):
    EMPTY = "empty"                # all rows zero: nothing accumulated since the last step
    ACCUMULATING = "accumulating"  # rows hold partial sums of this window's micro-steps
    REDUCED = "reduced"            # the own row holds the final gradient; the other rows are spent


class GradShards:
    def __init__(self, layout: HierarchicalLayout, dp_rank: int, params_in_flat_order: Sequence[torch.nn.Parameter],
                 dtype: torch.dtype, device):
        self.layout = layout
        self.buffer = ShardedBuffer("grads", params_in_flat_order, layout.grad_rows,
                                    layout.grad_row_of_own_atom(dp_rank), dtype, device,
                                    atom_of=lambda p: p.partition_numel())
        self.window = Window.EMPTY

    @property
    def own(self) -> torch.Tensor:
        return self.buffer.own

    def begin_accumulate(self, params) -> None:
        """Some parameters' reduced gradients are about to be added (by the reduce thread)."""
        if self.window is Window.REDUCED:
            raise RuntimeError(
                f"a gradient of parameter {params[0].ds_id} arrived after this accumulation window's gradients "
                "were reduced across nodes and before optimizer step(); run step() (or zero_grad() to discard the "
                "window) before the next backward")
        self.window = Window.ACCUMULATING

    def clear(self) -> None:
        self.buffer.data.zero_()
        self.window = Window.EMPTY

    def nbytes(self) -> int:
        return self.buffer.nbytes()
