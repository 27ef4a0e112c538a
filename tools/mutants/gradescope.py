# Gradescope's autograder as root without namespaces (pplab/course/gradescope.py): the drop to
# nobody. Killed by test_gradescope_as_root_drops_to_nobody when the tests run as root (it skips,
# saying why, elsewhere; then these survive).
GS_NOBODY = T("test_grading_formats", k="midway or drops_to_nobody")

MUTANTS += [
    Mutant("pplab/course/gradescope.py", "    loopback_up()", "    pass",
           GS_NOBODY, "gradescope: the grader's own network namespace keeps lo down (the kernel cannot start)"),
    Mutant("pplab/course/gradescope.py", 'f.write("1000")', 'f.write("0")',
           GS_NOBODY, "gradescope: the grading child is not the OOM killer's first pick"),
]
