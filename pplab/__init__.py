"""pplab: parallelism in distributed deep learning, run for real on real processes.

    import pplab
    results = pplab.launch(fn, world_size=4)     # fn runs on 4 processes with torch.distributed ready
    pplab.swimlane.draw(results.timeline)        # what each rank computed and sent, on one clock
    pplab.check("broadcast", my_broadcast)        # grade an exercise
"""
from . import comm, trace
from .launcher import LaunchError, LaunchResult, device, launch

__version__ = "0.1.0"
__all__ = ["launch", "LaunchError", "LaunchResult", "device", "comm", "trace"]
