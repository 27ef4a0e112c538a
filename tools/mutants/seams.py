# Issue 39's seams: the one counter of model state, what compute_time means, and the architecture
# rules (each must be caught by the test that holds it).
MUTANTS += [
    Mutant("pplab/memory.py", "return StateBytes(storage_bytes(parameters, seen), storage_bytes(gradients, seen),",
           "return StateBytes(storage_bytes(parameters, seen), storage_bytes(parameters, set()),",
           T("test_zero", k="held_bytes_and_memory"), "count_state: the parameters counted as the gradients"),
    Mutant("pplab/zero/accounting.py", "if torch.is_tensor(t) and t.dim() > 0]",
           "if torch.is_tensor(t)]", T("test_zero", k="held_bytes_and_memory"),
           "held_bytes: Adam's step counters counted, which the table leaves out"),
    Mutant("pplab/stand_in.py", 'w = given.get("W", b / 2)', 'w = given.get("W", f / 2)', T("test_stand_in"),
           "stand_in.durations: W half the forward instead of half the backward"),
    Mutant("tools/architecture.py", "if CHAPTER_ORDER.index(there) > CHAPTER_ORDER.index(here)",
           "if CHAPTER_ORDER.index(there) > CHAPTER_ORDER.index(here) + 1", T("test_architecture"),
           "architecture: an import one chapter later is let through"),
    Mutant("tools/architecture.py", "                if top(there) != top(mod):",
           "                if there != mod and top(there) != top(mod) and False:", T("test_architecture"),
           "architecture: `from x import _y` across boxes not reported"),
]
