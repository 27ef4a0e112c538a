# Issue 39's grading floors: tools/architecture.py's rule that the sealed floor imports no checker and
# nothing of the course, and the course nothing the checks import (each caught by test_architecture).
MUTANTS += [
    Mutant("tools/architecture.py", "if theirs is not None and theirs > mine:",
           "if theirs is not None and theirs > mine + 1:", T("test_architecture", k="grading"),
           "grading floors: an import from the floor just above is let through (sealed -> checks)"),
    Mutant("tools/architecture.py", "    return max(named, key=len) if named else top(mod)",
           "    return min(named, key=len) if named else top(mod)", T("test_architecture", k="grading"),
           "grading floors: checks.sealed's modules drawn in the checks' box, so its imports go unchecked"),
]
