"""One chunk of a pipeline stage that computes for real and takes a stand-in accelerator's time.

DualPipe (DeepSeek-V3's pipeline) gives every rank two chunks: the first stage of the model for
the micro-batches that start on this rank, and the last stage for those that start on the other
end. A `Chunk` is one of them, with the two calls a schedule needs:

    a = first.forward(mb, x)         # -> the activation to send to the next stage
    loss = last.forward(mb, a_in)    # a last chunk computes its micro-batch's loss
    g = last.backward(mb)            # -> the gradient of its input, to send back
    first.backward(mb, g)            # a first chunk: nothing to send (the model's input)

Each call is a compute span in the trace ("F"/"B", the micro-batch, chunk 0 = first, 1 = last) padded to
`t_f` / `t_b` seconds (hidden.stand_in_span): on a 2-core CPU a sleeping rank leaves the cores to
the communication threads, as a rank whose GPU is busy does. `on_compute(name)` is told before
and after each call ("F1 first", "after F1 first"): the grader uses it to file the messages
posted in between.

The loss of a micro-batch is the squared error against its target summed, divided by `scale`
(the number of samples of the whole step), so the gradients summed over micro-batches are those
of the whole batch's mean loss.
"""
from __future__ import annotations

import torch
from torch import nn

from .hidden import stand_in_span


class Chunk:
    """A stage's chunk on this rank: `module`, run as the first or the last stage (`role`)."""

    def __init__(self, module: nn.Module, role: str, t_f: float = 0.0, t_b: float | None = None,
                 targets=None, scale: float = 1.0, on_compute=None):
        if role not in ("first", "last"):
            raise ValueError(f"role must be 'first' or 'last' (the chunk's place in the pipeline), got {role!r}")
        if role == "last" and targets is None:
            raise ValueError("a last chunk computes the loss: give it targets (one per micro-batch)")
        self.module, self.role, self.targets, self.scale = module, role, targets, scale
        self.t_f, self.t_b = t_f, 2 * t_f if t_b is None else t_b
        self.on_compute = on_compute or (lambda name: None)
        self._saved: dict[int, tuple] = {}        # micro-batch -> (input, output) kept for backward

    def _run(self, kind, mb, seconds, work):
        name = f"{kind}{mb} {self.role}"
        self.on_compute(name)
        with stand_in_span(kind, seconds, label=f"{kind}{mb}{'f' if self.role == 'first' else 'l'}",
                           microbatch=mb, chunk=0 if self.role == "first" else 1):
            out = work()
        self.on_compute(f"after {name}")
        return out

    def forward(self, mb: int, x: torch.Tensor) -> torch.Tensor:
        """Forward of micro-batch `mb`: the activation to send on (first) or the loss (last)."""
        if mb in self._saved:
            raise ValueError(f"micro-batch {mb} already ran forward on this {self.role} chunk")

        def work():
            inp = x.detach().requires_grad_(self.role == "last")
            out = self.module(inp)
            if self.role == "last":
                out = ((out - self.targets[mb]) ** 2).sum() / self.scale
            self._saved[mb] = (inp, out)
            return out.detach()
        return self._run("F", mb, self.t_f, work)

    def backward(self, mb: int, grad: torch.Tensor | None = None):
        """Backward of micro-batch `mb`: a last chunk starts from its loss and returns the gradient of
        its input (to send back); a first chunk takes that gradient and returns None."""
        if mb not in self._saved:
            raise ValueError(f"micro-batch {mb} has not run forward on this {self.role} chunk (or ran backward "
                             f"already): forward first, then backward, once each")
        if self.role == "first" and grad is None:
            raise ValueError(f"a first chunk's backward of micro-batch {mb} needs the gradient its output got "
                             f"(received from the next stage)")

        def work():
            inp, out = self._saved.pop(mb)
            if self.role == "last":
                out.backward()
                return inp.grad.detach()
            if grad.shape != out.shape:
                raise ValueError(f"the gradient for micro-batch {mb} is {list(grad.shape)}, its output "
                                 f"{list(out.shape)}: they must match")
            out.backward(grad)
            return None
        return self._run("B", mb, self.t_b, work)
