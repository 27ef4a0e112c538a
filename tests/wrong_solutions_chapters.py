"""Plausible wrong answers to the exercises of chapters 1, 2 and 4, each a mistake a
student could make.

WRONG[exercise_id] lists (function, regular expressions the check's message must match,
timeout for the check or None for the default), as in wrong_solutions_ch00_broadcast.py:
tests/test_checks_chapters.py checks that every one of them fails with that message.
"""
import torch
import torch.distributed as dist

import pplab
from pplab import comm, costmodel

# ----------------------------------------------------------------------------------
# Chapter 1: ring all-reduce, reduce-scatter, the α-β model


def _ring():
    rank, p = comm.rank(), comm.world_size()
    return rank, p, (rank + 1) % p, (rank - 1) % p


def all_reduce_through_rank_zero(tensor):
    """Every rank sends to rank 0, which adds them up and sends the sum back: right values,
    but a parameter server, not a ring."""
    rank, p = comm.rank(), comm.world_size()
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for r in range(1, p):
            comm.recv(incoming, r)
            tensor += incoming
        for r in range(1, p):
            comm.send(tensor, r)
    else:
        comm.send(tensor, 0)
        comm.recv(tensor, 0)


def all_reduce_passes_whole_tensor(tensor):
    """A ring that passes every rank's whole tensor along: right values, (p-1)·N bytes per
    rank instead of 2(p-1)/p·N."""
    rank, p, right, left = _ring()
    outgoing, incoming, total = tensor.clone(), torch.empty_like(tensor), tensor.clone()
    for _ in range(p - 1):
        comm.exchange(outgoing, right, incoming, left)
        total += incoming
        outgoing, incoming = incoming, outgoing
    tensor.copy_(total)


def all_reduce_off_by_one(tensor):
    """The reduce-scatter leaves chunk r+1 complete on rank r, but the all-gather starts
    from chunk r as if it were."""
    rank, p, right, left = _ring()
    chunks = tensor.view(-1).tensor_split(p)
    for s in range(p - 1):
        send, add = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
        incoming = torch.empty_like(add)
        comm.exchange(send, right, incoming, left)
        add.add_(incoming)
    for s in range(p - 1):
        comm.exchange(chunks[(rank - s) % p], right, chunks[(rank - s - 1) % p], left)


def all_reduce_forgets_all_gather(tensor):
    """Only the reduce-scatter: each rank ends with one complete chunk."""
    rank, p, right, left = _ring()
    chunks = tensor.view(-1).tensor_split(p)
    for s in range(p - 1):
        send, add = chunks[(rank - s - 1) % p], chunks[(rank - s - 2) % p]
        incoming = torch.empty_like(add)
        comm.exchange(send, right, incoming, left)
        add.add_(incoming)


def all_reduce_last_rank_skips_final_step(tensor):
    """A right ring, except that rank p-1 drops what the last all-gather step brings it (it
    receives into a scratch buffer): right on rank 0, one chunk wrong on rank p-1."""
    rank, p, right, left = _ring()
    chunks = tensor.view(-1).tensor_split(p)
    for s in range(p - 1):
        send, add = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
        incoming = torch.empty_like(add)
        comm.exchange(send, right, incoming, left)
        add.add_(incoming)
    for s in range(p - 1):
        into = chunks[(rank - s) % p]
        if rank == p - 1 and s == p - 2:
            into = torch.empty_like(into)
        comm.exchange(chunks[(rank - s + 1) % p], right, into, left)


def all_reduce_with_library(tensor):
    dist.all_reduce(tensor)


def all_reduce_sends_half_precision(tensor):
    """A right ring that sends float chunks as float16 to halve the bytes: every partial sum
    is rounded to 11 bits on the way, a relative error near 1e-3, not float32's 1e-7."""
    rank, p, right, left = _ring()
    chunks = tensor.view(-1).tensor_split(p)
    wire = torch.float16 if tensor.is_floating_point() else tensor.dtype
    for s in range(p - 1):
        send, add = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
        incoming = torch.empty_like(add, dtype=wire)
        comm.exchange(send.to(wire), right, incoming, left)
        add.add_(incoming.to(add.dtype))
    for s in range(p - 1):
        incoming = torch.empty_like(chunks[(rank - s) % p], dtype=wire)
        comm.exchange(chunks[(rank - s + 1) % p].to(wire), right, incoming, left)
        chunks[(rank - s) % p].copy_(incoming)


def all_reduce_with_chunk(tensor):
    """A right ring over tensor.chunk(p), which gives fewer than p chunks when the tensor has
    fewer than p elements (chunk(3) of 2 elements: 2 chunks of 1): an index past the end."""
    rank, p, right, left = _ring()
    chunks = tensor.view(-1).chunk(p)
    for s in range(p - 1):
        send, add = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
        incoming = torch.empty_like(add)
        comm.exchange(send, right, incoming, left)
        add.add_(incoming)
    for s in range(p - 1):
        comm.exchange(chunks[(rank - s + 1) % p], right, chunks[(rank - s) % p], left)


def reduce_scatter_bitmask_ring(output, input):
    """A right ring whose neighbours wrap with & (p - 1), the modulo of a power-of-two
    (halving-doubling) code: right on 2 and 4 ranks; on 3, (0 + 1) & 2 = 0 makes rank 0 its own
    right neighbour."""
    rank, p = comm.rank(), comm.world_size()
    right, left = (rank + 1) & (p - 1), (rank - 1) & (p - 1)
    chunks = input.clone().view(-1).split(output.numel())
    for s in range(p - 1):
        send, add = chunks[(rank - s - 1) % p], chunks[(rank - s - 2) % p]
        incoming = torch.empty_like(add)
        comm.exchange(send, right, incoming, left)
        add.add_(incoming)
    output.copy_(chunks[rank])


