"""The sealed floor: how a check runs a student's code where it can reach no secret of the check.

    sealed.run_sealed(job, answer, inputs, world_size=p, timeout=t, exercise=("broadcast", "broadcast"),
                      describe=describe, check=check)                # the answer on p sealed ranks
    sealed.call_each(answer, cases, where=where, timeout=t)          # a pure function, in one sealed rank

It lies under the checkers (pplab/checks/<chapter>.py: what each exercise asks and how it is
judged) and under the course (pplab/course/: grading, formats, the command line), and imports
nothing of either: a checker uses this floor, never the reverse (tests/test_architecture.py).
`launch.py`'s docstring has the whole contract, core.py's the part a checker writes.

The plan, bottom up (each module imports only those before it here, and the library below):

* `failures`: what a check says when an answer is wrong (Fail, Forbidden, NotImplementedYet,
  Scored, and how a raise or a hang in the student's code is worded);
* `answers`: the student's answer (the function, or its source: SourceAnswer) and the plain
  data that may come back from it (`encode`, and `decode` with torch.load(weights_only=True));
* `library_view`: what `import pplab...` finds in a graded check's ranks (the library minus
  what the exercise asks for); the standard library only, as it runs from its text;
* `forbidden`: what an answer may not call (the collectives an exercise asks it to build, the
  library's own answer), looked for inside the answer, in the rank;
* `router`: the checker's side of every message between the ranks, and its record of who sent
  how many bytes to whom (the checker trusts this, never what a rank says);
* `isolate`: a rank cut off from every other process (namespaces, a read-only root, private
  /tmp): pplab/isolation.py, the one home of pplab's Linux isolation, does the work;
* `rank`: a sealed rank's life: torch.distributed and pplab.comm routed to the router, the
  forbidden collectives refused, the job run, its observations and result sent back;
* `zygotes`: the process a check's ranks are forked from, started before the seed is drawn;
* `launch`: a launch seen from the checker (`run_sealed`, `call_each`, `call_answer`): inputs
  out, requests routed, a deadlock or a hang told apart, observations checked here;
* `denied`: what each graded exercise's answer runs without (the library modules it asks for);
* `template`: an interpreter that imported torch and nothing of pplab (the standard library and
  torch only: it runs from its text), kept to fork graded checks' zygotes from;
* `fresh_zygote`: a graded check's zygote, forked from the template, serving the ranks only
  this floor (but `denied`, `template` and `fresh_zygote`, the checker's side) and the
  checkers' `*_rank` jobs, from source text.

This face only hands on names: what a checker calls, and what a sealed job calls in its rank
(`sealed.begin(i)`, `sealed.observe(i, data)`, `sealed.phase(name)`, `sealed.watch_collectives`).
"""
from .launch import call_answer, call_each, isolation, run_sealed  # noqa: F401
from .rank import begin, observe, phase, watch_collectives  # noqa: F401
from .zygotes import zygote  # noqa: F401

__all__ = ["begin", "call_answer", "call_each", "isolation", "observe", "phase", "run_sealed", "watch_collectives",
           "zygote"]
