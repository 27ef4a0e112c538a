"""What a stand-in accelerator's compute time means, for every run that pads its compute.

On this CPU a layer's real work takes whatever the shared cores give it, so a run that wants to
show how communication hides behind compute makes each piece of work last a fixed time instead,
as a kernel on a GPU would: chapter 2's `stand_in_compute` (a layer's forward and backward) and
chapter 4's `PipelineExecutor(compute_time=...)` (a stage's F, B, I, W) both take the same
`compute_time` and read it here, so that a number means the same in both:

    durations(0.004)                      # {"F": 0.004, "B": 0.008, "I": 0.004, "W": 0.004}
    durations({"F": 1, "B": 3}, v=2)      # each of v chunks takes 1/v: {"F": 0.5, "B": 1.5, ...}

A number is t_f, the forward's time; then backward takes t_b = 2 t_f (two matrix products per
forward's one) and its weight-gradient half W takes t_b / 2, as `simulate(t_f, t_b, t_w)`
assumes; I, the input-gradient half, is B - W.
"""
from __future__ import annotations


def durations(compute_time, v: int = 1, error: type[Exception] = ValueError) -> dict | None:
    """compute_time -> seconds each kind of work pads to: {"F", "B", "I", "W"}, or None for None.

    compute_time: seconds >= 0 per forward (t_f), or a dict with "F" and optionally "B" and "W".
    v: the number of chunks one rank's share is cut in (an interleaved pipeline's v): each takes 1/v.
    error: the exception raised on a bad compute_time (the pipeline raises its PipelineError).
    """
    if compute_time is None:
        return None
    number = (int, float)
    if isinstance(compute_time, bool) or not isinstance(compute_time, (*number, dict)):
        given = {"?": compute_time}                                     # neither a number nor a dict
    else:
        given = {"F": compute_time} if isinstance(compute_time, number) else dict(compute_time)
    if set(given) - {"F", "B", "W"} or "F" not in given or \
            not all(isinstance(t, number) and not isinstance(t, bool) and t >= 0 for t in given.values()):
        raise error(f"compute_time must be seconds >= 0 per forward, or a dict with 'F' and "
                    f"optionally 'B' and 'W' (like simulate's t_f, t_b, t_w), got {compute_time!r}")
    f = given["F"]
    b = given.get("B", 2 * f)
    w = given.get("W", b / 2)
    if w > b:
        raise error(f"compute_time: W is the weight-gradient part of B, so W <= B; got W={w}, B={b}")
    return {"F": f / v, "B": b / v, "I": (b - w) / v, "W": w / v}
