"""The probe doc_split.py runs in its exercise's sealed rank.

Kept apart from the checker, which holds the reference: a graded check's ranks may import this
module and nothing of the checker (fresh_zygote.py), and there pplab.sequence_parallel.packed,
which holds the library's doc_split, is not available at all (denied.py)."""
from __future__ import annotations


from ..sealed.forbidden import refuse_module


def _refuse_packed(fn) -> None:
    """In the sealed rank: Forbidden if the answer calls pplab.sequence_parallel.packed's own split."""
    refuse_module(fn, "doc_split", "the document-aware split", "pplab.sequence_parallel.packed", ("doc_split",))