def reduce_scatter_ends_with_next_chunk(output, input):
    """Indices one step off: rank r ends with chunk r+1 complete, and returns that."""
    rank, p, right, left = _ring()
    chunks = input.clone().view(-1).split(output.numel())
    incoming = torch.empty_like(chunks[0])
    for s in range(p - 1):
        comm.exchange(chunks[(rank - s) % p], right, incoming, left)
        chunks[(rank - s - 1) % p].add_(incoming)
    output.copy_(chunks[(rank + 1) % p])


def reduce_scatter_copies_instead_of_adding(output, input):
    """Passes the chunks round the ring but overwrites instead of adding: no reduction."""
    rank, p, right, left = _ring()
    chunks = input.clone().view(-1).split(output.numel())
    incoming = torch.empty_like(chunks[0])
    for s in range(p - 1):
        comm.exchange(chunks[(rank - s - 1) % p], right, incoming, left)
        chunks[(rank - s - 2) % p].copy_(incoming)
    output.copy_(chunks[rank])


def reduce_scatter_direct(output, input):
    """Every rank sends chunk j straight to rank j: a right answer, but not a ring."""
    rank, p = comm.rank(), comm.world_size()
    chunks = input.view(-1).split(output.numel())
    handles = [comm.isend(chunks[j], j) for j in range(p) if j != rank]
    output.copy_(chunks[rank])
    incoming = torch.empty_like(output)
    for j in range(p):
        if j != rank:
            comm.recv(incoming, j)
            output += incoming
    for h in handles:
        h.wait()


def reduce_scatter_in_input(output, input):
    """The right ring, but the partial sums are added up in `input` itself."""
    rank, p, right, left = _ring()
    chunks = input.view(-1).split(output.numel())
    incoming = torch.empty_like(chunks[0])
    for s in range(p - 1):
        comm.exchange(chunks[(rank - s - 1) % p], right, incoming, left)
        chunks[(rank - s - 2) % p].add_(incoming)
    output.copy_(chunks[rank])


def reduce_scatter_last_rank_keeps_own_chunk(output, input):
    """A right ring, but rank p-1 copies its own chunk into output instead of the sum."""
    rank, p, right, left = _ring()
    chunks = input.clone().view(-1).split(output.numel())
    incoming = torch.empty_like(chunks[0])
    for s in range(p - 1):
        comm.exchange(chunks[(rank - s - 1) % p], right, incoming, left)
        chunks[(rank - s - 2) % p].add_(incoming)
    output.copy_(input.view(-1).split(output.numel())[rank] if rank == p - 1 else chunks[rank])


