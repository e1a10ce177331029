"""The gradient accumulation shard: every rank's d_o / d_g atoms of every trainable parameter's gradient.

Per micro-step, each bucket's reduce-scatter result (this rank's atoms, summed over its grad shard group) is
added here by the reduce thread, in the gradient-accumulation dtype (DeepSpeed's `data_types.grad_accum_dtype`, by default the
model dtype, as in stock ZeRO-3). At the accumulation boundary the rows are summed into their owners' own
atoms across nodes; the own row is Stage 3's gradient partition buffer, so the optimizer step, the norm,
`safe_get_full_grad` and the overflow check read it in place.

The accumulation window has an explicit state. A gradient that arrives after the window's cross-node sum (a
second `backward()` before `step()`, as stock ZeRO-3 allows whatever `gradient_accumulation_steps` says) reopens
it: the sum so far moves aside (`reduced_earlier`), every row starts from zero, and the next cross-node sum adds
it back to the own row, so the window is summed across nodes once more, its later gradients only.

The own row outlives the window, as Stage 3's gradient partition buffer does (it is that buffer): stock ZeRO-3
copies each reduced gradient into its partition in a window's first backward and adds in the later ones, and
never zeroes the buffer. So a parameter that gets no gradient in a window's first backward starts that window
from the gradient it had at the last step, and one that gets none in the whole window steps with it again. The
other rows hold only this window's partial sums and are zeroed after every step. With several optimizer replicas
(d_o < N) the cross-node sum all-reduces the own atoms over the replicas, so only the first replica carries the
kept value into a window (`carries_previous`); the others start it from zero.
"""

from __future__ import annotations

import enum
from typing import Sequence

import torch

from ..layout import HierarchicalLayout
from .sharded_buffer import ShardedBuffer


class Window(enum.Enum):
    EMPTY = "empty"                # nothing accumulated since the last step: other rows zero, own row as stepped
    ACCUMULATING = "accumulating"  # rows hold partial sums of this window's micro-steps
    REDUCED = "reduced"            # the own row holds the window's gradient so far; the other rows are spent


class GradShards:
    def __init__(self, layout: HierarchicalLayout, dp_rank: int, params_in_flat_order: Sequence[torch.nn.Parameter],
                 dtype: torch.dtype, device, carries_previous: bool = True):
        self.layout = layout
        self.carries_previous = carries_previous
        self.buffer = ShardedBuffer("grads", params_in_flat_order, layout.grad_rows,
                                    layout.grad_row_of_own_atom(dp_rank), dtype, device,
                                    atom_of=lambda p: p.partition_numel())
        self.window = Window.EMPTY
        # The own row as the window's first cross-node sum left it, while the window is reopened (else None).
        self.reduced_earlier: torch.Tensor | None = None

    @property
    def own(self) -> torch.Tensor:
        return self.buffer.own

    def begin_accumulate(self, params) -> None:
        """Some parameters' reduced gradients are about to be added (by the reduce thread)."""
        if self.window is Window.REDUCED:
            raise RuntimeError(
                f"a gradient of parameter {params[0].ds_id} arrived after this accumulation window's cross-node sum "
                "and the window was not reopened (GradShards.reopen)")
        if self.window is Window.EMPTY and not self.carries_previous:
            self.buffer.own.zero_()
            self.buffer.note_host_access()
        self.window = Window.ACCUMULATING

    def reopen(self) -> None:
        """A gradient arrives after the window's cross-node sum (every job of that sum is done): keep the sum
        aside, start every row from zero. With optimizer replicas each holds the same sum, so each adds it back."""
        if self.window is not Window.REDUCED:
            raise RuntimeError(f"only a reduced window can be reopened (this one is {self.window.value})")
        # Reopened before: the earlier sum was added back into the own row by the last cross-node sum.
        self.reduced_earlier = self.buffer.own.clone()
        self.buffer.data.zero_()
        self.buffer.note_host_access()
        self.window = Window.ACCUMULATING

    def replace_earlier(self, params) -> None:
        """A first backward (Stage 3 copies into its partitions then) reaches these parameters in a reopened window:
        their gradient so far is replaced, not added to."""
        if self.reduced_earlier is None:
            return
        for param in params:
            c = self.buffer.columns[param.ds_id]
            self.reduced_earlier.narrow(0, c.offset, c.atom).zero_()
        self.buffer.note_host_access()

    def end_step(self) -> None:
        """After the optimizer step: the partial sums go, the own row stays (Stage 3's partition buffer)."""
        own = self.buffer.own_row
        if own:
            self.buffer.data[:own].zero_()
        if own + 1 < self.buffer.rows:
            self.buffer.data[own + 1:].zero_()
        self.buffer.note_host_access()
        self.reduced_earlier = None
        self.window = Window.EMPTY

    def nbytes(self) -> int:
        return self.buffer.nbytes()
