"""Sealed launches (pplab/checks/sealed/): attacks on the check from inside the student's
answer get no pass, as a function object (pplab.check in a notebook) and as source (the
grader's form); the router's record is exact; a deadlock is named at once."""
import gc
import inspect
import os
import re
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from pplab import checks, comm
from pplab.course import submission
from pplab.checks import sealed
from notebook_answers import solution

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

IMPORTS = "import gc\nimport os\nimport sys\nimport time\n\nimport torch\nimport torch.distributed as dist\n" \
          "from pplab import comm"


def as_source(fn):
    """The answer as the grader takes it from a notebook: source text, run only in the ranks."""
    cells = [(1, IMPORTS), (2, inspect.getsource(_token)), (3, inspect.getsource(_plain_broadcast)),
             (4, textwrap.dedent(inspect.getsource(fn)))]
    found = submission.definitions(cells, {fn.__name__})
    return found.answers[fn.__name__]


def both_forms(fn):
    return [pytest.param(fn, id=f"{fn.__name__}-function"), pytest.param(as_source(fn), id=f"{fn.__name__}-source")]


def _plain_broadcast(tensor, src):
    """A right broadcast: src sends its tensor to every other rank."""
    rank, p = comm.rank(), comm.world_size()
    if rank == src:
        for r in range(p):
            if r != src:
                comm.send(tensor, r)
    else:
        comm.recv(tensor, src)


def _token(tensor, src):
    """A one-element message from src to every other rank: "received something" holds."""
    if comm.rank() == src:
        for r in range(comm.world_size()):
            if r != src:
                comm.send(tensor.view(-1)[:1].clone(), r)
    else:
        comm.recv(torch.empty(1, dtype=tensor.dtype), src)


# -- the attacks, each written as a student's answer -----------------------------------

def steals_from_frames(tensor, src):
    """Look for the seed, the trials and another rank's input in the stack and the heap,
    write src's tensor without sending it; then a token message."""
    import pplab.checks.ch00_start_here.broadcast as c
    rank, p, found = comm.rank(), comm.world_size(), None
    frame = sys._getframe()
    while frame is not None and found is None:
        seen = frame.f_locals
        if isinstance(seen.get("seed"), int) and "trials" in seen and isinstance(seen.get("i"), int):
            trial = seen["trials"][seen["i"]]
            found = c._broadcast_inputs(seen["seed"], p, seen["i"], trial)[src]
        frame = frame.f_back
    for obj in gc.get_objects():
        if found is None and isinstance(obj, dict) and obj.get("src") == src and \
                isinstance(obj.get("tensor"), torch.Tensor) and obj["tensor"] is not tensor and \
                obj["tensor"].shape == tensor.shape and not torch.equal(obj["tensor"], tensor):
            found = obj["tensor"]               # a tensor of another rank, if this rank held one
    if found is not None and rank != src:
        tensor.copy_(found)
    _token(tensor, src)


def erases_the_record(tensor, src):
    """Calls the forbidden collective, catches the error, erases every record of it it can
    find (a CommWatch's list, watch_comm's saved originals), then does it right."""
    try:
        dist.all_reduce(tensor.clone())
    except Exception:
        pass
    for obj in gc.get_objects():
        if type(obj).__name__ == "CommWatch":
            obj.forbidden.clear()
        if type(obj).__name__ == "Record" and hasattr(obj, "forbidden"):
            obj.forbidden.clear()
    _plain_broadcast(tensor, src)


def uses_the_backend(tensor, src):
    """All-reduce through the process group's backend object (zeros everywhere but src),
    plus a token message."""
    if comm.rank() != src:
        tensor.zero_()
    group = dist.distributed_c10d._get_default_group()
    group.allreduce([tensor]).wait()
    _token(tensor, src)


def uses_functional_collectives(tensor, src):
    """The same through torch.distributed._functional_collectives."""
    from torch.distributed import _functional_collectives as funcol
    if comm.rank() != src:
        tensor.zero_()
    tensor.copy_(funcol.all_reduce(tensor, "sum", list(range(comm.world_size()))))
    _token(tensor, src)


