"""Calibrating the cost model for ranks that share cores (this machine): `calibrate` launches
`contention` on every rank at once and turns what it measures into a slower fit and a compute
slowdown, to pass to predict/plan."""
from __future__ import annotations

import statistics

from .. import costfit
from ..runtime.launcher import launch
from ..models.gpt import GPTConfig
from .predict import Layout, predict
from .times import LayerTimes, contention


def calibrate(cfg: GPTConfig, batch: int, world_size: int, fit, times: LayerTimes, measured=None):
    """(classic fit: the fit's α + the wait per round, β and γ × the slowdown; compute slowdown) for `world_size` ranks at once
    here, each on `batch` sequences: pass them to predict/plan as fit= and oversubscription=.
    measured: every rank's `contention(cfg, batch)`, taken inside your own run (best: the same load);
    without it, a run of its own is launched. On a GPU (a process per device) neither applies."""
    got = measured or launch(contention, cfg, batch, world_size=world_size, timeout=120)
    free = costfit.Fit(0.0, 0.0, 0.0, fit.sizes, fit.times)
    alone = predict(cfg, Layout(1, 1, 1), batch, free, times).time["total"]
    wait, slowdown = statistics.median(w for _, w in got), statistics.median(p for p, _ in got) / alone
    # copying and adding bytes is CPU work too: β and γ slow down as compute does
    busy = costfit.Fit(fit.alpha + wait, fit.beta * slowdown, fit.gamma * slowdown, fit.sizes, fit.times)
    return busy, slowdown
