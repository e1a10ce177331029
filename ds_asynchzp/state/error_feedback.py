"""Error feedback of the quantized cross-node gradient exchange: per rank, what the quantization dropped.

When the boundary exchange sends gradient rows block-quantized, each rank keeps, for every row it sends, the
difference between the row (plus the previous residual) and what the receiver dequantizes; the next step adds
it to the same row before quantizing. Over steps nothing is lost, only delayed by a step (EF-SGD; ZeRO++ calls
its variant LoCo). The residual has the gradient shard's shape, in fp32: `4 * Psi_t / d_g` bytes per rank.

It is per-rank state: checkpoints save it per rank and restore it when the layout is the same; at another
layout it cannot be mapped (another rank owns other rows) and starts from zero again.
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    def __init__(self, rows: int, width: int, device):
        self.residual = torch.zeros(rows, width, dtype=torch.float32, device=device)

    def columns(self, start: int, end: int) -> torch.Tensor:
        """[rows, end - start] view: the residual of one column chunk of the gradient shard."""
        return self.residual[:, start:end]

    def state_dict(self) -> dict:
        return {"residual": self.residual}

    def load_state_dict(self, state: dict) -> None:
        residual = state["residual"]
        if residual.shape != self.residual.shape:
            raise ValueError(f"error-feedback residual of shape {tuple(residual.shape)} does not fit this layout's "
                             f"{tuple(self.residual.shape)}")
        self.residual.copy_(residual)

    def reset(self) -> None:
        self.residual.zero_()

    def nbytes(self) -> int:
        return self.residual.numel() * self.residual.element_size()