def uses_the_checker(tensor, src):
    """Import the checker, try to recompute the inputs (no seed to find: try the small ones)
    and to run the check itself from inside; then a token message."""
    import pplab.checks
    import pplab.checks.ch00_start_here.broadcast as c
    rank, p = comm.rank(), comm.world_size()
    for seed in range(200):
        for i, trial in enumerate(c._broadcast_trials(seed, p)):
            inputs = c._broadcast_inputs(seed, p, i, trial)
            if torch.equal(inputs[rank], tensor) and trial.src == src:
                tensor.copy_(inputs[src])
    try:
        pplab.checks.run_check("broadcast", lambda t, s: None)
    except Exception:
        pass
    _token(tensor, src)


def uses_the_library_through_a_helper(tensor, src):
    """pplab.collectives.broadcast (the library's answer), called by a helper."""
    import pplab.collectives

    def helper(t, s):
        return getattr(pplab.collectives, "broad" + "cast")(t, s)
    helper(tensor, src)


def shares_a_file(tensor, src):
    """src writes its tensor to /tmp and /dev/shm, the others read it there; a token message."""
    rank, kind = comm.rank(), f"{tensor.dtype}-{tensor.numel()}"
    names = [f"/tmp/pplab-attack-{kind}.pt", f"/dev/shm/pplab-attack-{kind}.pt"]
    if rank == src:
        for name in names:
            torch.save(tensor, name + ".part")
            os.replace(name + ".part", name)
    _token(tensor, src)                     # after it: src has written the files
    if rank != src:
        for name in names:
            if os.path.exists(name):
                tensor.copy_(torch.load(name))


def writes_to_every_descriptor(tensor, src):
    """Writes a forged reply to every file descriptor it has (its channel among them), and
    tries to signal the process above it."""
    for fd in range(3, 1024):
        try:
            os.write(fd, b"\x00\x00\x00\x0b{\"ok\": true}")
        except OSError:
            pass
    try:
        os.kill(os.getppid(), 9)
    except OSError:
        pass


ATTACKS = [
    (steals_from_frames, (r"rank \d's result differs from the reference \(rank \d's tensor, the src\)",
                          r"pplab\.checks\.ch00_start_here\.broadcast is not available while your answer is checked: it is the checker's own module")),
    (erases_the_record, r"^exercise 'broadcast' asks you to build broadcast .*you called "
                        r"torch\.distributed\.all_reduce, a library collective\.$"),
    (uses_the_backend, r"rank \d raised RuntimeError: a check's ranks have no process group.* \(in uses_the_backend, "
                       r"line \d+: `group = dist\.distributed_c10d\._get_default_group\(\)`\)"),
    (uses_functional_collectives, r"you called torch\.distributed\._functional_collectives\.all_reduce, a library "
                                  r"collective\.$"),
    (uses_the_checker, (r"rank \d's result differs from the reference", r"pplab\.checks\.ch00_start_here\.broadcast is not available while your answer is checked: it is the checker's own module")),
    (writes_to_every_descriptor, r"rank \d (broke its channel to the checker \(a message that is not valid|died)"),
    (uses_the_library_through_a_helper, (r"you called pplab\.collectives\.broadcast, the library collective it "
                                         r"replaces\.$", r"the library's pplab\.collectives is not available while "
                                                          r"your answer is checked")),
]


# (as a function, as source): graded, the checker's modules and pplab.collectives are not there at all
@pytest.mark.parametrize("answer, pattern", [pytest.param(form.values[0], pattern if isinstance(pattern, str) else
                                                          pattern[form.id.endswith("-source")], id=form.id)
                                             for fn, pattern in ATTACKS
                                             for form in both_forms(fn)])
def test_an_attack_from_inside_the_answer_gets_no_pass(answer, pattern):
    result = checks.run_check("broadcast", answer)
    assert not result
    assert re.search(pattern, result.message), result.message


@pytest.mark.parametrize("answer", both_forms(shares_a_file))
def test_ranks_share_no_file(answer):
    result = checks.run_check("broadcast", answer)
    if sealed.isolation():
        pytest.skip(f"this system does not isolate the ranks ({sealed.isolation()})")
    assert not result
    assert re.search(r"rank \d's result differs from the reference \(rank \d's tensor, the src\)", result.message)


