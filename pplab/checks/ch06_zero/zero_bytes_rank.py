"""What exercise zero_bytes's checker (zero_bytes.py) runs in its sealed ranks."""
from __future__ import annotations

import torch

from .. import sealed


STATE_PARTS = ("params", "grads", "optimizer")


def _state_rank(fn, trials):
    """In every sealed rank: the answer on this rank's copy of the model; the bytes of what it returned,
    each storage counted once (pplab.memory.storage_bytes), and the values, for the checker."""
    from ...memory import storage_bytes
    for i, t in enumerate(trials):
        sealed.begin(i)
        got = fn(t["params"], t["grads"], t["stage"])
        seen, record = set(), {}
        for kind in STATE_PARTS:
            tensors = got.get(kind) if isinstance(got, dict) else None
            if not isinstance(tensors, (list, tuple)) or not all(isinstance(x, torch.Tensor) for x in tensors):
                record[kind] = f"{type(got).__name__}" if not isinstance(got, dict) else \
                    f"{kind}: {type(tensors).__name__}"
                continue
            record[kind] = {"bytes": storage_bytes(tensors, seen), "dtypes": [str(x.dtype) for x in tensors],
                            "values": torch.cat([x.detach().flatten().double() for x in tensors])
                            if tensors else torch.zeros(0, dtype=torch.float64),
                            "views": [x.untyped_storage().nbytes() > x.numel() * x.element_size() for x in tensors]}
        sealed.observe(i, record)
