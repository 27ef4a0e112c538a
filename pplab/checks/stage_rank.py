"""The pipeline stage the executor's and the hybrid trainer's answers get, in the sealed ranks.

Kept apart from core.py (which the ranks of a graded check may not import: fresh_zygote.py)."""
from __future__ import annotations

import torch
from torch import nn


class WatchedStage(nn.Sequential):
    """The pipeline stage an answer gets (the executor's and the hybrid trainer's checkers): an
    nn.Sequential that also tells the checker, at its k-th forward with gradients on (k = 0, 1, ...),
    on_forward(k, input), and when a gradient reaches that forward's output (its backward),
    on_backward(k, gradient)."""

    def __init__(self, layers, on_forward, on_backward):
        super().__init__(*layers)
        self._on_forward, self._on_backward, self._forwards = on_forward, on_backward, 0

    def forward(self, x):
        out = super().forward(x)
        if torch.is_grad_enabled():
            k, self._forwards = self._forwards, self._forwards + 1
            self._on_forward(k, x)
            if out.requires_grad:
                out.register_hook(lambda grad, k=k: self._on_backward(k, grad))
        return out
