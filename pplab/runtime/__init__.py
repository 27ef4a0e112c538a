"""How ranks run: started, talking, watched.

launcher.py   pplab.launch(fn, world_size=4): N real processes from a notebook cell, under one
              host that ends everything they start; their results by rank.
rank_main.py  what each rank runs: join the group, run fn, answer once.
watch.py      the caller's side: relay output, notice a failure, a hang or a death, explain it.
callboard.py  a shared board of the call each rank is inside: mismatched collectives caught in a second.
comm.py       torch.distributed's calls, each leaving a record in pplab.trace (pplab.comm).
"""
from .launcher import LaunchError, LaunchResult, device, launch

__all__ = ["launch", "LaunchError", "LaunchResult", "device"]
