"""pplab.collectives: equal to torch.distributed's own collectives, with exactly the bytes
the α-β cost model counts, in subgroups too, and a clear error on every rank for bad input.

One launch per world size runs every case; the checks inside a rank compare with the
backend's collective run on a copy of the same data. Tolerances (the additions happen
in a different order): float32 rtol=atol=1e-5, float64 rtol=atol=1e-12, int64 exact.
"""
import math
import queue
import re
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import pplab
from pplab import collectives as C
from pplab import trace

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

ALGOS = C.ALL_REDUCE_ALGORITHMS
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.int64: 0}
REF_OP = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT,
          "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


# ----------------------------------------------------------------------------------
# Who talks to whom, in seconds. On gloo a send waits for its receive, so an algorithm that
# receives from the wrong peer at p >= 3 deadlocks (at p = 2 the only peer is the right one):
# a launch sees that only when its timeout expires. Here the ranks' algorithms run as threads
# of this process over mailboxes, one queue per (sender, receiver): a receive that waits more
# than WAIT seconds fails with the pair named, and the data (different for every sender and
# receiver, uneven sizes) is compared with values written by hand. The group's global ranks
# are not 0..p-1, so a local index used as a global rank shows too. These come first in the
# file: a run stopped at the first failure names the wrong peer before a launch hangs on it.

WAIT = 2.0


class _Mailboxes:
    """Stands in for pplab.comm inside pplab.collectives: send, recv, isend, irecv over queues."""

    class _Done:
        def __init__(self, finish=None):
            self._finish = finish

        def wait(self):
            if self._finish:
                self._finish()

    def __init__(self):
        self.boxes, self.me = {}, threading.local()
        self.lock = threading.Lock()

    def _box(self, src, dst):
        with self.lock:
            return self.boxes.setdefault((src, dst), queue.Queue())

    def send(self, tensor, dst, group=None, tag=0):
        assert dst != self.me.rank, f"rank {dst} sends to itself"
        self._box(self.me.rank, dst).put(tensor.detach().clone())

    def recv(self, tensor, src, group=None, tag=0):
        me = self.me.rank
        try:
            got = self._box(src, me).get(timeout=WAIT)
        except queue.Empty:
            raise AssertionError(f"rank {me} waited {WAIT} s for a message from rank {src}, which never sent "
                                 f"it one: a receive from the wrong peer (on gloo: a deadlock)") from None
        assert got.shape == tensor.shape, f"rank {me} expected {tuple(tensor.shape)} from {src}, got {tuple(got.shape)}"
        tensor.copy_(got)

    def isend(self, tensor, dst, group=None, tag=0):
        self.send(tensor, dst, group, tag)
        return self._Done()

    def irecv(self, tensor, src, group=None, tag=0):
        return self._Done(lambda: self.recv(tensor, src, group, tag))     # waited on by the same rank


def _run_ranks(monkeypatch, ranks, body, boxes=None):
    """body(me) on a thread per rank of the group (me = index in ranks); their results, in order."""
    boxes = boxes or _Mailboxes()
    monkeypatch.setattr(C, "comm", boxes)
    results, errors = [None] * len(ranks), [None] * len(ranks)

    def run(me):
        boxes.me.rank = ranks[me]
        try:
            results[me] = body(me)
        except BaseException as exc:                   # noqa: BLE001 (reported below, by rank)
            errors[me] = exc

    threads = [threading.Thread(target=run, args=(me,), daemon=True) for me in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT * 4 * len(ranks))
    assert not any(t.is_alive() for t in threads), "a rank never finished"
    for me, exc in enumerate(errors):
        if exc is not None:
            raise AssertionError(f"rank {ranks[me]} (index {me}): {exc}") from exc
    leftover = {k: q.qsize() for k, q in boxes.boxes.items() if q.qsize()}
    assert not leftover, f"messages sent but never received (sender, receiver): {leftover}"
    return results


GROUPS = [[4, 0, 2], [1, 5, 3, 6], [0, 1, 2, 3, 4]]         # p = 3, 4, 5; not in order, not 0..p-1


def _rows(p):
    """rows[i][j]: rows the i-th rank sends the j-th; 0 to 3, differing per pair (some 0)."""
    return [[(2 * i + 3 * j + i * j) % 4 for j in range(p)] for i in range(p)]


@pytest.mark.parametrize("ranks", GROUPS, ids=lambda r: f"p{len(r)}")
def test_pairwise_all_to_all_takes_each_piece_from_its_sender(monkeypatch, ranks):
    p, rows = len(ranks), _rows(len(ranks))

    def body(me):                                  # my piece for the j-th rank: rows of 100·me + j
        ins = [torch.full((rows[me][j], 2), 100.0 * me + j) for j in range(p)]
        outs = [torch.full((rows[i][me], 2), -1.0) for i in range(p)]
        C.pairwise_all_to_all(outs, ins, ranks, me, None)
        return outs

    for me, outs in enumerate(_run_ranks(monkeypatch, ranks, body)):
        for i, piece in enumerate(outs):          # from the i-th rank: its piece for me
            assert piece.tolist() == [[100.0 * i + me] * 2] * rows[i][me], (me, i, piece)