def _quick(tries):
    return sorted(tries)[(len(tries) - 1) // 4]


def _relative_fit(sizes, times):
    """α, β of the line α + nβ that minimises the relative error (weights 1/t²), as the solution."""
    w = [1 / t ** 2 for t in times]
    sw, sn, st = sum(w), sum(a * n for a, n in zip(w, sizes)), sum(a * t for a, t in zip(w, times))
    snn, snt = sum(a * n * n for a, n in zip(w, sizes)), sum(a * n * t for a, n, t in zip(w, sizes, times))
    det = sw * snn - sn * sn
    return (st * snn - sn * snt) / det, (sw * snt - sn * st) / det


def _fit(timings):
    sizes = sorted(timings)
    return _relative_fit(sizes, [_quick(timings[n]) for n in sizes])


def predict_forgets_factor_two(timings, p, n_bytes):
    alpha, beta = _fit(timings)
    return alpha, beta, (p - 1) * (alpha + n_bytes / p * beta)


def predict_p_instead_of_p_minus_one(timings, p, n_bytes):
    alpha, beta = _fit(timings)
    return alpha, beta, 2 * p * (alpha + n_bytes / p * beta)


def predict_whole_tensor_each_step(timings, p, n_bytes):
    alpha, beta = _fit(timings)
    return alpha, beta, 2 * (p - 1) * (alpha + n_bytes * beta)


def predict_returns_only_seconds(timings, p, n_bytes):
    alpha, beta = _fit(timings)
    return 2 * (p - 1) * (alpha + n_bytes / p * beta)


def _and_ring_time(alpha, beta, p, n_bytes):
    return alpha, beta, 2 * (p - 1) * (alpha + n_bytes / p * beta)


def predict_fits_the_means(timings, p, n_bytes):
    """The mean of each size's tries: a few held-up tries drag it far up for small messages."""
    sizes = sorted(timings)
    return _and_ring_time(*_relative_fit(sizes, [sum(timings[n]) / len(timings[n]) for n in sizes]), p, n_bytes)


def _least_squares(xs, ys):
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - beta * mx, beta


def predict_fits_every_try(timings, p, n_bytes):
    """numpy.polyfit through every try, held-up ones too."""
    import numpy as np
    xs = [n for n in timings for _ in timings[n]]
    ys = [t for n in timings for t in timings[n]]
    beta, alpha = np.polyfit(xs, ys, 1)
    return _and_ring_time(alpha, beta, p, n_bytes)


def predict_ordinary_least_squares(timings, p, n_bytes):
    """Medians, then a plain least-squares line: the largest messages' jitter decides α."""
    import statistics
    sizes = sorted(timings)
    return _and_ring_time(*_least_squares(sizes, [statistics.median(timings[n]) for n in sizes]), p, n_bytes)


def predict_line_through_origin(timings, p, n_bytes):
    """t = nβ: no latency term."""
    sizes = sorted(timings)
    times = [_quick(timings[n]) for n in sizes]
    return _and_ring_time(0.0, sum(n * t for n, t in zip(sizes, times)) / sum(n * n for n in sizes), p, n_bytes)


def predict_swaps_alpha_beta(timings, p, n_bytes):
    alpha, beta = _fit(timings)
    return beta, alpha, 2 * (p - 1) * (alpha + n_bytes / p * beta)


def predict_doubles_the_one_way_times(timings, p, n_bytes):
    """Takes the one-way times for halves of a round trip and doubles them."""
    alpha, beta = _fit(timings)
    return _and_ring_time(2 * alpha, 2 * beta, p, n_bytes)


def predict_with_costmodel(timings, p, n_bytes):
    alpha, beta = _fit(timings)
    return alpha, beta, costmodel.predict("all_reduce", "ring", p, n_bytes, alpha, beta)


def predict_with_costfit(timings, p, n_bytes):
    from pplab import costfit
    sizes = sorted(timings)
    alpha, beta = costfit.fit_line(sizes, [_quick(timings[n]) for n in sizes])
    return _and_ring_time(alpha, beta, p, n_bytes)


# ----------------------------------------------------------------------------------
# Chapter 2: DDP's buckets and hooks, top-k with error feedback


def _buckets(params, cap_bytes, reverse=True):
    buckets, size = [], 0
    for p in (reversed(list(params)) if reverse else list(params)):
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


def _ddp(model, buckets, divide=True, async_op=True, in_hooks=True, reset=True, dtype=None):
    """A DDP core over the given buckets; the flags turn one of its parts off (dtype: the buffers')."""
    world = comm.world_size()
    bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b}
    missing, in_flight = [len(b) for b in buckets], []

    def launch(i):
        buffer = torch.cat([p.grad.reshape(-1) for p in buckets[i]]).to(dtype or buckets[i][0].grad.dtype)
        in_flight.append((buffer, comm.all_reduce(buffer, async_op=async_op)))

    def hook(param):
        missing[bucket_of[id(param)]] -= 1
        while len(in_flight) < len(buckets) and missing[len(in_flight)] == 0:
            launch(len(in_flight))

    if in_hooks:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)

    def finish():
        if not in_hooks:
            for i in range(len(buckets)):
                launch(i)
        for (buffer, handle), bucket in zip(in_flight, buckets):
            if handle is not None:
                handle.wait()
            if divide:
                buffer /= world if divide is True else divide
            for p, piece in zip(bucket, buffer.split([p.numel() for p in bucket])):
                p.grad.copy_(piece.view_as(p.grad))
        in_flight.clear()
        if reset:
            missing[:] = [len(b) for b in buckets]
    return buckets, finish


def ddp_buckets_in_forward_order(model, cap_bytes):
    return _ddp(model, _buckets(model.parameters(), cap_bytes, reverse=False))


def ddp_forgets_to_divide(model, cap_bytes):
    return _ddp(model, _buckets(model.parameters(), cap_bytes), divide=False)


def ddp_all_reduces_after_backward(model, cap_bytes):
    """No hooks: every bucket is all-reduced in finish(), after backward."""
    return _ddp(model, _buckets(model.parameters(), cap_bytes), in_hooks=False)


def ddp_blocking_all_reduce(model, cap_bytes):
    return _ddp(model, _buckets(model.parameters(), cap_bytes), async_op=False)


def ddp_cap_checked_too_late(model, cap_bytes):
    """Adds the parameter first and starts a new bucket only once the cap is passed."""
    buckets, size = [[]], 0
    for p in reversed(list(model.parameters())):
        if size > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    return _ddp(model, buckets)


def ddp_one_all_reduce_per_parameter(model, cap_bytes):
    """Returns the right buckets but all-reduces each parameter on its own."""
    buckets = _buckets(model.parameters(), cap_bytes)
    _, finish = _ddp(model, [[p] for b in buckets for p in b])
    return buckets, finish


def ddp_divides_by_two(model, cap_bytes):
    """Divides by 2, the world size of the chapter's example, not by comm.world_size()."""
    return _ddp(model, _buckets(model.parameters(), cap_bytes), divide=2)


def ddp_all_reduces_in_bfloat16(model, cap_bytes):
    """Halves the traffic by all-reducing each bucket as bfloat16: every gradient comes back rounded."""
    return _ddp(model, _buckets(model.parameters(), cap_bytes), dtype=torch.bfloat16)


def ddp_never_resets_the_countdown(model, cap_bytes):
    """Right on the first step; finish() never refills each bucket's count of missing gradients,
    so on the next step no count reaches 0 and no bucket is all-reduced."""
    return _ddp(model, _buckets(model.parameters(), cap_bytes), reset=False)


def ddp_averages_only_on_rank_zero(model, cap_bytes):
    """Right buckets and hooks, but only rank 0 divides by the world size."""
    buckets, finish = _ddp(model, _buckets(model.parameters(), cap_bytes), divide=comm.rank() == 0)
    return buckets, finish


