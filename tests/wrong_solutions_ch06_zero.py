"""Plausible wrong answers to chapter 6's exercises (ZeRO), each a mistake a student could make.

WRONG[exercise_id] lists (function, regular expressions the check's message must match,
timeout for the check or None for the default), as in wrong_solutions_ch00_broadcast.py:
tests/test_checks.py checks that every one of them fails with that message.
"""
import torch

from pplab import comm

# ----------------------------------------------------------------------------------
# 6a: ZeRO-1's sharded step


def _shard(flat_param):
    rank, p = comm.rank(), comm.world_size()
    size = flat_param.numel() // p
    return rank, p, flat_param[rank * size:(rank + 1) * size]


def zero1_all_reduce_then_slice(flat_param, optimizer_class):
    """Right numbers, but an all-reduce of the whole gradient: twice the bytes of a reduce-scatter."""
    rank, p, shard = _shard(flat_param)
    opt = optimizer_class([shard])

    def step(flat_grad):
        g = flat_grad.clone()
        comm.all_reduce(g)
        shard.grad = g.tensor_split(p)[rank] / p
        opt.step()
        comm.all_gather_into_tensor(flat_param, shard.clone())
    return step


def zero1_optimizer_over_everything(flat_param, optimizer_class):
    """No all-reduce (RS + AG rebuild the mean gradient), but the optimizer holds all of flat_param."""
    rank, p, shard = _shard(flat_param)
    opt = optimizer_class([flat_param])

    def step(flat_grad):
        mine = torch.empty_like(shard)
        comm.reduce_scatter_tensor(mine, flat_grad)
        full = torch.empty_like(flat_param)
        comm.all_gather_into_tensor(full, mine / p)
        flat_param.grad = full
        opt.step()
    return step


def zero1_forgets_the_mean(flat_param, optimizer_class):
    rank, p, shard = _shard(flat_param)
    opt = optimizer_class([shard])

    def step(flat_grad):
        mine = torch.empty_like(shard)
        comm.reduce_scatter_tensor(mine, flat_grad)
        shard.grad = mine                                   # the sum over ranks, not the mean
        opt.step()
        comm.all_gather_into_tensor(flat_param, shard.clone())
    return step


def zero1_only_rank0_copies_back(flat_param, optimizer_class):
    """Right on rank 0; the other ranks never take in the other shards."""
    rank, p, shard = _shard(flat_param)
    opt = optimizer_class([shard])

    def step(flat_grad):
        mine = torch.empty_like(shard)
        comm.reduce_scatter_tensor(mine, flat_grad)
        shard.grad = mine / p
        opt.step()
        gathered = torch.empty_like(flat_param)
        comm.all_gather_into_tensor(gathered, shard.clone())
        if rank == 0:
            flat_param.copy_(gathered)
    return step


def zero1_steps_a_copy(flat_param, optimizer_class):
    """The optimizer steps a copy of the shard, and the copy never goes back into flat_param."""
    rank, p, view = _shard(flat_param)
    shard = view.clone()
    opt = optimizer_class([shard])

    def step(flat_grad):
        mine = torch.empty_like(shard)
        comm.reduce_scatter_tensor(mine, flat_grad)
        shard.grad = mine / p
        opt.step()
        comm.all_gather_into_tensor(flat_param, view.clone())
    return step


def zero1_gathers_in_float32(flat_param, optimizer_class):
    """Right steps, but the updated shards are all-gathered as float32 to halve the bytes:
    every parameter comes back rounded to 24 bits, an error near 1e-7, not float64's 1e-16."""
    rank, p, shard = _shard(flat_param)
    opt = optimizer_class([shard])

    def step(flat_grad):
        mine = torch.empty_like(shard)
        comm.reduce_scatter_tensor(mine, flat_grad)
        shard.grad = mine / p
        opt.step()
        gathered = torch.empty(flat_param.shape, dtype=torch.float32)
        comm.all_gather_into_tensor(gathered, shard.float())
        flat_param.copy_(gathered)
    return step


# ----------------------------------------------------------------------------------
# 6b: what one rank holds, stage by stage


