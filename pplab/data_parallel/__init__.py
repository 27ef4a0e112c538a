"""Data parallelism (chapter 2): every rank holds the whole model and a slice of the batch; the
gradients are averaged over the ranks before each step.

ddp.py               DDP: reverse-order gradient buckets whose all-reduce overlaps backward,
                     no_sync(), buffers broadcast from rank 0; shard (a rank's slice of a batch),
                     all_reduce_gradients (the same buckets, once, after backward).
parameter_server.py  the older design: workers push gradients to a server (synchronous, or
                     asynchronous with stale gradients).
overlap.py           how much of DDP's all-reduce hid under backward, read from the trace.
compression.py       top-k, signSGD and PowerSGD, with or without error feedback.
noise_scale.py       the gradient noise scale B_simple = tr(Σ)/|G|²: up to which batch more ranks save steps.

`pplab.data_parallel.DDP` and the other names of ddp.py are here too.
"""
from .ddp import DDP, all_reduce_gradients, end_trace_when_done, reverse_buckets, shard

__all__ = ["DDP", "all_reduce_gradients", "end_trace_when_done", "reverse_buckets", "shard"]