def topk_forgets_memory_when_sending_all(grad, memory, k):
    """Right for k < d; when k = d (everything is sent) it keeps grad + memory as the memory."""
    a = grad + memory
    indices = a.abs().topk(k).indices
    new_memory = a.clone()
    if k < grad.numel():
        new_memory[indices] = 0
    return a[indices], indices, new_memory


def topk_by_value(grad, memory, k):
    a = grad + memory
    indices = a.topk(k).indices
    new_memory = a.clone()
    new_memory[indices] = 0
    return a[indices], indices, new_memory


def topk_selects_before_adding_memory(grad, memory, k):
    indices = grad.abs().topk(k).indices
    a = grad + memory
    new_memory = a.clone()
    new_memory[indices] = 0
    return a[indices], indices, new_memory


def topk_without_memory(grad, memory, k):
    """Plain top-k: what is not sent is dropped."""
    a = grad + memory
    indices = a.abs().topk(k).indices
    return a[indices], indices, torch.zeros_like(grad)


def topk_memory_forgets_backlog(grad, memory, k):
    """Keeps only this step's leftovers: new_memory = grad - sent, not grad + memory - sent."""
    a = grad + memory
    indices = a.abs().topk(k).indices
    new_memory = grad.clone()
    new_memory[indices] = 0
    return a[indices], indices, new_memory


def topk_sends_grad_values(grad, memory, k):
    a = grad + memory
    indices = a.abs().topk(k).indices
    new_memory = a.clone()
    new_memory[indices] = 0
    return grad[indices], indices, new_memory


# ----------------------------------------------------------------------------------
# Chapter 4: pipeline schedules and the bubble


def _gpipe(p, m, v):
    """Right: per rank, ("F", i, chunk) through chunk 0, 1, ..., then ("B", i, chunk), chunks in reverse."""
    return [[("F", i, c) for c in range(v) for i in range(m)] + [("B", i, c) for c in reversed(range(v))
                                                                  for i in range(m)] for _ in range(p)]


