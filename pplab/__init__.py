"""pplab: parallelism in distributed deep learning, run for real on real processes.

    import pplab
    results = pplab.launch(fn, world_size=4)     # fn runs on 4 processes with torch.distributed ready
    pplab.swimlane.draw(results.timeline)        # what each rank computed and sent, on one clock
    pplab.check("broadcast", my_broadcast)        # check an exercise

The chapters' modules (swimlane, pipeline, collectives, ...) load on first use, so that
`import pplab` stays quick and does not pull in matplotlib until a figure is drawn.
"""
import importlib

from . import trace
from .runtime import comm
from .runtime.launcher import LaunchError, LaunchResult, device, launch

__version__ = "0.1.0"
_LAZY = ("swimlane", "pipeline", "collectives", "checks", "course", "costmodel", "costfit", "data_parallel",
         "tensor_parallel", "sequence_parallel", "zero", "mesh", "hybrid", "planner", "models", "data",
         "expert_parallel", "memory", "recompute", "mixed_precision", "grad_clip", "rng", "cluster", "flops", "hardware")
__all__ = ["launch", "LaunchError", "LaunchResult", "device", "check", "comm", "trace", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f".{name}", __name__)
    if name == "check":
        return importlib.import_module(".checks", __name__).check
    raise AttributeError(f"module 'pplab' has no attribute {name!r}")