def _state(params, grads, stage, shard_of, master_dtype=torch.float32, grads_from=2, moments=2):
    """The right layout, with the knobs the mistakes below turn; shard_of(flat, c, rank, n) cuts a shard."""
    rank, n = comm.rank(), comm.world_size()
    psi = sum(p.numel() for p in params)
    c = -(-psi // n)

    def shard(tensors):
        flat = torch.zeros(c * n, dtype=tensors[0].dtype)
        flat[:psi] = torch.cat([t.flatten() for t in tensors])
        return shard_of(flat, psi, c, rank, n)
    master = (shard(params) if stage >= 1 else torch.cat([p.flatten() for p in params])).to(master_dtype)
    zeros = torch.zeros_like(master)
    return {"params": [shard(params)] if stage >= 3 else list(params),
            "grads": [shard(grads)] if stage >= grads_from else list(grads),
            "optimizer": [master, zeros, zeros if moments == 1 else torch.zeros_like(master)]}


def _own(flat, psi, c, rank, n):
    return flat[rank * c:(rank + 1) * c].clone()


def state_chunks_without_padding(params, grads, stage):
    """flat.tensor_split(n) of the unpadded buffer: right on rank 0, one element short on a later rank."""
    return _state(params, grads, stage, lambda flat, psi, c, rank, n: flat[:psi].tensor_split(n)[rank].clone())


def state_shard_is_a_view(params, grads, stage):
    """Right values, but each shard a slice of the padded buffer: it keeps the whole buffer alive."""
    return _state(params, grads, stage, lambda flat, psi, c, rank, n: flat[rank * c:(rank + 1) * c])


def state_rank0_shard(params, grads, stage):
    """Every rank keeps rank 0's shard: right on rank 0 only."""
    return _state(params, grads, stage, lambda flat, psi, c, rank, n: flat[:c].clone())


def state_master_in_bf16(params, grads, stage):
    """The master weights and moments in bf16: K = 6, not 12."""
    return _state(params, grads, stage, _own, master_dtype=torch.bfloat16)


def state_stage1_shards_gradients(params, grads, stage):
    """Shards the gradients from stage 1 on (that is stage 2)."""
    return _state(params, grads, stage, _own, grads_from=1)


def state_one_tensor_for_both_moments(params, grads, stage):
    """exp_avg and exp_avg_sq are the same tensor: half the optimizer's moments."""
    return _state(params, grads, stage, _own, moments=1)


def state_as_the_formula(params, grads, stage):
    """The formula's numbers instead of the tensors."""
    psi, n = sum(p.numel() for p in params), comm.world_size()
    return {"params": 2 * psi / (n if stage >= 3 else 1), "grads": 2 * psi / (n if stage >= 2 else 1),
            "optimizer": 12 * psi / (n if stage >= 1 else 1)}


# ----------------------------------------------------------------------------------
# 6c: stage 3's gathered layer


def _gather(shard):
    full = torch.empty(shard.numel() * comm.world_size(), dtype=shard.dtype)
    comm.all_gather_into_tensor(full, shard.detach())
    return full


def _grad_pieces(grad_y, x, full, o, i):
    flat = torch.zeros_like(full)
    flat[:o * i] = (grad_y.T @ x).flatten()
    flat[o * i:o * i + o] = grad_y.sum(0)
    return flat


class _KeepsFull(torch.autograd.Function):
    """Saves the gathered buffer for backward instead of gathering again."""

    @staticmethod
    def forward(ctx, x, shard, o, i):
        full = _gather(shard)
        ctx.save_for_backward(x, shard, full)
        ctx.dims = (o, i)
        return x @ full[:o * i].view(o, i).T + full[o * i:o * i + o]

    @staticmethod
    def backward(ctx, grad_y):
        x, shard, full = ctx.saved_tensors
        o, i = ctx.dims
        out = torch.empty_like(shard)
        comm.reduce_scatter_tensor(out, _grad_pieces(grad_y, x, full, o, i))
        return grad_y @ full[:o * i].view(o, i), out / comm.world_size(), None, None


def linear_keeps_full_parameters(x, shard, out_features, in_features):
    return _KeepsFull.apply(x, shard, out_features, in_features)


def linear_plain_autograd(x, shard, out_features, in_features):
    """Ordinary differentiable ops on the gathered buffer: autograd keeps W for backward."""
    full = _gather(shard).requires_grad_(True)
    o, i = out_features, in_features
    return x @ full[:o * i].view(o, i).T + full[o * i:o * i + o] + 0 * shard.sum()


def _make_backward(divide=True, own_piece=True):
    class Layer(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shard, o, i):
            full = _gather(shard)
            ctx.save_for_backward(x, shard)
            ctx.dims = (o, i)
            return x @ full[:o * i].view(o, i).T + full[o * i:o * i + o]

        @staticmethod
        def backward(ctx, grad_y):
            x, shard = ctx.saved_tensors
            o, i = ctx.dims
            p = comm.world_size()
            full = _gather(shard)
            flat = _grad_pieces(grad_y, x, full, o, i)
            if own_piece:
                out = torch.empty_like(shard)
                comm.reduce_scatter_tensor(out, flat)
            else:                               # the sum over ranks, then always piece 0
                comm.all_reduce(flat)
                out = flat[:shard.numel()].clone()
            return grad_y @ full[:o * i].view(o, i), out / p if divide else out, None, None
    return Layer


_NO_DIVIDE, _PIECE_ZERO = _make_backward(divide=False), _make_backward(own_piece=False)


def linear_forgets_the_mean(x, shard, out_features, in_features):
    return _NO_DIVIDE.apply(x, shard, out_features, in_features)


def linear_keeps_piece_zero(x, shard, out_features, in_features):
    """Right on rank 0, wrong on every other rank."""
    return _PIECE_ZERO.apply(x, shard, out_features, in_features)


def linear_without_gather(x, shard, out_features, in_features):
    """Uses its own shard as if it were the whole layer."""
    o, i = out_features, in_features
    full = torch.zeros(o * i + o, dtype=shard.dtype)
    n = min(shard.numel(), full.numel())
    full = torch.cat([shard[:n], full[n:]])
    return x @ full[:o * i].view(o, i).T + full[o * i:o * i + o]


STATE = r"^world_size=[23], stage \d, Ψ = \d+ parameters .*: rank \d, "
SHAPE = r"^world_size=[23], Linear\(\d, \d\), local batch \d: "
WRONG = {
    "zero1_step": [
        (zero1_all_reduce_then_slice,
         [r"^exercise 'zero1_step' asks for ZeRO stage 1 without an all-reduce: rank \d called one\. "
          r"Reduce-scatter the gradient instead"], None),
        (zero1_optimizer_over_everything,
         [r"^world_size=2, flat_param of \d+ elements: rank 0 gave its optimizer \[\d+\] element\(s\)",
          r"ZeRO-1 gives each rank's optimizer only its own shard"], None),
        (zero1_forgets_the_mean,
         [r"rank 0's flat_param\[\d+\] \(in rank 0's shard\)", r"divide by the world size"], None),
        (zero1_only_rank0_copies_back,
         [r"^world_size=2, .*rank 1's flat_param\[\d+\] \(in rank 0's shard\)",
          r"Other ranks are right: rank 1 did not receive the other ranks' updated shards"], None),
        (zero1_steps_a_copy, [r"after step 1, rank 0's flat_param\[\d+\] \(in rank 0's shard\) is"], None),
        (zero1_gathers_in_float32, [r"^world_size=2, .*after step 1, rank 0's flat_param\[\d+\] \(in rank \d's shard\) "
                                    r"is [-\d.e]+, expected"], None),
    ],
    "zero_bytes": [
        (state_chunks_without_padding, [STATE.replace("rank \\d", "rank [12]") + r"the (parameters|gradients|optimizer "
                                        r"state) hold \d+ elements, expected \d+", r"Pad: Ψ = \d+ is not a multiple of N"],
         None),
        (state_shard_is_a_view, [STATE + r"the (parameters|gradients) occupy [\d,]+ bytes of storage",
                                 r"a view keeps its whole storage alive", r"\.clone\(\) the shard"], None),
        (state_rank0_shard, [STATE.replace("rank \\d", "rank [12]") + r"the .* differ at element",
                             r"It is rank 0's shard"], None),
        (state_master_in_bf16, [STATE + r"the optimizer state include a torch\.bfloat16 tensor",
                                r"K = 12 bytes per parameter", r"params ✔ · grads ✔ · optimizer ✘ \(2 of 3\)"], None),
        (state_stage1_shards_gradients, [r"stage 1, .*: rank \d, the gradients hold \d+ elements",
                                         r"That is one shard: at stage 1 the gradients are not split yet",
                                         r"params ✔ · grads ✘ · optimizer ✔"], None),
        (state_one_tensor_for_both_moments, [STATE + r"the optimizer state occupy [\d,]+ bytes",
                                             r"exp_avg and exp_avg_sq are two moments"], None),
        (state_as_the_formula, [r"zero_state must return a dict", r"\(0 of 3\)"], None),
    ],
    "stage3_unit": [
        (linear_keeps_full_parameters,
         [SHAPE + r"rank 0: after forward, autograd still holds \d+ bytes of the gathered full parameters"], None),
        (linear_plain_autograd, [SHAPE + r"rank 0: after forward, autograd still holds"], None),
        (linear_forgets_the_mean, [SHAPE + r"rank 0's shard.grad at \d+ is", r"It is [23] times that"], None),
        (linear_keeps_piece_zero,
         [SHAPE + r"rank 1's shard.grad at \d+ is", r"It is rank 0's piece"], None),
        (linear_without_gather, [SHAPE + r"rank 0's output at \(\d, \d\) is"], None),
    ],
}


# ----------------------------------------------------------------------------------
# Near misses (issue 38): right at p = 2 but not at 3, wrong on a rank other than 0, just outside the
# tolerance, and a dtype only the second tensor has wrong. Each is a right answer with one thing changed.


def zero1_gathers_by_recursive_doubling(flat_param, optimizer_class):
    """The all-gather by recursive doubling (partner rank ^ 1, then ^ 2, ...), skipping partners past
    the last rank: right for a power of two, but at p = 3 rank 1's partner at distance 2 is missing,
    so rank 1 alone never receives rank 2's shard (ranks 0 and 2 are right)."""
    rank, p, shard = _shard(flat_param)
    size = shard.numel()
    opt = optimizer_class([shard])

    def step(flat_grad):
        mine = torch.empty_like(shard)
        comm.reduce_scatter_tensor(mine, flat_grad)
        shard.grad = mine / p
        opt.step()                                          # shard is a view: flat_param holds my new shard
        mask = 1
        while mask < p:
            partner = rank ^ mask
            if partner < p:                                 # the blocks of shards each side holds so far
                ours, theirs = rank // mask * mask, partner // mask * mask
                out = flat_param[ours * size:min(ours + mask, p) * size].clone()
                into = torch.empty((min(theirs + mask, p) - theirs) * size, dtype=flat_param.dtype)
                for h in (comm.isend(out, partner), comm.irecv(into, partner)):
                    h.wait()
                flat_param[theirs * size:theirs * size + into.numel()] = into
            mask *= 2
    return step


def zero1_within_tolerance(flat_param, optimizer_class):
    """Correct up to 1e-11 of each parameter, a hundredth of the check's 1e-9 (the reduce-scatter summed
    in another order, say): it must pass (tests/test_checks_zero_near.py)."""
    rank, p, shard = _shard(flat_param)
    opt = optimizer_class([shard])

    def step(flat_grad):
        mine = torch.empty_like(shard)
        comm.reduce_scatter_tensor(mine, flat_grad)
        shard.grad = mine / p
        opt.step()
        comm.all_gather_into_tensor(flat_param, shard.clone())
        flat_param.mul_(1 + 1e-11 * torch.randn(flat_param.shape, dtype=flat_param.dtype).clamp(-3, 3))
    return step


def state_pads_psi_mod_n(params, grads, stage):
    """Pads the flat buffer with Ψ mod N zeros, not (-Ψ) mod N: the same when N = 2, one short of a
    multiple of 3 when Ψ mod 3 = 1, and every shard (cut at buffer length // N) one element short."""
    rank, n = comm.rank(), comm.world_size()
    psi = sum(p.numel() for p in params)

    def shard(tensors):
        flat = torch.cat([t.flatten() for t in tensors] + [torch.zeros(psi % n, dtype=tensors[0].dtype)])
        c = flat.numel() // n
        return flat[rank * c:(rank + 1) * c].clone()
    master = (shard(params) if stage >= 1 else torch.cat([p.flatten() for p in params])).float()
    return {"params": [shard(params)] if stage >= 3 else list(params),
            "grads": [shard(grads)] if stage >= 2 else list(grads),
            "optimizer": [master, torch.zeros_like(master), torch.zeros_like(master)]}


def state_moments_in_bf16(params, grads, stage):
    """The fp32 master right, but Adam's two moments in bf16 (as the model): 8 bytes per parameter, not 12."""
    got = _state(params, grads, stage, _own)
    master = got["optimizer"][0]
    got["optimizer"] = [master, torch.zeros_like(master, dtype=torch.bfloat16),
                        torch.zeros_like(master, dtype=torch.bfloat16)]
    return got


def linear_halves_the_sum(x, shard, out_features, in_features):
    """The mean over ranks written as the sum / 2, as in the two-rank example: right at p = 2 only."""
    return _HALVES.apply(x, shard, out_features, in_features)


def linear_reduces_in_float32(x, shard, out_features, in_features):
    """The gradient reduce-scattered in float32 to halve the bytes: each shard's gradient rounded to
    24 bits, some 1e-8 of itself off: outside the check's 1e-9, inside 100 times it."""
    return _FLOAT32_REDUCE.apply(x, shard, out_features, in_features)


def linear_within_tolerance(x, shard, out_features, in_features):
    """Correct up to 1e-11 of each value (a hundredth of the check's 1e-9): it must pass
    (tests/test_checks_zero_near.py)."""
    return _NOISY.apply(x, shard, out_features, in_features)


def _make_variant(divide_by=None, reduce_dtype=torch.float64, noise=0.0):
    class Layer(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shard, o, i):
            full = _gather(shard)
            ctx.save_for_backward(x, shard)
            ctx.dims = (o, i)
            y = x @ full[:o * i].view(o, i).T + full[o * i:o * i + o]
            return y * (1 + noise * torch.randn(y.shape, dtype=y.dtype).clamp(-3, 3))

        @staticmethod
        def backward(ctx, grad_y):
            x, shard = ctx.saved_tensors
            o, i = ctx.dims
            full = _gather(shard)
            flat = _grad_pieces(grad_y, x, full, o, i).to(reduce_dtype)
            out = torch.empty(shard.shape, dtype=reduce_dtype)
            comm.reduce_scatter_tensor(out, flat)
            out = out.to(shard.dtype) / (divide_by or comm.world_size())
            return grad_y @ full[:o * i].view(o, i), out * (1 + noise * torch.randn(out.shape,
                                                                                     dtype=out.dtype).clamp(-3, 3)), \
                None, None
    return Layer


_HALVES, _FLOAT32_REDUCE, _NOISY = _make_variant(divide_by=2), _make_variant(reduce_dtype=torch.float32), \
    _make_variant(noise=1e-11)


WRONG["zero1_step"] += [
    (zero1_gathers_by_recursive_doubling,
     [r"^world_size=3, .*rank 1's flat_param\[\d+\] \(in rank 2's shard\)",
      r"Other ranks are right: rank 1 did not receive the other ranks' updated shards"], None),
]
WRONG["zero_bytes"] += [
    (state_pads_psi_mod_n, [r"^world_size=3, stage [123], Ψ = \d+ parameters .*: rank 0, the (parameters|gradients|"
                            r"optimizer state) hold \d+ elements, expected \d+", r"Pad: Ψ = \d+ is not a multiple of N"],
     None),
    (state_moments_in_bf16, [STATE + r"the optimizer state include a torch\.bfloat16 tensor",
                             r"params ✔ · grads ✔ · optimizer ✘ \(2 of 3\)"], None),
]
WRONG["stage3_unit"] += [
    (linear_halves_the_sum, [r"^world_size=3, Linear\(\d, \d\), local batch \d: rank 0's shard.grad at \d+ is"], None),
    (linear_reduces_in_float32, [SHAPE + r"rank 0's shard.grad at \d+ is [-\d.e]+, expected [-\d.e]+ \(off by "
                                 r"[-\d.e]+, [-\d.e]+ allowed\)"], None),
]