def gpipe_backwards_first(num_ranks, num_microbatches, chunks):
    """Backwards listed before forwards: rank 0 waits for its own forward, forever."""
    return [row[len(row) // 2:] + row[:len(row) // 2] for row in _gpipe(num_ranks, num_microbatches, chunks)]


def gpipe_missing_last_microbatch(num_ranks, num_microbatches, chunks):
    return [[a for a in row if a[1] < num_microbatches - 1] for row in _gpipe(num_ranks, num_microbatches, chunks)]


def gpipe_everything_on_stage_zero(num_ranks, num_microbatches, chunks):
    """pplab.pipeline.Action with stage 0 on every rank: stage r lives on rank r."""
    from pplab.pipeline import Action    # here, not at the top: pplab.pipeline is slow to import

    m = num_microbatches
    return [[Action("F", i, 0) for i in range(m)] + [Action("B", i, 0) for i in range(m)]
            for _ in range(num_ranks)]


def gpipe_last_rank_backwards_reversed(num_ranks, num_microbatches, chunks):
    """The last rank runs its backwards newest first, the others oldest first: valid, slower."""
    m = num_microbatches
    order = [[f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)] for _ in range(num_ranks)]
    order[-1] = [f"F{i}" for i in range(m)] + [f"B{i}" for i in reversed(range(m))]
    return order


def gpipe_drops_last_when_few_microbatches(num_ranks, num_microbatches, chunks):
    """Right when m >= p; with fewer micro-batches than stages it forgets the last one."""
    m = num_microbatches - (num_microbatches < num_ranks)
    return _gpipe(num_ranks, m, chunks)


def gpipe_as_1f1b(num_ranks, num_microbatches, chunks):
    return _one_f_one_b(num_ranks, num_microbatches, lambda p, r: p - 1 - r)


def gpipe_ignores_chunks(num_ranks, num_microbatches, chunks):
    return _gpipe(num_ranks, num_microbatches, 1)


def gpipe_looped_depth_first(num_ranks, num_microbatches, chunks):
    """Each micro-batch through all of the rank's chunks before the next one starts."""
    p, m, v = num_ranks, num_microbatches, chunks
    return [[("F", i, c) for i in range(m) for c in range(v)] + [("B", i, c) for c in reversed(range(v))
                                                                  for i in range(m)] for _ in range(p)]


def gpipe_looped_consecutive_stages(num_ranks, num_microbatches, chunks):
    """Rank r holds stages r·v .. r·v + v - 1: a micro-batch crosses all of them before rank r + 1 starts."""
    from pplab.pipeline import Action, Schedule

    p, m, v = num_ranks, num_microbatches, chunks
    actions = [[Action(kind, i, r * v + c, c) for kind, i, c in row] for r, row in enumerate(_gpipe(p, m, v))]
    return Schedule("gpipe", p, m, v, actions, [s // v for s in range(p * v)])


def gpipe_looped_backwards_in_chunk_order(num_ranks, num_microbatches, chunks):
    """Backwards through chunk 0 first: its gradient comes from the last stage, through chunk 1."""
    p, m, v = num_ranks, num_microbatches, chunks
    return [[("F", i, c) for c in range(v) for i in range(m)] + [("B", i, c) for c in range(v) for i in range(m)]
            for _ in range(p)]


def gpipe_schedule_with_one_chunk(num_ranks, num_microbatches, chunks):
    """A Schedule built with chunks=1 whatever it was asked."""
    from pplab.pipeline import Action, Schedule

    actions = [[Action(kind, i, r) for kind, i, _ in row] for r, row in enumerate(_gpipe(num_ranks, num_microbatches, 1))]
    return Schedule("gpipe", num_ranks, num_microbatches, 1, actions, list(range(num_ranks)))


def gpipe_from_the_library(num_ranks, num_microbatches, chunks):
    return pplab.pipeline.make_schedule("gpipe", num_ranks, num_microbatches)


def _one_f_one_b(p, m, warmup):
    order = []
    for r in range(p):
        w = min(warmup(p, r), m)
        acts = [("F", i) for i in range(w)]
        for i in range(m - w):
            acts += [("F", w + i), ("B", i)]
        order.append(acts + [("B", i) for i in range(m - w, m)])
    return order


def one_f_one_b_as_gpipe(num_stages, num_microbatches):
    m = num_microbatches
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(num_stages)]


def one_f_one_b_warmup_one_too_many(num_stages, num_microbatches):
    return _one_f_one_b(num_stages, num_microbatches, lambda p, r: p - r)


def one_f_one_b_warmup_one_too_few(num_stages, num_microbatches):
    return _one_f_one_b(num_stages, num_microbatches, lambda p, r: max(p - 2 - r, 0))


def one_f_one_b_warmup_ignores_m(num_stages, num_microbatches):
    """Warm-up of p-1-r forwards even when there are fewer micro-batches than that."""
    p, m = num_stages, num_microbatches
    order = []
    for r in range(p):
        acts = [("F", i) for i in range(p - 1 - r)]
        for i in range(m - (p - 1 - r)):
            acts += [("F", p - 1 - r + i), ("B", i)]
        order.append(acts + [("B", i) for i in range(max(m - (p - 1 - r), 0), m)])
    return order


def one_f_one_b_last_rank_warms_up(num_stages, num_microbatches):
    """Right on every rank but the last, which runs one forward ahead (it needs none)."""
    return _one_f_one_b(num_stages, num_microbatches, lambda p, r: p - 1 - r if r < p - 1 else 1)


def _bubble_report(p, begin, end, busy, first, last, overall=None):
    """The answer's dict from the step [begin, end] and each rank's busy time and first/last action."""
    idle = [(end - begin) - b for b in busy]
    per = [i / b for i, b in zip(idle, busy)]
    where = [(first[r] - begin, idle[r] - (first[r] - begin) - (end - last[r]), end - last[r]) for r in range(p)]
    return {"per_rank": per, "overall": sum(idle) / sum(busy) if overall is None else overall, "idle": where}


def _bubble_spans(timeline, keep=lambda e: e.category == "compute"):
    """(p, begin, end, busy, first, last) over the events `keep` accepts."""
    spans = [e for e in timeline.events if keep(e)]
    p = timeline.world_size
    begin, end = min(e.start for e in spans), max(e.end for e in spans)
    busy = [sum(e.end - e.start for e in spans if e.rank == r) for r in range(p)]
    first = [min(e.start for e in spans if e.rank == r) for r in range(p)]
    last = [max(e.end for e in spans if e.rank == r) for r in range(p)]
    return p, begin, end, busy, first, last


def bubble_from_the_formula(timeline):
    """(p-1)/m on every rank, m counted from rank 0's forwards: right only for even stages."""
    p = timeline.world_size
    m = sum(1 for e in timeline.events if e.rank == 0 and e.kind == "F")
    right = _bubble_report(*_bubble_spans(timeline))
    return {**right, "per_rank": [(p - 1) / m] * p, "overall": (p - 1) / m}


def bubble_own_window(timeline):
    """Each rank's idle time between its own first and last action: the fill and drain go missing."""
    p, begin, end, busy, first, last = _bubble_spans(timeline)
    right = _bubble_report(p, begin, end, busy, first, last)
    return {**right, "per_rank": [(last[r] - first[r] - busy[r]) / busy[r] for r in range(p)]}


def bubble_counts_recv_as_busy(timeline):
    """Every event but memory counted as busy: a rank blocked in recv looks busy."""
    return _bubble_report(*_bubble_spans(timeline, lambda e: e.category != "memory"))


def bubble_from_time_zero(timeline):
    p, begin, end, busy, first, last = _bubble_spans(timeline)
    return _bubble_report(p, 0.0, end, busy, first, last)


def bubble_idle_over_total(timeline):
    p, begin, end, busy, first, last = _bubble_spans(timeline)
    right = _bubble_report(p, begin, end, busy, first, last)
    idle = [(end - begin) - b for b in busy]
    return {**right, "per_rank": [i / (end - begin) for i in idle], "overall": sum(idle) / (p * (end - begin))}


def bubble_only_forward_and_backward(timeline):
    """F and B counted, the I and W of a zero-bubble schedule left out."""
    p, begin, end, busy, first, last = _bubble_spans(timeline)
    fb = _bubble_spans(timeline, lambda e: e.category == "compute" and e.kind in ("F", "B"))[3]
    return _bubble_report(p, begin, end, fb, first, last)


def bubble_mean_of_ranks(timeline):
    right = _bubble_report(*_bubble_spans(timeline))
    return {**right, "overall": sum(right["per_rank"]) / len(right["per_rank"])}


def bubble_skips_last_rank(timeline):
    right = _bubble_report(*_bubble_spans(timeline))
    return {**right, "per_rank": right["per_rank"][:-1]}


def bubble_fill_from_time_zero(timeline):
    """The fill measured from time 0 instead of from the step's first action."""
    right = _bubble_report(*_bubble_spans(timeline))
    p, begin, end, busy, first, last = _bubble_spans(timeline)
    return {**right, "idle": [(first[r], b, a) for r, (_, b, a) in enumerate(right["idle"])]}


def bubble_returns_the_fraction_only(timeline):
    return _bubble_report(*_bubble_spans(timeline))["overall"]


def bubble_with_timeline_busy(timeline):
    p, begin, end, busy, first, last = _bubble_spans(timeline)
    return _bubble_report(p, begin, end, [timeline.busy(r) for r in range(p)], first, last)


AR_TRIAL = r"^world_size=\d, dtype=(float32|int64), shape=\([\d, ]*\): "
RS_TRIAL = r"^world_size=\d, dtype=(float32|int64), elements per rank=\d+: "
TIMINGS = r"^timings \d \(\d sizes, [\d,]+ to [\d,]+ bytes, \d+ tries each\), "
FIT = TIMINGS + r"you fitted α = [\d.e+-]+ µs and β = [\d.e+-]+ s/B, the timings were drawn from "
PREDICTION = TIMINGS + r"p=\d+, n_bytes=[\d,]+: you predict [\d.e+-]+ s, but your own α and β give "
DDP_TRIAL = r"^world_size=[23], MLP widths \[[\d, ]+\], cap_bytes=\d+: "
PIPE = r"^p=\d stages, m=\d+ micro-batch(es)?: "
GPIPE = r"^p=\d stages, m=\d+ micro-batch(es)?, "
LOOPED = r"^p=\d stages, m=\d+ micro-batch(es)?, v=[23] chunks per rank, "
TRACE = r"^(gpipe|1f1b|interleaved-1f1b|zb-h1) trace, p=\d, m=\d+(, v=2)?(, [\d.]+ ms between ranks)?, "
TOPK = r"^d=\d+, k=\d+, step \d of a run that starts from memory = 0: "
WRONG = {
    "ring_all_reduce": [
        (all_reduce_through_rank_zero,
         [r"^world_size=[34], ", r"rank \d sent to ranks? [\d, ]+: in a ring each rank sends only to its right "
          r"neighbour, \(rank \+ 1\) % p = \d", "parameter server"], None),
        (all_reduce_passes_whole_tensor,
         [r"^world_size=[34], ", r"rank \d sent [\d,]+ bytes for a tensor of [\d,]+ bytes, more than the [\d,]+ bytes "
          r"of a ring all-reduce", r"send one chunk per step, not the whole tensor"], None),
        (all_reduce_off_by_one,
         [AR_TRIAL, r"rank \d's result differs from the sum over all ranks at index [\d(]"], None),
        (all_reduce_forgets_all_gather,
         [AR_TRIAL, r"^world_size=2\b", r"rank \d's result differs from the sum over all ranks",
          r"Only chunk \d of tensor.tensor_split\(2\) is right: that is what a reduce-scatter leaves\. "
          r"The all-gather must then pass"], None),
        (all_reduce_last_rank_skips_final_step,
         [AR_TRIAL, r"rank [1-3]'s result differs from the sum over all ranks",
          r"(Chunk \d of tensor.tensor_split\([34]\) is wrong on this rank: every rank must take part in all \d "
          r"steps of the all-gather|Only chunk \d of tensor.tensor_split\(2\) is right)"], None),
        (all_reduce_with_library,
         [r"^exercise 'ring_all_reduce' asks you to build all_reduce from point-to-point sends",
          r"you called torch\.distributed\.all_reduce, the library collective it replaces\.$"], None),
        (all_reduce_sends_half_precision,
         [r"^world_size=\d, dtype=float32, shape=\([\d, ]*\): ", r"rank \d's result differs from the sum over all ranks"],
         None),
        (all_reduce_with_chunk, [r"^world_size=\d, dtype=(float32|int64), shape=\([12],\): ", r"raised IndexError"],
         None),
    ],
    "reduce_scatter": [
        (reduce_scatter_ends_with_next_chunk,
         [RS_TRIAL, r"rank \d's output differs from the sum over ranks of chunk \d",
          r"It holds the sum of chunk \d instead: rank r must end with chunk r"], None),
        (reduce_scatter_copies_instead_of_adding,
         [RS_TRIAL, r"It holds rank \d's chunk \d alone: add what each step receives"], None),
        (reduce_scatter_last_rank_keeps_own_chunk,
         [RS_TRIAL, r"rank [1-3]'s output differs from the sum over ranks of chunk [1-3]",
          r"It holds rank [1-3]'s chunk [1-3] alone"], None),
        (reduce_scatter_direct,
         [r"^world_size=[34], ", r"rank \d sent to ranks? [\d, ]+: in a ring each rank sends only to its right "
          r"neighbour"], None),
        (reduce_scatter_bitmask_ring,
         [r"^world_size=3, ", r"rank \d raised ValueError: (dst|src)=\d is this rank itself"], None),
        (reduce_scatter_in_input,
         [RS_TRIAL, r"rank \d's input changed at index \d+ \(got .*, expected .*\): like torch\.distributed\.reduce_scatter_tensor, leave "
          r"input as it was"], None),
    ],
    "predict_time": [
        (predict_forgets_factor_two, [PREDICTION, r"That is half the right time: a ring all-reduce is a reduce-scatter",
                                      r"Parts: fit ✔ · prediction ✘ \(1 of 2\)"], None),
        (predict_p_instead_of_p_minus_one, [PREDICTION, r"That is (p where p-1 belongs|2p·α)"], None),
        (predict_whole_tensor_each_step, [PREDICTION, r"That is (2\(p-1\)\(α \+ Nβ\)|2N·β)", r"one chunk of N/p bytes"],
         None),
        (predict_returns_only_seconds, [r"^predict_returns_only_seconds must return \(alpha, beta, seconds\): three "
                                        r"numbers"], None),
        (predict_fits_the_means, [FIT, r"That is the line through each size's \*mean\*", r"Take each size's median",
                                  r"Parts: fit ✘ · prediction ✔ \(1 of 2\)"], None),
        (predict_fits_every_try, [FIT, r"That is a least-squares line through every try, the held-up ones too"], None),
        (predict_ordinary_least_squares, [FIT, r"That is ordinary least squares through the medians: it weighs each "
                                               r"size by its absolute error"], None),
        (predict_line_through_origin, [FIT, r"α = 0 is a line through the origin"], None),
        (predict_swaps_alpha_beta, [FIT, r"You swapped them: return \(alpha, beta\)"], None),
        (predict_doubles_the_one_way_times, [FIT, r"That is twice both: the timings are already one way"], None),
        (predict_with_costmodel,
         [r"^exercise 'predict_time' asks you to work out the fit and the time yourself; you use pplab\.costmodel"],
         None),
        (predict_with_costfit, [r"^exercise 'predict_time' .* you use pplab\.costmodel or pplab\.costfit"], None),
    ],
    "ddp_buckets": [
        (ddp_buckets_in_forward_order,
         [DDP_TRIAL, r"bucket 0 starts with '0\.weight', but buckets follow the \*reverse\* of model\.parameters\(\), "
          r"starting with '4\.bias': backward produces the last layer's gradients first"], None),
        (ddp_forgets_to_divide,
         [DDP_TRIAL, r"step 0: rank \d's [\d.]+(weight|bias)\.grad differs from the single-process gradient",
          r"It is 2 times that: the all-reduce sums the ranks' gradients; divide by the world size\."], None),
        (ddp_all_reduces_after_backward,
         [DDP_TRIAL, r"step 0: bucket 0's all-reduce started only after loss\.backward\(\) returned: start it from a "
          r"post-accumulate-grad hook"], None),
        (ddp_blocking_all_reduce,
         [DDP_TRIAL, r"step 0: bucket 0's all-reduce was blocking, so backward stopped until it was done: pass "
          r"async_op=True"], None),
        (ddp_cap_checked_too_late,
         [DDP_TRIAL, r"with cap_bytes=\d+, bucket \d should hold \[.*\] \(\d+ bytes\), yours holds \[.*\] \(\d+ bytes\)",
          r"Add parameters to a bucket while its total stays <= cap_bytes"], None),
        (ddp_averages_only_on_rank_zero,
         [DDP_TRIAL, r"step 0: rank [12]'s [\d.]+(weight|bias)\.grad differs from the single-process gradient",
          r"It is [23] times that: the all-reduce sums the ranks' gradients; divide by the world size\."], None),
        (ddp_divides_by_two,
         [r"^world_size=3, ", r"step 0: rank \d's [\d.]+(weight|bias)\.grad differs from the single-process gradient"],
         None),
        (ddp_all_reduces_in_bfloat16,
         [DDP_TRIAL, r"step 0: expected \d all-reduce\(s\), one per bucket in bucket order, of \[[\d, ]+\] elements; "
          r"saw \d, of \[[\d, ]+\] elements", r"Each carried half the bytes of its bucket's float32 gradients"], None),
        (ddp_never_resets_the_countdown, [DDP_TRIAL, r"step 1: expected \d all-reduce\(s\), one per bucket .*; saw 0"],
         None),
        (ddp_one_all_reduce_per_parameter,
         [DDP_TRIAL, r"step 0: expected \d all-reduce\(s\), one per bucket in bucket order, of \[[\d, ]+\] elements; "
          r"saw 6, of \[[\d, ]+\] elements"], None),
    ],
    "topk_error_feedback": [
        (topk_forgets_memory_when_sending_all,
         [r"^d=(\d+), k=\1, step \d of a run that starts from memory = 0: what was sent so far \+ new_memory"],
         None),
        (topk_by_value, [TOPK, r"which is larger in magnitude", r"You picked the k largest \*values\*: pick by magnitude"],
         None),
        (topk_selects_before_adding_memory,
         [r"^d=\d+, k=\d+, step [1-4] of a run that starts from memory = 0: ",
          r"You picked the k largest entries of \|grad\| alone: add the memory first"], None),
        (topk_without_memory,
         [TOPK, r"what was sent so far \+ new_memory should equal the sum of the gradients so far",
          r"new_memory is all zeros: error feedback keeps what was not sent\."], None),
        (topk_memory_forgets_backlog,
         [r"^d=\d+, k=\d+, step [1-4] of a run that starts from memory = 0: what was sent so far \+ new_memory should equal",
          r"new_memory = \(grad \+ memory\) with the sent entries set to 0\."], None),
        (topk_sends_grad_values,
         [r"^d=\d+, k=\d+, step [1-4] ", r"values\[\d+\] is [-\d.e+]+ but the entry at indices\[\d+\] = \d+ of grad \+ "
          r"memory is [-\d.e+]+ \(that is grad alone: send grad \+ memory\)"], None),
    ],
    "gpipe_order": [
        (gpipe_backwards_first,
         [GPIPE, r"this schedule cannot run as a training step\. deadlock in 'gpipe_backwards_first'",
          r"rank 0 is stuck at step 0 \(B0 of stage 0\), waiting for F0 of stage 0, which it runs itself later"],
         None),
        (gpipe_missing_last_microbatch,
         [GPIPE, r"is not one full training step:\n  F\d+ of stage 0 appears 0 times, not once"], None),
        (gpipe_everything_on_stage_zero,
         [GPIPE, r"rank 1, step 0: F0 of stage 0 is on rank 1, but stage 0 lives on rank 0"], None),
        (gpipe_last_rank_backwards_reversed,
         [GPIPE, r"your schedule takes \d+ time units \(t_f = 1, t_b = 2, a chunk 1/v of them\), GPipe takes "
          r"\(m \+ p - 1\)\(t_f \+ t_b\) = \d+\. Rank \d sits idle for \d+ of them \(the reference: \d+\)"], None),
        (gpipe_drops_last_when_few_microbatches,
         [r"^p=(\d) stages, m=\d+ micro-batch(es)?, ", r"F\d+ of stage 0 appears 0 times, not once"], None),
        (gpipe_as_1f1b,
         [GPIPE, r"rank \d runs B0 before F\d+: GPipe runs every forward of the step before any backward"], None),
        (gpipe_ignores_chunks,
         [LOOPED, r"is not one full training step:\n  F0 of stage \d+ appears 0 times",
          r"Parts: GPipe ✔ · looped GPipe ✘ \(1 of 2\)"], None),
        (gpipe_looped_depth_first,
         [LOOPED, r"your schedule takes [\d.]+ time units", r"looped GPipe takes \(v·m \+ p - 1 \+ \(v-1\)·max\(0, p-m\)\)",
          r"Breadth first: all m micro-batches through chunk 0"], None),
        (gpipe_looped_consecutive_stages,
         [LOOPED, r"Rank 0 holds stages 0 to [12], one after another", r"stage = chunk·p \+ rank"], None),
        (gpipe_looped_backwards_in_chunk_order,
         [LOOPED, r"this schedule cannot run as a training step\. deadlock", r"waiting for B0 \(or I0\) of stage \d"],
         None),
        (gpipe_schedule_with_one_chunk,
         [LOOPED, r"your Schedule says num_ranks=\d, num_microbatches=\d+, chunks=1; it was asked for \d, \d+, [23]"],
         None),
        (gpipe_from_the_library,
         [r"^exercise 'gpipe_order' asks you to work out GPipe's order yourself; you use pplab\.pipeline's schedules"],
         None),
    ],
    "one_f_one_b_order": [
        (one_f_one_b_as_gpipe,
         [PIPE, r"rank \d holds \d+ micro-batches' activations at its peak, more than 1F1B's \d: rank \d runs "
          r"min\(p - 1 - r, m\) = \d forwards ahead \(the warm-up\)"], None),
        (one_f_one_b_last_rank_warms_up,
         [PIPE, r"rank [1-4] holds 2 micro-batches' activations at its peak, more than 1F1B's 1: rank [1-4] runs "
          r"min\(p - 1 - r, m\) = 0 forwards ahead"], None),
        (one_f_one_b_warmup_one_too_many, [PIPE, r"at its peak, more than 1F1B's \d"], None),
        (one_f_one_b_warmup_one_too_few,
         [PIPE, r"your schedule takes \d+ time units \(t_f = 1, t_b = 2\), 1F1B takes \(m \+ p - 1\)\(t_f \+ t_b\)"],
         None),
        (one_f_one_b_warmup_ignores_m,
         [r"^p=\d stages, m=[1-4] micro-batch(es)?: this schedule cannot run as a training step\. rank \d, step \d: "
          r"micro-batch \d out of range 0\.\.\d"], None),
    ],
    "bubble_fraction": [
        (bubble_from_the_formula, [TRACE, r"rank \d's bubble fraction is [\d.]+, the trace says [\d.]+\. That is the "
                                          r"formula \(p-1\)/\(v·m\)", r"Parts: per rank ✘ · overall ✘"], None),
        (bubble_own_window, [TRACE, r"That is each rank's idle time between its own first and last action only"],
         None),
        (bubble_counts_recv_as_busy, [TRACE, r"That is the recv events counted as busy"], None),
        (bubble_from_time_zero, [TRACE, r"That is a step that starts at time 0"], None),
        (bubble_idle_over_total, [TRACE, r"That is idle / total time; the bubble fraction here is idle / useful"],
         None),
        (bubble_only_forward_and_backward, [r"^zb-h1 trace, p=\d, m=\d+, ", r"That is only F and B counted as compute"],
         None),
        (bubble_mean_of_ranks, [TRACE, r"That is the mean of the ranks' fractions",
                                r"Parts: per rank ✔ · overall ✘ · fill and drain ✔ \(2 of 3\)"], None),
        (bubble_skips_last_rank, [TRACE, r"'per_rank' should hold one fraction per rank, \d of them"], None),
        (bubble_fill_from_time_zero, [TRACE, r"rank 0 idles [\d.]+ s before its first action \(the fill\), the trace "
                                             r"says 0 s", r"fill and drain ✘ \(2 of 3\)"], None),
        (bubble_returns_the_fraction_only, [r"^bubble_returns_the_fraction_only must return a dict with 'per_rank', "
                                            r"'overall' and 'idle'"], None),
        (bubble_with_timeline_busy, [r"^exercise 'bubble_fraction' asks you to work out the bubble yourself; you use "
                                     r"pplab's own measure"], None),
    ],
}