# -- the router's record and its deadlock detection ------------------------------------

RECORDED = []


@pytest.fixture
def ring_bytes_exercise():
    """A check that runs the ring all-reduce once on 3 ranks, 13 float32 elements, and keeps
    the router's record."""
    from pplab.checks.ch01_collectives import ring_all_reduce_rank

    @checks.exercise("test_ring_bytes", "the router's record", answer="f", sealed=True)
    def check_ring_bytes(fn, seed, timeout):
        def keep(p, i, observed, traffic):
            RECORDED.append(({r: traffic[r] for r in range(p)}, observed))
        inputs = [[torch.arange(13, dtype=torch.float32) * (r + 1) for r in range(3)]]
        sealed.run_sealed(ring_all_reduce_rank._all_reduce_rank, fn, inputs, world_size=3, timeout=timeout,
                          exercise=("test_ring_bytes", "all_reduce"), check=keep)
        return "(recorded)"
    RECORDED.clear()
    yield
    del checks.EXERCISES["test_ring_bytes"]


@pytest.mark.usefixtures("ring_bytes_exercise")
def test_the_router_records_every_byte_of_a_ring():
    """13 elements in 3 chunks of 5, 4, 4 (tensor.tensor_split(3)): 20, 16, 16 bytes. Step s
    of the reduce-scatter sends chunk (r-s-1) % 3, step s of the all-gather chunk (r-s) % 3."""
    result = checks.run_check("test_ring_bytes", solution("ring_all_reduce"))
    assert result, result.message
    (traffic, observed), = RECORDED
    assert traffic[0]["sends"] == [(1, 16), (1, 16), (1, 20), (1, 16)]      # chunks 2, 1 | 0, 2
    assert traffic[1]["sends"] == [(2, 20), (2, 16), (2, 16), (2, 20)]      # chunks 0, 2 | 1, 0
    assert traffic[2]["sends"] == [(0, 16), (0, 20), (0, 16), (0, 16)]      # chunks 1, 0 | 2, 1
    for r in range(3):
        assert traffic[r]["received"] == [((r - 1) % 3, n) for _, n in traffic[(r - 1) % 3]["sends"]]
        assert torch.equal(observed[r]["tensor"], torch.arange(13, dtype=torch.float32) * 6)


def receives_first(tensor, src):
    comm.recv(tensor, (comm.rank() - 1) % comm.world_size())
    comm.send(tensor, (comm.rank() + 1) % comm.world_size())


@pytest.mark.parametrize("answer", both_forms(receives_first))
def test_a_deadlock_is_named_at_once(answer):
    """The router sees every rank waiting for another: the message names the cycle (a
    timeout would say "still waiting after 600 s" instead)."""
    result = checks.run_check("broadcast", answer, timeout=600)
    assert re.search(r"^world_size=2, .*: a deadlock: rank 0 waits to receive from rank 1, rank 1 waits to receive "
                     r"from rank 0\. No rank could go on, so the check stopped them at once\.", result.message)


def sleeps_on_the_last_rank(tensor, src):
    if comm.rank() == comm.world_size() - 1:
        time.sleep(3600)
    receives_first(tensor, src)


def test_a_rank_that_waits_for_something_else_is_not_called_a_deadlock():
    result = checks.run_check("broadcast", sleeps_on_the_last_rank, timeout=2)
    assert re.search(r"^world_size=2, .*: rank 1 was still running after 2 s, neither busy on the CPU nor waiting for "
                     r"a message: what is it waiting for \(a sleep, an input, a lock\)\? \(rank 0 waits to receive "
                     r"from rank 1\)", result.message), result.message


def finds_no_seed(tensor, src):
    """A right broadcast that first looks for the seed in every frame of its stack."""
    for frame in [sys._getframe(k) for k in range(len(inspect.stack(0)))]:
        if isinstance(frame.f_locals.get("seed"), int):
            raise RuntimeError(f"found the seed, {frame.f_locals['seed']}, in {frame.f_code.co_name}")
    _plain_broadcast(tensor, src)


def test_not_even_a_seed_given_to_run_check_reaches_the_ranks():
    result = checks.run_check("broadcast", finds_no_seed, seed=12345)
    assert result, result.message


