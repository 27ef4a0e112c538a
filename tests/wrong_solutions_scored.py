"""Wrong or weaker answers to the exercises scored on how good the answer is, each with what
its message must say (and the points it earns, in the message's "[k of n points]").

zero_bubble: a schedule for p stages and m micro-batches with times t_f = t_i = t_w = 1.
"""


def _one_f_one_b(p, m, backward):
    """1F1B's order, `backward(i)` giving the actions that stand for micro-batch i's backward."""
    order = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        actions = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [("F", warmup + i), *backward(i)]
        for i in range(m - warmup, m):
            actions += backward(i)
        order.append(actions)
    return order


def _deferring(p, m, deferred):
    """ZB-H1's shape, rank r keeping `deferred(r)` weight gradients for the cool-down."""
    order = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        actions, done = [("F", i) for i in range(warmup)], 0
        for i in range(m):
            if warmup + i < m:
                actions.append(("F", warmup + i))
            actions.append(("I", i))
            if i >= deferred(r):
                actions.append(("W", done))
                done += 1
        order.append(actions + [("W", i) for i in range(done, m)])
    return order


def zb_plain_1f1b(num_stages, num_microbatches):
    """1F1B with fused backwards: as long as 1F1B, 1 point."""
    return _one_f_one_b(num_stages, num_microbatches, lambda i: [("B", i)])


def zb_split_but_not_deferred(num_stages, num_microbatches):
    """Each B split into I then W at once: a little shorter than 1F1B, not half its bubble."""
    return _one_f_one_b(num_stages, num_microbatches, lambda i: [("I", i), ("W", i)])


def zb_one_deferral_short(num_stages, num_microbatches):
    """Rank r keeps r - 1 weight gradients: within half of 1F1B's bubble, not at the bound."""
    return _deferring(num_stages, num_microbatches, lambda r: max(r - 1, 0))


def zb_gpipe(num_stages, num_microbatches):
    """Every forward first: holds m micro-batches."""
    m = num_microbatches
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(num_stages)]


def zb_all_weights_at_the_end(num_stages, num_microbatches):
    """Every W put off to the end: no bubble, but each rank holds every micro-batch."""
    return _deferring(num_stages, num_microbatches, lambda r: num_microbatches)


def zb_weight_before_input(num_stages, num_microbatches):
    """W of a micro-batch before its I: W needs I's output gradient."""
    order = _deferring(num_stages, num_microbatches, lambda r: r)
    for actions in order:
        k = actions.index(("I", 0))
        actions[k] = ("W", 0)
        actions[actions.index(("W", 0), k + 1)] = ("I", 0)
    return order


def zb_rank_2_forgets_a_weight(num_stages, num_microbatches):
    """Right on every rank but 2, which never computes its last micro-batch's W."""
    order = _deferring(num_stages, num_microbatches, lambda r: r)
    order[2].remove(("W", num_microbatches - 1))
    return order


def zb_with_the_library(num_stages, num_microbatches):
    import pplab.pipeline
    return pplab.pipeline.make_schedule("zb-h1", num_stages, num_microbatches).actions


WRONG = {
    "zero_bubble": [
        (zb_plain_1f1b, [r"against 1F1B's \d+", r"split each B into I", r"\[1 of 3 points\]$"], None),
        (zb_split_but_not_deferred, [r"put Ws off into the slots where the rank would idle", r"\[1 of 3 points\]$"],
         None),
        (zb_one_deferral_short, [r"Closer: which ranks still idle", r"\[2 of 3 points\]$"], None),
        (zb_gpipe, [r"^p=\d stages, m=\d+ micro-batches: rank 0 holds \d+ micro-batches' activations at its peak, "
                    r"more than the p = \d that 1F1B's busiest rank holds"], None),
        (zb_all_weights_at_the_end, [r"rank 0 holds \d+ micro-batches' activations .*a micro-batch's activations "
                                     r"are held from its F until its W"], None),
        (zb_weight_before_input, [r"this schedule cannot run as a training step"], None),
        (zb_rank_2_forgets_a_weight, [r"this schedule cannot run as a training step", r"rank 2|stage 2"], None),
        (zb_with_the_library, [r"pplab\.pipeline's schedules"], None),
    ],
}