@pytest.mark.parametrize("ranks", GROUPS, ids=lambda r: f"p{len(r)}")
def test_ring_all_gather_and_reduce_scatter_by_hand(monkeypatch, ranks):
    p = len(ranks)
    sizes = [len(c) for c in torch.arange(2 * p + 1).tensor_split(p)]     # uneven: the first chunks larger

    def gather(me):                                # I hold my chunk (10·me + k); the others are unknown
        chunks = [torch.full((n,), -1.0) for n in sizes]
        chunks[me].copy_(10.0 * me + torch.arange(sizes[me]))
        C._ring_all_gather(chunks, ranks, me, None)
        return chunks

    for me, chunks in enumerate(_run_ranks(monkeypatch, ranks, gather)):
        for i, c in enumerate(chunks):
            assert c.tolist() == (10.0 * i + torch.arange(sizes[i])).tolist(), (me, i)

    def scatter(me):                               # my part of chunk i: 1000·(me+1) + i, summed over ranks
        chunks = [torch.full((n,), 1000.0 * (me + 1) + i) for i, n in enumerate(sizes)]
        C._ring_reduce_scatter(chunks, ranks, me, None, "sum")
        return chunks[me]

    total = 1000.0 * p * (p + 1) / 2
    for me, mine in enumerate(_run_ranks(monkeypatch, ranks, scatter)):
        assert mine.tolist() == [total + p * me] * sizes[me], me


@pytest.mark.parametrize("ranks", GROUPS, ids=lambda r: f"p{len(r)}")
def test_scatter_and_gather_by_hand_with_one_element_pieces(monkeypatch, ranks):
    """The root's pieces have one element each (the smallest that must still travel): the
    i-th rank ends with piece i, and gather brings each rank's piece back into slot i."""
    p, root = len(ranks), ranks[1]
    boxes = _Mailboxes()
    boxes.rank = lambda group=None: boxes.me.rank
    boxes.group_ranks = lambda group=None: tuple(ranks)
    monkeypatch.setattr(C, "_setup", lambda kind, group, tensor, problems=(), **call: (list(ranks),
                                                                                       ranks.index(boxes.me.rank)))

    def scatter_then_gather(me):
        mine = torch.full((1,), -1.0)
        pieces = [torch.full((1,), 10.0 + j) for j in range(p)] if ranks[me] == root else None
        C.scatter(mine, pieces, src=root)
        back = [torch.full((1,), -1.0) for _ in range(p)] if ranks[me] == root else None
        C.gather(mine * 2, back, dst=root)
        return mine.item(), back

    for me, (mine, back) in enumerate(_run_ranks(monkeypatch, ranks, scatter_then_gather, boxes)):
        assert mine == 10.0 + me, (me, mine)
        if ranks[me] == root:
            assert [t.item() for t in back] == [2 * (10.0 + j) for j in range(p)]


@pytest.mark.parametrize("ranks", GROUPS, ids=lambda r: f"p{len(r)}")
def test_trees_and_every_all_reduce_by_hand(monkeypatch, ranks):
    p = len(ranks)

    def mine(me):                                  # 5 elements: p does not divide them (p = 3, 4)
        return torch.arange(5, dtype=torch.float64) * (me + 1) + 7 * me

    want = sum(mine(me) for me in range(p)).tolist()
    for root in range(p):
        def bcast(me):
            x = mine(me)
            C._tree_broadcast(x, ranks, root, me, None)
            return x
        assert all(x.tolist() == mine(root).tolist() for x in _run_ranks(monkeypatch, ranks, bcast)), root

        def red(me):
            x = mine(me)
            C._tree_reduce(x, ranks, root, me, None, "sum")
            return x
        assert _run_ranks(monkeypatch, ranks, red)[root].tolist() == want, root

    def folded(algorithm):                         # as all_reduce runs them: extra ranks folded in first
        return lambda *args: C._fold_to_power_of_two(algorithm, *args)
    algorithms = {"naive": C._naive_all_reduce, "tree": C._tree_all_reduce, "ring": C._ring_all_reduce,
                  "recursive_doubling": folded(C._recursive_doubling),
                  "halving_doubling": folded(C._halving_doubling)}
    for name, run in algorithms.items():
        def allred(me):
            x = mine(me)
            run(x, ranks, me, None, "sum")
            return x
        for me, x in enumerate(_run_ranks(monkeypatch, ranks, allred)):
            assert x.tolist() == pytest.approx(want, abs=1e-12), (name, me)


