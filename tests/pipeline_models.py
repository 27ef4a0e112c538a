"""The small MLP the pipeline tests cut into stages, its data, and one process training it whole:
the reference that every pipeline test on real ranks compares with."""
import torch
from torch import nn

F64 = torch.float64


def mlp(seed=0, width=16, depth=8):
    torch.manual_seed(seed)
    return [m for _ in range(depth) for m in (nn.Linear(width, width, dtype=F64), nn.Tanh())]


def data(n, width=16):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, width, dtype=F64, generator=g), torch.randn(n, width, dtype=F64, generator=g)


def reference(n, lr, width=16, depth=8):
    """Single-process training of the unsplit model on the whole batch: the loss, the gradients,
    and the parameters after one SGD step."""
    model = nn.Sequential(*mlp(width=width, depth=depth))
    x, y = data(n, width)
    loss = nn.MSELoss()(model(x), y)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=lr).step()
    return loss.item(), grads, {k: p.detach().clone() for k, p in model.named_parameters()}