@pytest.mark.parametrize("exercise_id", ["broadcast", "reduce_scatter", "ring_all_reduce"])
@pytest.mark.parametrize("form", ["function", "source"])
def test_correct_answers_pass_on_2_3_and_4_ranks(exercise_id, form):
    fn = solution(exercise_id)
    if form == "source":
        from notebook_answers import solution_notebook
        cells = [(n, c.source) for n, c in enumerate(solution_notebook(exercise_id).cells, 1)
                 if c.cell_type == "code"]
        fn = submission.definitions(cells, {fn.__name__}).answers[fn.__name__]
    result = checks.run_check(exercise_id, fn)
    assert result, result.message
    assert "on world sizes 2, 3, 4" in result.message


# -- collectives an exercise allows are computed by the router --------------------------

def _collectives_job(fn, inputs):
    sealed.begin(0)
    t = inputs[0].clone()
    dist.all_reduce(t)
    b = inputs[0].clone()
    dist.broadcast(b, 1)
    out = torch.empty(inputs[0].numel() * dist.get_world_size())
    dist.all_gather_into_tensor(out, inputs[0])
    sealed.observe(0, {"sum": t, "from_1": b, "all": out, "rank": comm.rank(), "p": comm.world_size()})


def test_allowed_collectives_go_through_the_router():
    seen = {}

    @checks.exercise("test_collectives", "collectives", answer="f", sealed=True)
    def check_collectives(fn, seed, timeout):
        def keep(p, i, observed, traffic):
            seen.update(observed)
        inputs = [[torch.full((2,), float(r + 1)) for r in range(3)]]
        sealed.run_sealed(_collectives_job, fn, inputs, world_size=3, timeout=timeout, exercise=("x", "y"),
                          check=keep, forbidden=())
        return ""
    try:
        assert checks.run_check("test_collectives", lambda: None), "the launch failed"
    finally:
        del checks.EXERCISES["test_collectives"]
    for r in range(3):
        assert seen[r]["rank"] == r and seen[r]["p"] == 3
        assert seen[r]["sum"].tolist() == [6.0, 6.0] and seen[r]["from_1"].tolist() == [2.0, 2.0]
        assert seen[r]["all"].tolist() == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]


def _run_job(job, inputs, world_size, forbidden=()):
    """Run a sealed job of this module under run_check; {rank: what it observed in trial 0}, or the failure."""
    seen = {}

    @checks.exercise("test_router", "router", answer="f", sealed=True)
    def check_router(fn, seed, timeout):
        def keep(p, i, observed, traffic):
            seen.update({r: {**o, "traffic": dict(traffic[r])} for r, o in observed.items()})
        sealed.run_sealed(job, fn, inputs, world_size=world_size, timeout=timeout, exercise=("x", "y"),
                          check=keep, forbidden=forbidden)
        return ""
    try:
        result = checks.run_check("test_router", lambda: None, timeout=20)
    finally:
        del checks.EXERCISES["test_router"]
    return seen, result


def _async_job(fn, inputs):
    """Two async all-reduces in flight at once (as DDP's hooks start them), waited for in reverse order."""
    sealed.begin(0)
    a, b = inputs[0].clone(), inputs[0].clone() * 10
    first, second = dist.all_reduce(a, async_op=True), comm.all_reduce(b, async_op=True)
    second.wait()
    first.wait()
    sealed.observe(0, {"a": a, "b": b})


def test_async_collectives_complete_at_wait():
    seen, result = _run_job(_async_job, [[torch.full((2,), float(r + 1)) for r in range(3)]], 3)
    assert result, result.message
    for r in range(3):
        assert seen[r]["a"].tolist() == [6.0, 6.0] and seen[r]["b"].tolist() == [60.0, 60.0]
        calls = seen[r]["traffic"]["collectives"]
        assert [c["kind"] for c in calls] == ["all_reduce", "all_reduce"]
        assert [(c["async"], c["group"], c["bytes"]) for c in calls] == [(True, [0, 1, 2], 8)] * 2
        assert all(c["waited"] == "" for c in calls)          # waited for, in the job's only phase


