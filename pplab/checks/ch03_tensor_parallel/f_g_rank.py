"""What exercise f_g's checker (f_g.py) runs in its sealed ranks."""
from __future__ import annotations

from .. import sealed
from .tp_groups_rank import _groups


def _fg_rank(fn, trials):
    """In every sealed rank: f then g, forward and backward, each phase named for the router's record."""
    t = trials[0]
    sealed.begin(0)
    group, ranks = _groups(t["members"])
    pair = fn()
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(callable(h) for h in pair)):
        got = f"a tuple of {len(pair)}" if isinstance(pair, (tuple, list)) else type(pair).__name__
        sealed.observe(0, {"error": f"f_and_g() must return (f, g), two functions called as f(x, group); got {got}"})
        return
    f, g = pair
    x, w, xg = t["x"].requires_grad_(), t["w"], t["xg"].requires_grad_()   # x: the same on every rank
    sealed.phase("f forward")
    y = f(x, group)
    sealed.phase("f backward")
    (y * w).sum().backward()
    sealed.phase("g forward")
    z = g(xg, group)
    sealed.phase("g backward")
    (z * w).sum().backward()
    sealed.phase("")
    sealed.observe(0, {"ranks": ranks, "x": x.detach(), "y": y.detach(), "x_grad": x.grad, "z": z.detach(),
                       "xg_grad": xg.grad, "numel": x.numel()})
