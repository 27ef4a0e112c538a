"""What exercise predict_time's checker (predict_time.py) runs in its sealed ranks."""
from __future__ import annotations

from ..sealed.forbidden import refuse_library


def _refuse_costmodel(fn) -> None:
    """In the sealed rank: Forbidden if the answer asks pplab.costmodel or pplab.costfit."""
    from ... import costfit, costmodel
    refuse_library(fn, "predict_time", "the fit and the time",
                   {"costmodel": costmodel, "predict": costmodel.predict, "cost": costmodel.cost,
                    "fit_timings": costfit.fit_timings, "fit_line": costfit.fit_line},
                   "pplab.costmodel or pplab.costfit")