def _gather_and_uneven_all_to_all_job(fn, inputs):
    """A list all_gather, then an all-to-all where rank r sends r+1 rows to every rank."""
    sealed.begin(0)
    x = inputs[0]
    p, r = dist.get_world_size(), dist.get_rank()
    parts = [torch.empty_like(x) for _ in range(p)]
    dist.all_gather(parts, x)
    rows = torch.arange(p * (r + 1) * 2, dtype=torch.float32).view(-1, 2) + 100 * r
    out = torch.empty(sum(s + 1 for s in range(p)), 2)
    dist.all_to_all_single(out, rows, output_split_sizes=[s + 1 for s in range(p)],
                           input_split_sizes=[r + 1] * p)
    sealed.observe(0, {"parts": parts, "out": out})


def test_list_all_gather_and_uneven_all_to_all():
    seen, result = _run_job(_gather_and_uneven_all_to_all_job, [[torch.full((2,), float(r)) for r in range(3)]], 3)
    assert result, result.message
    for r in range(3):
        assert [t.tolist() for t in seen[r]["parts"]] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
        want = torch.cat([(torch.arange(3 * (s + 1) * 2, dtype=torch.float32).view(-1, 2) + 100 * s)
                          [r * (s + 1):(r + 1) * (s + 1)] for s in range(3)])
        assert torch.equal(seen[r]["out"], want)


def _subgroup_job(fn, inputs):
    """new_group: an all-reduce within {0, 2} and one within {1, 3}, and a rank number within the group."""
    sealed.begin(0)
    r = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = groups[r % 2]
    t = inputs[0].clone()
    dist.all_reduce(t, group=mine)
    sealed.observe(0, {"t": t, "rank_in_group": dist.get_rank(mine), "size": dist.get_world_size(mine)})


def test_subgroups_reduce_within_themselves():
    seen, result = _run_job(_subgroup_job, [[torch.tensor([float(10 ** r)]) for r in range(4)]], 4)
    assert result, result.message
    assert [seen[r]["t"].item() for r in range(4)] == [101.0, 1010.0, 101.0, 1010.0]
    assert [seen[r]["rank_in_group"] for r in range(4)] == [0, 0, 1, 1]
    assert all(seen[r]["size"] == 2 for r in range(4))


def _async_never_joined_job(fn, inputs):
    sealed.begin(0)
    t = inputs[0].clone()
    if dist.get_rank() == 0:
        dist.all_reduce(t, async_op=True).wait()
    else:
        comm.recv(t, 0)


def test_a_deadlock_on_an_async_collective_is_named():
    seen, result = _run_job(_async_never_joined_job, [[torch.zeros(1) for r in range(2)]], 2)
    assert not result
    assert "a deadlock: rank 0 waits in all_reduce for rank 1 to join it, rank 1 waits to receive from rank 0" \
        in result.message


def _objects_job(fn, inputs):
    """The library's bookkeeping collectives: objects pickled in a rank, unpickled in the others."""
    sealed.begin(0)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"rank": dist.get_rank()})
    bounds = [dist.get_rank(), "x"]
    dist.broadcast_object_list(bounds, src=1)
    sealed.observe(0, {"everyone": [e["rank"] for e in everyone], "bounds": bounds})


def test_object_collectives_pass_through_the_router():
    seen, result = _run_job(_objects_job, [[torch.zeros(1) for r in range(3)]], 3)
    assert result, result.message
    assert all(seen[r]["everyone"] == [0, 1, 2] and seen[r]["bounds"] == [1, "x"] for r in range(3))


# -- attacks on the other chapters' checks: the seed and the references are nowhere in reach --

def _secrets_in_reach():
    """The check's seed, anywhere in this process: the stack's locals, any frame or container gc
    tracks. Inside the answer of a sealed check, nothing."""
    import gc
    import sys
    target = int("918" + "273645")                       # computed: no constant of this code holds it
    me, frames, frame = sys._getframe(), [], sys._getframe().f_back
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    for obj in gc.get_objects():
        if type(obj).__name__ == "frame" and obj is not me:
            frames.append(obj)
        elif isinstance(obj, dict) and any(type(v) is int and v == target for v in obj.values()):
            return "a dict holds the seed"
        elif isinstance(obj, (list, tuple)) and any(type(v) is int and v == target for v in obj):
            return "a list holds the seed"
    for f in frames:
        if any(type(v) is int and v == target for v in f.f_locals.values()):
            return f"the frame of {f.f_code.co_name} holds the seed"
    return None


