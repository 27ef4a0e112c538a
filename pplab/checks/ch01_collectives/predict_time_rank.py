"""What runs in the sealed ranks of chapter 1's collective exercises (collectives.py judges).

Kept apart from the checker, which holds the references: a graded check's ranks may import
this module and nothing of the checker (fresh_zygote.py)."""
from __future__ import annotations

from ..sealed.forbidden import refuse_library


def _refuse_costmodel(fn) -> None:
    """In the sealed rank: Forbidden if the answer asks pplab.costmodel or pplab.costfit."""
    from ... import costfit, costmodel
    refuse_library(fn, "predict_time", "the fit and the time",
                   {"costmodel": costmodel, "predict": costmodel.predict, "cost": costmodel.cost,
                    "fit_timings": costfit.fit_timings, "fit_line": costfit.fit_line},
                   "pplab.costmodel or pplab.costfit")
