"""Wrong or weaker answers to the exercises scored on how good the answer is, each with what
its message must say (and the points it earns, in the message's "[k of n points]").

zero_bubble: a schedule for p stages and m micro-batches with times t_f = t_i = t_w = 1.
design_layout: a dp × tp × pp layout with m micro-batches for a model, a batch and a memory budget.
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


def _design(problem, slip=None):
    """Exercise `design_layout`'s reference search, with one slip: every valid layout priced by pick_layout's formulas."""
    a, b, world, batch = problem["alpha"], problem["beta"], problem["world"], problem["batch"]

    def ring(p, n):
        return 0.0 if p == 1 else 2 * (p - 1) * a + 2 * (p - 1) / p * n * b
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    best = None
    for pp in divisors:
        for tp in [t for t in divisors if (world // pp) % t == 0 and problem["heads"] % t == 0]:
            dp = world // (pp * tp)
            for m in ([1] if pp == 1 else range(pp, batch // dp + 1)):
                if batch % (dp * m) or pp > problem["layers"] + 2:
                    continue
                mb, blocks = batch // (dp * m), problem["layers"] // pp
                act = mb * problem["act_bytes"]
                f = blocks * problem["t_f"] * mb / tp + 2 * blocks * ring(tp, act)
                bw = blocks * problem["t_b"] * mb / tp + 2 * blocks * ring(tp, act)
                fill = 0 if slip == "no bubble" else pp - 1
                grads = blocks * problem["block_bytes"] / tp
                step = (m + fill) * (f + bw) + 2 * (pp - 1) * (a + act * b) + ring(dp, grads)
                memory = 4 * grads + min(m, pp) * mb * blocks * problem["saved"][tp]
                if (slip == "ignore memory" or memory <= problem["budget"]) and (best is None or step < best[0]):
                    best = (step, {"dp": dp, "tp": tp, "pp": pp, "m": m})
    return None if best is None else best[1]


def design_ignoring_memory(problem):
    """The fastest layout, whether it fits or not."""
    return _design(problem, "ignore memory")


def design_without_the_bubble(problem):
    """Prices a pipeline as if it never filled and drained: favours deep pipelines (now and then
    one whose memory, counted with the embedding and the head, is just over the budget: 0 there)."""
    return _design(problem, "no bubble")


def design_all_data_parallel(problem):
    """A rule of thumb: every rank a replica."""
    return {"dp": problem["world"], "tp": 1, "pp": 1, "m": 1}


def design_fewer_microbatches_than_stages(problem):
    """A pipeline of 2 stages fed one micro-batch: 1F1B cannot run with m < pp."""
    return {"dp": problem["world"] // 2, "tp": 1, "pp": 2, "m": 1}


def design_returns_a_tuple(problem):
    layout = _design(problem)
    return (layout["dp"], layout["tp"], layout["pp"], layout["m"])


def design_with_the_planner(problem):
    import pplab.planner
    return pplab.planner.plan


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
    "design_layout": [
        (design_ignoring_memory, [r"^on 8 random problems", r"over the budget of [\d.,]+ MB", r"points\]$"], None),
        (design_without_the_bubble, [r"^(scored )?on 8 random problems", r"Your weakest: problem \d", r"of 3 points\]$"], None),
        (design_all_data_parallel, [r"over the budget|takes [\d.]+× the fastest"], None),
        (design_fewer_microbatches_than_stages, [r"is not a valid layout: 1F1B needs at least as many micro-batches as "
                                                 r"stages: m=\d, pp=\d"], None),
        (design_returns_a_tuple, [r"is not a layout: return a dict with whole numbers dp, tp, pp and m"], None),
        (design_with_the_planner, [r"pplab\.planner"], None),
    ],
}
