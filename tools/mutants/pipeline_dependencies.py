# The pipeline's one dependency rule (pplab/pipeline/dependencies.py) and its one registry
# (pplab/pipeline/schedules.py): each bug here must fail tests/test_pipeline_dependencies.py.
MUTANTS += [
    Mutant("pplab/pipeline/dependencies.py", "return ((\"F\", stage),) if last else ((\"F\", stage), (\"B\", stage + 1))",
           "return ((\"F\", stage),)", T("test_pipeline_dependencies"),
           "dependencies: a backward no longer waits for its output's gradient"),
    Mutant("pplab/pipeline/dependencies.py", "first, last = stage % depth == 0, (stage + 1) % depth == 0",
           "first, last = stage == 0, (stage + 1) % depth == 0", T("test_pipeline_dependencies"),
           "dependencies: the second replica's first stage waits for the first replica's last"),
    Mutant("pplab/pipeline/dependencies.py", "owner[s] == rank for _, s in waiting_for(result, a.stage, S, depth))",
           "owner[s] != src for _, s in waiting_for(result, a.stage, S, depth))", T("test_pipeline_dependencies"),
           "messages: a rank expects every message its sender sends to anyone"),
    Mutant("pplab/pipeline/schedules.py", "None if m % 2 == 0 and m >= 2 * p else",
           "None if m >= 2 * p else", T("test_pipeline_dependencies", "test_pipeline_bidirectional"),
           "registry: dualpipe takes an odd number of micro-batches"),
    Mutant("pplab/pipeline/schedules.py", "actions = p * v * (m // recipe.replicas) * per_pair",
           "actions = p * v * (m // 2) * per_pair", T("test_pipeline_dependencies", "test_pipeline_schedules"),
           "registry: every schedule's size counted as if it ran two copies"),
]
