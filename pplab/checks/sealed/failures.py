"""What a check says when an answer is wrong: the exceptions a checker raises, and the
wording of the ways a run of the student's code can go wrong (a raise, a hang).

The lowest module of pplab.checks: every other one may import it; it imports none of them.
"""
from __future__ import annotations

import re


class Fail(Exception):
    """Raised by a checker (or inside a rank) with the message the student will read.

    seed_matters=False for failures that no other input would change (nothing written
    yet, a forbidden call): their message does not offer the seed.
    earned: for an exercise worth several points (a capstone checked in parts), the points
    the parts that were right earn; None: nothing.
    """

    def __init__(self, message: str, seed_matters: bool = True, earned: float | None = None):
        super().__init__(message)
        self.seed_matters, self.earned = seed_matters, earned


class Scored(str):
    """What a checker returns for an answer graded on how good it is (a schedule's bubble, a
    layout's throughput): its summary, and the points it earned (of the exercise's `points`).

        return Scored(f"bubble 0.21 against a target of 0.25", earned=2)
    """

    def __new__(cls, summary: str, earned: float):
        text = super().__new__(cls, summary)
        text.earned = float(earned)
        return text


class NotImplementedYet(Fail):
    """The answer is still the exercise's stub (it raised NotImplementedError): the grader
    marks it missing, not 0, and reads that from this class, never from the message."""

    def __init__(self, name: str):
        super().__init__(_not_implemented(name), seed_matters=False)


class Forbidden(Fail):
    """The answer called (or names) a library function the exercise asks to replace."""

    def __init__(self, message: str):
        super().__init__(message, seed_matters=False)


def _student_frame(traceback_text: str, filenames) -> str:
    """' (in f, line 9: `comm.send(x, 3)`)' for the deepest frame in the student's files."""
    filenames = {filenames} if isinstance(filenames, str) else set(filenames)
    frames = re.findall(r'File "(.*?)", line (\d+), in (\S+)\n(?: {4}(.*)\n)?', traceback_text + "\n")
    mine = [f for f in frames if f[0] in filenames]
    if not mine:
        return ""
    _, line, func, code = mine[-1]
    return f" (in {func}, line {line}" + (f": `{code.strip()}`)" if code else ")")


def _not_implemented(name: str) -> str:
    return (f"{name} is not implemented yet (it raises NotImplementedError): write your "
            f"solution in its cell, run that cell, then run the check again.")


def _hang_message(running, timeout, cpu, name: str, label=None) -> str:
    """Why ranks were still running at the timeout, as far as their CPU use tells
    (cpu.busy(rank): the share of samples it was running, None if unknown)."""
    shares = {r: cpu.busy(r) for r in running}
    looping = [r for r, s in shares.items() if s is not None and s >= 0.7]
    idle = [r for r, s in shares.items() if s is not None and s <= 0.2]

    def who(rs):                                         # ("rank 0" / "ranks 0, 1", "was" / "were")
        if label is not None:
            return label, "was"
        return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}", "were" if len(rs) > 1 else "was"
    if looping:
        (text, verb), waiting = who(looping), [r for r in running if r not in looping]
        also = " ({} {} waiting).".format(*who(waiting)) if waiting else "."
        return (f"{text} {verb} still running after {timeout:g} s, busy on the CPU all along: a loop that never "
                f"ends? Check what ends each loop in {name}{also}")
    text, verb = who(running)
    if len(idle) == len(running):
        if label is not None:
            return (f"{text} was still waiting after {timeout:g} s, using no CPU: what is it waiting for (a "
                    f"sleep, an input, a lock)?")
        return (f"{text} {verb} still waiting after {timeout:g} s: a deadlock? Every recv needs a matching send "
                f"from the rank it names, and a rank that waits to receive before it sends waits forever if its "
                f"sender is waiting too.")
    if label is not None:
        return f"{text} was still running after {timeout:g} s: a loop that never ends, or very slow work?"
    return f"{text} {verb} still running after {timeout:g} s: a deadlock (ranks waiting on each other) or a loop " \
           f"that never ends."
