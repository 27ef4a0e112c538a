"""What the ranks of the FSDP capstone (fsdp.py) should give, worked out in the checker's
process: single-process AdamW on the whole batch in fp32, and one step from the masters the
ranks hold, cast as compute_dtype asks, with the difference allowed at each element."""
from __future__ import annotations

import torch

from ...models import gpt_layers, gpt_loss
from .fsdp_rank import flat_padded


TOL = {torch.float32: 1e-6, torch.float16: 2**-9, torch.bfloat16: 2**-6}     # gradients: fsdp.py's docstring


LOSS_TOL = {torch.float32: 1e-6, torch.float16: 1e-5, torch.bfloat16: 1e-5}


NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _ranks_step(layers, t, p, dtype):
    """What each rank's forward and backward give with `layers` (in dtype): its loss and, per unit,
    its gradient as a padded flat vector in dtype."""
    losses, grads = [], []
    for r in range(p):
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        x = t["ids"][r]
        for layer in layers:
            x = layer(x)
        loss = gpt_loss(x.float(), t["targets"][r])
        loss.backward()
        losses.append(loss.item())
        grads.append([flat_padded([q.grad for q in layer.parameters()], p, dtype) for layer in layers])
    return losses, grads


def _expected(losses, grads, p, dtype):
    """One step as FSDP gives it: each rank's loss and own gradient; per unit the mean gradient
    (summed in dtype, then fp32 / p) and the difference allowed at each element (`slack`)."""
    units = range(len(grads[0]))
    mean = [torch.stack([g[k] for g in grads]).sum(0).float() / p for k in units]
    terms = [torch.stack([g[k].float().abs() for g in grads]).sum(0) / p for k in units]
    info = torch.finfo(dtype)                      # + two of the dtype's smallest steps (fp16's subnormals)
    slack = [TOL[dtype] * (a + (m.abs().max() if dtype == torch.float32 else 0)) + 2 * info.tiny * info.eps
             for a, m in zip(terms, mean)]
    return {"losses": losses, "grads": mean, "slack": slack, "local": [[x.float() for x in g] for g in grads]}


def single_threaded(compute):
    """compute() on one thread, as in the ranks: the same roundings."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return compute()
    finally:
        torch.set_num_threads(threads)


def reference(t, p, steps):
    """fp32: single-process AdamW on the whole batch, every step, per unit as padded flat vectors."""
    layers = gpt_layers(t["cfg"], seed=t["model_seed"], dtype=torch.float32)
    params = [list(layer.parameters()) for layer in layers]
    optimizer = torch.optim.AdamW([q for ps in params for q in ps], **t["adamw"])
    ref = {"start": [flat_padded(ps, p) for ps in params], "steps": [],
           "names": [[(n, q.shape) for n, q in layer.named_parameters()] for layer in layers],
           "kinds": [type(layer).__name__ for layer in layers]}
    for _ in range(steps):
        step = _expected(*_ranks_step(layers, t, p, torch.float32), p, torch.float32)
        for ps, g in zip(params, step["grads"]):
            for q, piece in zip(ps, _pieces(ps, g)):
                q.grad = piece.clone()
        optimizer.step()
        after = [flat_padded(ps, p) for ps in params]
        ref["steps"].append({"after": after, "slack": [TOL[torch.float32] * (a.abs() + a.abs().max()) for a in after]})
    return ref


def one_step(t, p, dtype, masters):
    """One step's losses and gradients from the fp32 masters the ranks hold, cast to dtype as
    fsdp.py's docstring says (so a drift within tolerance does not pile up over the steps)."""
    layers = gpt_layers(t["cfg"], seed=t["model_seed"], dtype=torch.float32)
    with torch.no_grad():
        for layer, flat in zip(layers, masters):
            for q, piece in zip(layer.parameters(), _pieces(list(layer.parameters()), flat)):
                q.copy_(piece)
    return _expected(*_ranks_step([layer.to(dtype) for layer in layers], t, p, dtype), p, dtype)


def _pieces(params, flat):
    """Each parameter's piece of a unit's flat vector, shaped like it."""
    ends = torch.tensor([q.numel() for q in params]).cumsum(0).tolist()
    return [flat[end - q.numel():end].view_as(q) for q, end in zip(params, ends)]