def _cases(p):
    """(shape, dtype, op): fewer elements than ranks (none at all when p=1), sizes p does
    not divide, a 2-d tensor, every dtype, every op."""
    return [((1,), torch.int64, "sum"), ((max(p - 1, 0),), torch.float32, "sum"),
            ((7,), torch.float64, "product"), ((1003,), torch.float32, "sum"),
            ((1003,), torch.int64, "max"), ((3, 5), torch.float64, "min")]


def _ref(name):   # torch >= 2.13 renamed these two; older torch has only the old names
    new = {"all_gather_into_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}
    return getattr(dist, new[name], None) or getattr(dist, name)


def _compare_with_torch(group=None, cases=None, textbook_numel=1680):
    """Run on every rank of `group`: each collective of ours next to torch's, on copies of
    the same data. Our calls are wrapped in trace spans so the test can count their bytes."""
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    p, rank = len(ranks), dist.get_rank()
    failures, checked = [], 0

    def same(what, ours, ref):
        nonlocal checked
        checked += 1
        tol = TOL[ref.dtype]
        if ours.shape != ref.shape or not torch.allclose(ours, ref, rtol=tol, atol=tol):
            failures.append(f"{what} on rank {rank}: ours {ours.flatten()[:4].tolist()} "
                            f"torch {ref.flatten()[:4].tolist()}")

    def data(shape, dtype, op, salt):
        g = torch.Generator().manual_seed(1000 * rank + salt)
        if dtype.is_floating_point:
            return torch.randn(shape, generator=g, dtype=dtype)
        high = 4 if op == "product" else 1000            # products of p small ints do not overflow
        return torch.randint(-high + 1, high, shape, generator=g, dtype=dtype)

    def ours(kind, numel, dtype, **meta):                 # a span the test reads bytes from
        return trace.span("case", label=kind, numel=numel, es=torch.empty(0, dtype=dtype).element_size(),
                          group=tuple(ranks), **meta)

    cases = _cases(p) if cases is None else cases
    for i, (shape, dtype, op) in enumerate(cases):
        n = math.prod(shape)
        x = data(shape, dtype, op, i)
        what = f"{tuple(shape)} {str(dtype)[6:]} {op}"
        for algo in ALGOS:
            a, b = x.clone(), x.clone()
            with ours("all_reduce", n, dtype, algorithm=algo):
                C.all_reduce(a, op=op, algorithm=algo, group=group)
            dist.all_reduce(b, op=REF_OP[op], group=group)
            same(f"all_reduce {algo} {what}", a, b)
            everyone = [torch.empty_like(a) for _ in ranks]
            dist.all_gather(everyone, a, group=group)
            if not all(torch.equal(e, everyone[0]) for e in everyone):
                failures.append(f"all_reduce {algo} {what}: ranks ended with different results")

        root = ranks[(i + p - 1) % p]                     # a different root each case, often not 0
        a, b = x.clone(), x.clone()
        with ours("broadcast", n, dtype, root=ranks.index(root)):
            C.broadcast(a, src=root, group=group)
        dist.broadcast(b, src=root, group=group)
        same(f"broadcast {what} from {root}", a, b)

        a, b = x.clone(), x.clone()
        with ours("reduce", n, dtype, root=ranks.index(root)):
            C.reduce(a, dst=root, op=op, group=group)
        dist.reduce(b, dst=root, op=REF_OP[op], group=group)
        same(f"reduce {what} to {root}", a, b if rank == root else x)   # non-roots keep their input

        pieces = [data(shape, dtype, op, 100 + j) for j in range(p)] if rank == root else None
        a, b = torch.empty_like(x), torch.empty_like(x)
        with ours("scatter", n, dtype, root=ranks.index(root)):
            C.scatter(a, pieces, src=root, group=group)
        dist.scatter(b, pieces, src=root, group=group)
        same(f"scatter {what} from {root}", a, b)

        a = [torch.empty_like(x) for _ in ranks] if rank == root else None
        b = [torch.empty_like(x) for _ in ranks] if rank == root else None
        with ours("gather", n, dtype, root=ranks.index(root)):
            C.gather(x, a, dst=root, group=group)
        dist.gather(x, b, dst=root, group=group)
        if rank == root:
            same(f"gather {what} to {root}", torch.stack(a), torch.stack(b))

        gathered = (p * shape[0], *shape[1:])
        a, b = torch.empty(gathered, dtype=dtype), torch.empty(gathered, dtype=dtype)
        with ours("all_gather", n, dtype):
            C.all_gather_into_tensor(a, x, group=group)
        _ref("all_gather_into_tensor")(b, x, group=group)
        same(f"all_gather_into_tensor {what}", a, b)

        a, b = [torch.empty_like(x) for _ in ranks], [torch.empty_like(x) for _ in ranks]
        with ours("all_gather", n, dtype):
            C.all_gather(a, x, group=group)
        dist.all_gather(b, x, group=group)
        same(f"all_gather {what}", torch.stack(a), torch.stack(b))

        big = data(gathered, dtype, op, 200 + i)              # p pieces shaped like x
        a, b = torch.empty_like(x), torch.empty_like(x)
        with ours("reduce_scatter", n, dtype):
            C.reduce_scatter_tensor(a, big, op=op, group=group)
        _ref("reduce_scatter_tensor")(b, big, op=REF_OP[op], group=group)
        same(f"reduce_scatter_tensor {what}", a, b)

        a, b = torch.empty_like(big), torch.empty_like(big)
        with ours("all_to_all", n, dtype):
            C.all_to_all_single(a, big, group=group)
        dist.all_to_all_single(b, big, group=group)
        same(f"all_to_all_single {what}", a, b)

    if textbook_numel:                                     # divisible by 1..8: the textbook figures
        x = data((textbook_numel,), torch.float32, "sum", 999)
        for algo in ALGOS:
            a, b = x.clone(), x.clone()
            with ours("textbook", textbook_numel, torch.float32, algorithm=algo):
                C.all_reduce(a, algorithm=algo, group=group)
            dist.all_reduce(b, group=group)
            same(f"all_reduce {algo} textbook", a, b)
    return checked, failures


# ----------------------------------------------------------------------------------
# Closed forms: (bytes, messages) each rank sends, written from the algorithms' definitions.


def _tree_sends(vr, p):
    """Binomial-tree broadcast: rank vr (counted from the root) sends in round k when it
    already has the data (vr < 2^k) and its partner vr + 2^k exists."""
    return sum(1 for k in range(p.bit_length()) if 2 ** k < p and vr < 2 ** k and vr + 2 ** k < p)


def _expected_sends(label, meta, p, me):
    n, es = meta["numel"], meta["es"]
    N = n * es
    if p == 1 or n == 0:
        return 0, 0
    if label in ("all_gather", "reduce_scatter", "all_to_all"):       # rings / pairwise, one piece a step
        return (p - 1) * N, p - 1
    if label == "scatter":
        return ((p - 1) * N, p - 1) if me == meta["root"] else (0, 0)
    if label in ("gather", "reduce"):
        return (N, 1) if me != meta["root"] else (0, 0)
    if label == "broadcast":
        m = _tree_sends((me - meta["root"]) % p, p)
        return m * N, m
    algo = meta["algorithm"]
    if algo == "naive":                                   # workers -> server -> workers
        return ((p - 1) * N, p - 1) if me == 0 else (N, 1)
    if algo == "tree":                                    # binomial reduce to 0, then broadcast
        m = (me != 0) + _tree_sends(me, p)
        return m * N, m
    if algo == "ring":                                    # reduce-scatter: every chunk but mine,
        c = [len(t) for t in torch.arange(n).tensor_split(p)]   # all-gather: all but my right's
        sent = [c[i] for i in range(p) if i != me] + [c[i] for i in range(p) if i != (me + 1) % p]
        return sum(sent) * es, sum(1 for x in sent if x)
    q = 1 << (p.bit_length() - 1)                         # a power of two after folding r = p - q ranks
    r = p - q
    if me < 2 * r and me % 2 == 0:                        # hands its tensor over, gets the result back
        return N, 1
    v = me // 2 if me < 2 * r else me - r                 # my index among the q ranks that stay
    extra = [n] if me < 2 * r else []                     # sends the result back to its partner
    masks = [2 ** k for k in range(q.bit_length() - 1)]
    if algo == "recursive_doubling":                      # the whole tensor at every step
        sent = [n for _ in masks] + extra
    else:                                                 # halving-doubling, over q chunks:
        c = [len(t) for t in torch.arange(n).tensor_split(q)]

        def block(i, m):                                  # the m chunks in i's block of size m
            return sum(c[i // m * m:(i // m + 1) * m])
        # reduce-scatter gives away the half it does not keep; all-gather sends all it has
        sent = [block(v ^ m, m) for m in masks] + [block(v, m) for m in masks] + extra
    return sum(sent) * es, sum(1 for x in sent if x)


def _expected_receives(label, meta, p, me):
    """(bytes, messages) each rank receives: not the mirror of what it sends (a broadcast's
    root receives nothing, a ring's chunks differ by rank when p does not divide the tensor)."""
    n, es = meta["numel"], meta["es"]
    N = n * es
    if p == 1 or n == 0:
        return 0, 0
    if label in ("all_gather", "reduce_scatter", "all_to_all"):
        return (p - 1) * N, p - 1
    if label == "scatter":
        return (N, 1) if me != meta["root"] else (0, 0)
    if label == "gather":
        return ((p - 1) * N, p - 1) if me == meta["root"] else (0, 0)
    if label == "broadcast":                              # once, from the rank that reached me
        return (N, 1) if me != meta["root"] else (0, 0)
    if label == "reduce":                                 # the broadcast's tree backwards: from my children
        m = _tree_sends((me - meta["root"]) % p, p)
        return m * N, m
    algo = meta["algorithm"]
    if algo == "naive":
        return ((p - 1) * N, p - 1) if me == 0 else (N, 1)
    if algo == "tree":                                    # from my children, then from my parent
        m = _tree_sends(me, p) + (me != 0)
        return m * N, m
    if algo == "ring":                                    # reduce-scatter: every chunk but my left's,
        c = [len(t) for t in torch.arange(n).tensor_split(p)]   # all-gather: every chunk but mine
        got = [c[i] for i in range(p) if i != (me - 1) % p] + [c[i] for i in range(p) if i != me]
        return sum(got) * es, sum(1 for x in got if x)
    return _expected_sends(label, meta, p, me)            # recursive doubling, halving-doubling: swaps


def _measured(timeline):
    """{(rank, span index on that rank): (label, meta, bytes sent, sends)} for every case span."""
    out = {}
    for rank in range(timeline.world_size):
        comm = timeline.select(rank, "comm")
        for i, span in enumerate(timeline.select(rank, "compute", "case")):
            inside = [e for e in comm if span.start <= e.start and e.end <= span.end]
            sends = [e for e in inside if e.kind == "send"]
            recvs = [e for e in inside if e.kind == "recv"]
            out[rank, i] = (span.label, span.meta, sum(e.bytes_sent for e in sends), len(sends),
                            {e.peer for e in inside}, sum(e.bytes_recv for e in recvs), len(recvs),
                            sum(e.bytes_recv for e in sends) + sum(e.bytes_sent for e in recvs))
    return out


def _check_bytes(timeline):
    """Every case's bytes and messages, on every rank, equal the closed form; and no rank
    talked to a rank outside the case's group."""
    measured = _measured(timeline)
    for (rank, _), (label, meta, sent, sends, peers, got, recvs, crossed) in measured.items():
        ranks = list(meta["group"])
        assert peers <= set(ranks), f"rank {rank} {label}: talked to {peers - set(ranks)} outside {ranks}"
        kind = "all_reduce" if label == "textbook" else label
        expected = _expected_sends(kind, meta, len(ranks), ranks.index(rank))
        assert (sent, sends) == expected, f"rank {rank} {label} {meta}: sent {sent} B in {sends} " \
                                          f"messages, expected {expected}"
        expected = _expected_receives(kind, meta, len(ranks), ranks.index(rank))
        assert (got, recvs) == expected, f"rank {rank} {label} {meta}: received {got} B in {recvs} " \
                                         f"messages, expected {expected}"
        assert crossed == 0                               # a send receives nothing, a receive sends nothing
    # every message sent was received, by the rank it was sent to
    sends = [e for e in timeline.select(category="comm") if e.kind == "send"]
    assert len(timeline.messages()) == len(sends)
    return measured


SMALL = [((1,), torch.int64, "sum"), ((1003,), torch.float32, "sum"), ((3, 5), torch.float64, "max")]


def test_subgroups_two_at_once_and_a_non_power_of_two_one():
    def f():
        pairs = {1: dist.new_group([1, 3]), 0: dist.new_group([0, 2])}   # every rank makes every group
        trio = dist.new_group([0, 1, 3])
        rank = dist.get_rank()
        done = [_compare_with_torch(pairs[rank % 2], SMALL)]              # both pairs at the same time
        if rank != 2:
            done.append(_compare_with_torch(trio, SMALL))                 # rank 2 sits this one out
        return done

    res = pplab.launch(f, world_size=4, timeout=60)
    for rank, done in enumerate(res):
        assert len(done) == (1 if rank == 2 else 2)
        for checked, failures in done:
            assert failures == []
            assert checked >= len(SMALL) * 12 + 5
    measured = _check_bytes(res.timeline)
    assert {m["group"] for _, m, *_ in measured.values()} == {(1, 3), (0, 2), (0, 1, 3)}


def _bad_calls():
    """Every bad call, on every rank; returns {case: the ValueError's text or None}."""
    rank = dist.get_rank()
    pair = dist.new_group([1, 3])
    x = torch.ones(4)
    errors = {}

    def attempt(name, fn):
        try:
            fn()
            errors[name] = None
        except ValueError as exc:
            errors[name] = str(exc)

    attempt("shape", lambda: C.all_reduce(torch.ones(5 if rank == 2 else 4)))
    attempt("dtype", lambda: C.broadcast(torch.ones(4, dtype=torch.float64 if rank == 1 else None), 0))
    attempt("root outside", lambda: C.reduce(x.clone(), dst=4))
    if rank in (1, 3):
        attempt("root outside group", lambda: C.broadcast(x.clone(), src=0, group=pair))
    attempt("roots disagree", lambda: C.broadcast(x.clone(), src=rank % 2))
    attempt("unknown algorithm", lambda: C.all_reduce(x.clone(), algorithm="butterfly"))
    attempt("one rank's typo", lambda: C.all_reduce(x.clone(), algorithm="rign" if rank == 3 else "ring"))
    attempt("algorithms disagree", lambda: C.all_reduce(x.clone(), algorithm="tree" if rank == 0 else "ring"))
    attempt("unknown op", lambda: C.all_reduce(x.clone(), op="avg"))
    attempt("different collectives",
            lambda: C.broadcast(x.clone(), 0) if rank == 0 else C.all_reduce(x.clone()))
    attempt("output size", lambda: C.all_gather_into_tensor(torch.empty(15 if rank == 1 else 16), x))
    attempt("scatter_list", lambda: C.scatter(x.clone(), [x.clone()] * 3 if rank == 0 else None, src=0))
    attempt("not contiguous", lambda: C.all_reduce(torch.ones(4, 2).t() if rank == 2 else torch.ones(2, 4)))
    if rank == 0:
        attempt("not a member", lambda: C.all_reduce(x.clone(), group=pair))
    y = torch.full((4,), float(rank))         # afterwards the ranks still work together:
    C.all_reduce(y)                           # no stray message was left in flight
    return errors, y.tolist()


def test_bad_input_raises_the_same_clear_error_on_every_rank():
    res = pplab.launch(_bad_calls, world_size=4, timeout=30)    # a hang would fail after 30 s
    expect = {                                                  # what the message must say
        "shape": ["rank 2: float32[5]", "rank 0: float32[4]", "same"],
        "dtype": ["rank 1: float64[4]", "rank 0: float32[4]"],
        "root outside": ["dst=4", "[0, 1, 2, 3]", "global rank"],
        "root outside group": ["src=0", "[1, 3]"],
        "roots disagree": ["disagree", "'src': 0", "'src': 1"],
        "unknown algorithm": ["'butterfly'"] + [repr(a) for a in C.ALL_REDUCE_ALGORITHMS],
        "one rank's typo": ["rank 3", "'rign'", "'halving_doubling'"],
        "algorithms disagree": ["disagree", "'tree'", "'ring'"],
        "unknown op": ["'avg'", "sum, product, max, min"],
        "different collectives": ["'broadcast'", "'all_reduce'"],
        "output size": ["rank 1", "float32[15]", "4 x input.numel() = 16"],
        "scatter_list": ["rank 0", "scatter_list", "(4), got 3"],
        "not contiguous": ["rank 2", "contiguous()"],
        "not a member": ["rank 0 is not in the group [1, 3]"],
    }
    for rank, (errors, y) in enumerate(res):
        assert y == [6.0] * 4
        for case, words in expect.items():
            if case == "root outside group" and rank not in (1, 3) or case == "not a member" and rank != 0:
                assert case not in errors
                continue
            assert errors[case] is not None, f"rank {rank}: {case} raised nothing"
            for w in words:
                assert w in errors[case], f"rank {rank}: {case}: {w!r} not in {errors[case]!r}"


def test_uncaught_bad_input_stops_the_launch_with_the_message():
    def f():
        C.all_reduce(torch.ones(5 if dist.get_rank() == 1 else 4), algorithm="halving_doubling")

    with pytest.raises(pplab.LaunchError, match=r"ValueError: all_reduce: .*rank 1: float32\[5\]"):
        pplab.launch(f, world_size=3, timeout=30)


def test_halving_doubling_folds_non_power_of_two_groups():
    """p = 3, 5, 6, 7 (= 2^k + r): the r extra ranks hand their tensor to a partner first."""
    def f():
        rank, out = dist.get_rank(), {}
        for ranks in ([0, 1, 2], [0, 1, 2, 3, 4], [1, 2, 3, 4, 5, 6], list(range(7))):
            g = dist.new_group(ranks)
            if rank in ranks:
                x = torch.arange(11, dtype=torch.int64) * (rank + 1)
                for algo in ("halving_doubling", "recursive_doubling"):
                    a = x.clone()
                    C.all_reduce(a, algorithm=algo, group=g)
                    out[len(ranks), algo] = a.tolist()
        return out

    res = pplab.launch(f, world_size=7, timeout=60)
    for rank, out in enumerate(res):
        for (p, algo), got in out.items():
            members = {3: [0, 1, 2], 5: [0, 1, 2, 3, 4], 6: [1, 2, 3, 4, 5, 6], 7: list(range(7))}[p]
            assert got == [i * sum(r + 1 for r in members) for i in range(11)], (rank, p, algo)


def test_parameters_are_synchronised_in_place():
    """Parameters (leaves that require grad) can be synchronised in place, as with torch.distributed."""
    def f():
        rank = dist.get_rank()
        w = torch.nn.Parameter(torch.arange(5.0) * (rank + 1))
        for algo in ALGOS:
            C.all_reduce(w, algorithm=algo)              # sum of (r+1) over 2 ranks = 3, then 9, ...
        C.broadcast(w, src=1)
        out = torch.empty(10)
        C.all_gather_into_tensor(out, w)
        return w.detach().tolist(), out.tolist(), w.requires_grad

    for w, out, requires_grad in pplab.launch(f, world_size=2, timeout=30):
        assert w == [i * 3 * 2 ** 4 for i in range(5)] and out == w + w and requires_grad


def test_built_only_from_traced_point_to_point():
    """No torch collective moves data behind the trace's back: collectives.py calls only
    pplab.comm's point-to-point functions, plus torch.distributed for bookkeeping."""
    source = (Path(C.__file__)).read_text()
    assert set(re.findall(r"\bcomm\.(\w+)\(", source)) <= {"send", "recv", "isend", "irecv", "rank", "group_ranks"}
    assert set(re.findall(r"\bdist\.(\w+)\(", source)) <= {
        "is_initialized", "get_rank", "get_world_size", "get_process_group_ranks",
        "all_gather_object"}                    # all_gather_object: the untraced argument check only


def test_sent_and_received_by_hand_for_rooted_collectives():
    """p = 5, root 2, 4 float32 (16 bytes): numbers counted on paper from the trees.
    broadcast: 2→3 | 2→4 3→0 | 2→1. reduce: the same arrows reversed. scatter/gather:
    the root and 4 pieces of 4 bytes. Each as (sent, received) per rank."""
    def f():
        x, out = torch.arange(4.0), {}
        for name, call in (("broadcast", lambda: C.broadcast(x.clone(), src=2)),
                           ("reduce", lambda: C.reduce(x.clone(), dst=2)),
                           ("scatter", lambda: C.scatter(torch.empty(1), list(x.repeat(5)[:5].split(1))
                                                         if dist.get_rank() == 2 else None, src=2)),
                           ("gather", lambda: C.gather(x[:1].clone(), list(torch.empty(5).split(1))
                                                       if dist.get_rank() == 2 else None, dst=2))):
            with trace.span("case", label=name):
                call()
        return out

    tl = pplab.launch(f, world_size=5, timeout=60).timeline
    by_hand = {"broadcast": [(0, 16), (0, 16), (48, 0), (16, 16), (0, 16)],
               "reduce": [(16, 0), (16, 0), (0, 48), (16, 16), (16, 0)],
               "scatter": [(0, 4), (0, 4), (16, 0), (0, 4), (0, 4)],
               "gather": [(4, 0), (4, 0), (0, 16), (4, 0), (4, 0)]}
    for name, expected in by_hand.items():
        measured = []
        for r in range(5):
            (span,) = [s for s in tl.select(r, "compute", "case") if s.label == name]
            inside = [e for e in tl.select(r, "comm") if span.start <= e.start and e.end <= span.end]
            measured.append((sum(e.bytes_sent for e in inside), sum(e.bytes_recv for e in inside)))
        assert measured == expected, name


# ----------------------------------------------------------------------------------
# The all-to-all with split sizes that differ per rank (chapter 8's mixture of experts).


def _uneven_sizes(p, seed):
    """sizes[i][j] = rows rank i sends rank j: random 0..3, so some pieces are empty."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (p, p), generator=g).tolist()


def _uneven_vs_torch():
    rank, p = dist.get_rank(), dist.get_world_size()
    out = []
    for seed, dtype, row in ((1, torch.float32, (3,)), (2, torch.float64, (2, 2)), (3, torch.int64, ())):
        sizes = _uneven_sizes(p, seed)
        sends, expects = sizes[rank], [sizes[i][rank] for i in range(p)]
        x = (torch.arange(sum(sends) * math.prod(row)) + 1000 * rank).to(dtype).view(sum(sends), *row)
        ours, ref = x.new_empty((sum(expects), *row)), x.new_empty((sum(expects), *row))
        with trace.span("case", label="a2a"):
            C.all_to_all_single(ours, x, expects, sends)
        dist.all_to_all_single(ref, x, expects, sends)
        out.append((sizes, ours, ref))
    return out


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_uneven_all_to_all_equals_torch_with_the_rows_it_sends(p):
    res = pplab.launch(_uneven_vs_torch, world_size=p, timeout=60)
    for rank, cases in enumerate(res):
        for sizes, ours, ref in cases:
            assert torch.equal(ours, ref), (rank, sizes)
    if p > 1:                                                   # the seeds give empty pieces between ranks
        assert any(sizes[i][j] == 0 for sizes, _, _ in res[0] for i in range(p) for j in range(p) if i != j)
    measured = _measured(res.timeline)
    for (rank, i), (label, meta, sent, sends, peers, got, recvs, crossed) in measured.items():
        sizes, ours, _ = res[rank][i]
        row_bytes = ours[:1].numel() * ours.element_size() if len(ours) else None
        if row_bytes is None:
            continue
        off_rank = [j for j in range(p) if j != rank]
        assert sent == sum(sizes[rank][j] for j in off_rank) * row_bytes            # only rows it does not keep
        assert sends == sum(1 for j in off_rank if sizes[rank][j])                  # empty pieces are not sent
        assert got == sum(sizes[j][rank] for j in off_rank) * row_bytes


def test_uneven_all_to_all_refuses_sizes_that_do_not_match():
    def f():
        rank, errors = dist.get_rank(), {}
        x = torch.ones(3, 2)
        cases = {"mismatch": lambda: C.all_to_all_single(torch.empty(3, 2), x, [1, 2, 0], [1, 1, 1]),
                 "sum": lambda: C.all_to_all_single(torch.empty(3, 2), x, [1, 1, 1], [1, 1, 2 if rank == 1 else 1]),
                 "row shape": lambda: C.all_to_all_single(torch.empty(3, 2 + (rank == 2)), torch.ones(3, 2 + (rank == 2)),
                                                          [1, 1, 1], [1, 1, 1])}
        for name, call in cases.items():
            try:
                call()
                errors[name] = None
            except ValueError as exc:
                errors[name] = str(exc)
        y = torch.empty(3, 2)
        C.all_to_all_single(y, x * rank, [1, 1, 1], [1, 1, 1])       # still in step afterwards
        return errors, y[:, 0].tolist()

    for rank, (errors, y) in enumerate(pplab.launch(f, world_size=3, timeout=30)):
        assert y == [0.0, 1.0, 2.0]
        assert "rank 1 sends 1 rows to rank 0, which expects 2" in errors["mismatch"]
        assert "exchange the counts first" in errors["mismatch"]
        assert "rank 1: input_split_sizes=[1, 1, 2] must be 3 numbers" in errors["sum"]
        assert "adding up to input's 3 rows" in errors["sum"]
        assert "disagree" in errors["row shape"] and "float32[0, 3]" in errors["row shape"]


def _all_to_all_by_hand():
    """Rank r's piece for rank j holds 100·r + j: equal pieces (2 elements each), then rows of
    2 elements in the per-pair sizes of _rows (some empty)."""
    r, p = dist.get_rank(), dist.get_world_size()
    x = torch.tensor([100.0 * r + j for j in range(p) for _ in range(2)])
    equal = torch.empty_like(x)
    C.all_to_all_single(equal, x)
    rows = _rows(p)
    x = torch.cat([torch.full((rows[r][j], 2), 100.0 * r + j) for j in range(p)])
    uneven = x.new_empty((sum(rows[i][r] for i in range(p)), 2))
    C.all_to_all_single(uneven, x, [rows[i][r] for i in range(p)], rows[r])
    return equal.tolist(), uneven.tolist()


@pytest.mark.parametrize("p", [3, 4])
def test_all_to_all_on_real_ranks_by_hand(p):
    rows = _rows(p)
    for r, (equal, uneven) in enumerate(pplab.launch(_all_to_all_by_hand, world_size=p, timeout=30)):
        assert equal == [100.0 * i + r for i in range(p) for _ in range(2)], r
        assert uneven == [[100.0 * i + r] * 2 for i in range(p) for _ in range(rows[i][r])], r


# Last in the file: a wrong peer or a lost message makes this whole-collective run hang until its
# timeout, while the by-hand tests at the top (each rank a thread, every receive bounded) fail
# by assertion in seconds.
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_equal_to_torch_with_exact_bytes(p):
    res = pplab.launch(_compare_with_torch, world_size=p, timeout=120)   # a hang fails, slowly
    for rank, (checked, failures) in enumerate(res):
        assert failures == []
        # per case: 5 all-reduces + 7 other collectives (+ gather, compared on its root); + 5 textbook
        roots = sum(1 for i in range(6) if rank == (i + p - 1) % p)
        assert checked == 6 * 12 + roots + 5
    measured = _check_bytes(res.timeline)
    assert len(measured) == p * (6 * 13 + 5)              # every call of ours (13 a case), every rank

    # The textbook figures, for the 1680-element float32 tensor (N = 6720 bytes).
    N = 1680 * 4
    text = {(r, m["algorithm"]): (sent, sends) for (r, _), (label, m, sent, sends, *_) in measured.items()
            if label == "textbook"}
    for r in range(p):
        assert text[r, "ring"] == (2 * (p - 1) * N // p, 2 * (p - 1))          # 2(p-1)/p·N, 2(p-1) α
        if p & (p - 1) == 0:
            assert text[r, "recursive_doubling"] == (int(math.log2(p)) * N, int(math.log2(p)))
            assert text[r, "halving_doubling"] == (2 * (p - 1) * N // p, 2 * int(math.log2(p)))
    into_server, out_of_server = sum(text[r, "naive"][0] for r in range(1, p)), text[0, "naive"][0]
    assert into_server + out_of_server == 2 * (p - 1) * N  # the parameter server's link carries it all