def zero1_reads_the_seed(flat_param, optimizer_class):
    """ZeRO-1: with the seed, the checker's own reference could be recomputed; without, a step that does nothing."""
    found = _secrets_in_reach()
    if found:
        raise RuntimeError(f"FOUND: {found}")
    return lambda flat_grad: None


def zero1_uses_the_backend(flat_param, optimizer_class):
    """ZeRO-1 that all-reduces on the process group's backend object, out of the router's sight."""
    group = dist.distributed_c10d._get_default_group()

    def step(flat_grad):
        group.allreduce([flat_grad]).wait()
    return step


def f_and_g_reads_the_seed():
    found = _secrets_in_reach()
    if found:
        raise RuntimeError(f"FOUND: {found}")
    return (lambda x, group: x), (lambda x, group: x)


def f_and_g_with_functional_collectives():
    """f and g whose all-reduce is a functional collective (no record at a process group)."""
    from torch.distributed import _functional_collectives as funcol

    class G(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            return funcol.all_reduce(x, "sum", list(range(comm.world_size())))

        @staticmethod
        def backward(ctx, grad):
            return grad, None
    return (lambda x, group: x), (lambda x, group: G.apply(x, group))


def dispatch_reads_the_seed(expert, num_experts, world_size):
    found = _secrets_in_reach()
    if found:
        raise RuntimeError(f"FOUND: {found}")
    return [0] * world_size, torch.zeros(0, dtype=torch.long)


def dispatch_with_the_backend(expert, num_experts, world_size):
    """Learns the other ranks' choices through the backend object's all-gather."""
    group = dist.distributed_c10d._get_default_group()
    out = [torch.empty_like(expert) for _ in range(world_size)]
    group.allgather([out], [expert]).wait()
    return [0] * world_size, torch.zeros(0, dtype=torch.long)


def bubble_fraction_reads_the_seed(timeline):
    found = _secrets_in_reach()
    if found:
        raise RuntimeError(f"FOUND: {found}")
    return -1.0


def bubble_fraction_with_functional_collectives(timeline):
    from torch.distributed import _functional_collectives as funcol
    return float(funcol.all_reduce(torch.tensor([float(timeline.world_size)]), "sum", [0])[0])


CHAPTER_ATTACKS = [
    ("zero1_step", zero1_reads_the_seed, r"rank \d gave its optimizer nothing element\(s\)"),
    ("zero1_step", zero1_uses_the_backend, r"rank \d raised RuntimeError: a check's ranks have no process group"),
    ("f_g", f_and_g_reads_the_seed, r"rank \d: x\.grad after f's backward differs from the single-process value"),
    ("f_g", f_and_g_with_functional_collectives, r"rank \d raised RuntimeError: a check's ranks have no process group"),
    ("moe_dispatch", dispatch_reads_the_seed, r"rank \d's send_counts is \[0(, 0)+\], expected"),
    ("moe_dispatch", dispatch_with_the_backend, r"rank \d raised RuntimeError: a check's ranks have no process group"),
    ("bubble_fraction", bubble_fraction_reads_the_seed,
     r"bubble_fraction_reads_the_seed must return a dict with 'per_rank', 'overall' and 'idle'; got -1\.0\."),
    ("bubble_fraction", bubble_fraction_with_functional_collectives,
     r"bubble_fraction_with_functional_collectives raised RuntimeError: a check's ranks have no process group"),
]


def as_source_with_search(fn):
    """As as_source, with _secrets_in_reach defined in the notebook too."""
    cells = [(1, IMPORTS), (2, inspect.getsource(_secrets_in_reach)), (3, textwrap.dedent(inspect.getsource(fn)))]
    return submission.definitions(cells, {fn.__name__}).answers[fn.__name__]


@pytest.mark.parametrize("exercise_id, answer, pattern",
                         [pytest.param(ex, answer, pattern, id=f"{fn.__name__}-{form}")
                          for ex, fn, pattern in CHAPTER_ATTACKS
                          for form, answer in (("function", fn), ("source", as_source_with_search(fn)))])
def test_an_attack_on_another_chapter_finds_no_secret_and_gets_no_pass(exercise_id, answer, pattern):
    result = checks.run_check(exercise_id, answer, seed=int("918" + "273645"))    # the seed _secrets_in_reach
    assert not result                                                               # looks for: in no name here
    assert "FOUND" not in result.message, result.message
    assert re.search(pattern, result.message), result.message


def test_the_attacks_would_find_the_seed_in_the_checkers_own_process():
    """The search is not blind: in the process that runs the check (where the old checks
    called a pure-function answer), the seed is in reach."""
    found = []

    @checks.exercise("test_in_reach", "in reach", answer="f")
    def check_in_reach(fn, seed, timeout):
        found.append(_secrets_in_reach())
        return ""
    try:
        checks.run_check("test_in_reach", lambda: None, seed=int("918" + "273645"))
    finally:
        del checks.EXERCISES["test_in_reach"]
    assert found[0]


@pytest.mark.parametrize("exercise_id", sorted(checks.EXERCISES))
def test_every_solution_passes_as_the_grader_reads_it(exercise_id, capsys):
    """The definitions taken from the solution notebook's source, with nothing ignored, run only in
    the ranks. (As a function, pplab.check in the notebook, each solution notebook checks itself:
    solutions/ runs under nbval in `make test`.)"""
    from notebook_answers import solution_definitions
    name, found = solution_definitions(exercise_id)
    assert found.notes == []
    result = checks.check(exercise_id, found.answers[name])
    assert result, result.message
    assert capsys.readouterr().out.startswith(f"✔ {exercise_id}: passed")
    if exercise_id == "broadcast":
        assert "on world sizes 2, 3, 4" in result.message
    assert checks.get_exercise(exercise_id).sealed


def _stops_in_trial_1_job(fn, inputs):
    """Rank 2 raises in trial 1 before recording it; ranks 0 and 1 record trials 0, 1 and 2
    (all of them before rank 2 raises: the barrier waits for them, so no timing decides it)."""
    for i in range(3):
        sealed.begin(i)
        if dist.get_rank() == 2 and i == 1:
            dist.barrier()
            raise ValueError("rank 2 stops here")
        sealed.observe(i, {"rank": dist.get_rank()})
    dist.barrier()


def test_after_a_failed_launch_trials_are_judged_up_to_the_first_one_a_rank_never_recorded():
    """Trial 1 is judged on what ranks 0 and 1 saw (a wrong value there is the clearest message);
    trial 2 is not: what they saw there is out of step with rank 2, so the launch's own failure
    (rank 2's raise) is what gets reported."""
    judged = []

    @checks.exercise("test_judged", "judged", answer="f", sealed=True)
    def check_judged(fn, seed, timeout):
        sealed.run_sealed(_stops_in_trial_1_job, fn, [[0] * 3] * 3, world_size=3, timeout=timeout,
                          exercise=("x", "y"), forbidden=(),
                          check=lambda p, i, seen, traffic: judged.append((i, sorted(seen))))
        return ""
    try:
        result = checks.run_check("test_judged", lambda: None, timeout=20)
    finally:
        del checks.EXERCISES["test_judged"]
    assert judged == [(0, [0, 1, 2]), (1, [0, 1])]
    assert not result and "rank 2 raised ValueError: rank 2 stops here" in result.message


def test_a_rank_keeps_the_folder_pplab_is_imported_from(monkeypatch):
    """A course cloned into a folder the rank hides (/tmp) and installed editable is found without
    sys.path (a notebook's kernel runs in solutions/): the rank must keep pplab's own folder, or a
    checker that imports a chapter module inside the rank fails with ModuleNotFoundError."""
    import pplab
    from pplab import isolation
    root = os.path.dirname(os.path.dirname(os.path.realpath(pplab.__file__)))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and os.path.realpath(p) != root])
    kept = isolation.needed_under((os.path.dirname(root),))
    assert any(root == p or root.startswith(p + "/") for p in kept), kept
