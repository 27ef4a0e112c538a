"""Ring attention, Ulysses and Megatron SP against one process; bytes and memory against closed forms.

Everything is float64. The reference is a plain softmax(QKᵀ/√d)·V on one process (and torch's
scaled_dot_product_attention, checked to agree with it); "equal" means max |difference| <=
TOL = 1e-10 for outputs and for the gradients of q, k and v (measured: ~1e-15). Sequence
lengths 12 (divides by 1..4 ranks and by 2p for zigzag at p = 2, 3) and 13 (divides by nothing);
24 for the all-gather baseline, which needs equal shards.

Megatron SP: MegatronBlock (chapter 3's layers, sequence parallel or not) trained 3 SGD steps
equals chapter 3's dense TransformerBlock trained on one process (float64, TOL); the bytes
autograd keeps equal Korthikanti et al.'s formula exactly (bf16) plus LayerNorm's statistics,
which the formula leaves out; bytes per rank from the trace equal closed forms.
"""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import pplab
from pplab import trace
from pplab.memory import PeakMemory
from pplab.sequence_parallel.ring_attention import gathered_kv_attention, merge, pieces, ring_attention, shard_sequence, \
    unshard_sequence
from pplab.sequence_parallel import MegatronBlock, activation_bytes_formula, heads_to_seq, ring_collectives, \
    saved_activations, seq_to_heads, ulysses_attention
from pplab.tensor_parallel.transformer import TransformerBlock

TOL = 1e-10
B, H, D = 2, 12, 4                 # 12 heads divide by 1, 2, 3 and 4 ranks


def reference(Q, K, V, causal):
    """Attention on one process, with the gradients of Q, K, V for the upstream gradient dO."""
    s = Q @ K.transpose(-1, -2) / math.sqrt(Q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, -1) @ V


def inputs(seq, seed=0, heads=H):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, heads, seq, D, generator=g, dtype=torch.float64) for _ in range(4)]   # Q, K, V, dO


def expected(seq, causal, seed=0):
    Q, K, V, dO = inputs(seq, seed)
    Q, K, V = (t.requires_grad_() for t in (Q, K, V))
    O = reference(Q, K, V, causal)
    O.backward(dO)
    torch.testing.assert_close(O, F.scaled_dot_product_attention(Q, K, V, is_causal=causal), rtol=0, atol=TOL)
    return [O.detach(), Q.grad, K.grad, V.grad]


def run_one(fn, seq, causal, layout, seed=0, group=None):
    """On a rank: this rank's shards in, the method's output and q/k/v gradients out."""
    kw = {} if fn is ulysses_attention else {"layout": layout}      # Ulysses is always contiguous
    Q, K, V, dO = inputs(seq, seed)
    q, k, v, do = (shard_sequence(t, group, layout) for t in (Q, K, V, dO))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, group=group, causal=causal, **kw)
    out.backward(do)
    return [out.detach(), q.grad, k.grad, v.grad]


def all_cases():
    results = {}
    for seq in (12, 13):
        for causal in (False, True):
            for layout in ("contiguous", "zigzag"):
                results["ring", seq, causal, layout] = run_one(ring_attention, seq, causal, layout)
            results["ulysses", seq, causal, "contiguous"] = run_one(ulysses_attention, seq, causal, "contiguous")
    for causal in (False, True):                    # the baseline needs equal shards: 24 = 2·3·4
        for layout in ("contiguous", "zigzag"):
            results["gathered", 24, causal, layout] = run_one(gathered_kv_attention, 24, causal, layout)
    return results


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_outputs_and_gradients_equal_single_process_attention(p):
    per_rank = pplab.launch(all_cases, world_size=p, timeout=90)
    for (method, seq, causal, layout), _ in per_rank[0].items():
        want = expected(seq, causal)
        for i, name in enumerate(("output", "dq", "dk", "dv")):
            got = unshard_sequence([r[method, seq, causal, layout][i] for r in per_rank], layout)
            err = (got - want[i]).abs().max().item()
            assert err <= TOL, (method, seq, causal, layout, name, err)


SCALE = 0.3                        # not the default 1/√D = 0.5: a scale dropped on the way shows


def scaled_cases():
    """Every method with scale=SCALE; seq 13 (uneven shards) except the baseline, which needs 24."""
    results = {}
    for causal in (False, True):
        for fn, seq, layouts in ((ulysses_attention, 13, ("contiguous",)), (ring_attention, 13, ("contiguous", "zigzag")),
                                 (gathered_kv_attention, 24, ("contiguous", "zigzag"))):
            for layout in layouts:
                kw = {} if fn is ulysses_attention else {"layout": layout}
                Q, K, V, dO = inputs(seq, seed=5)
                q, k, v, do = (shard_sequence(t, None, layout) for t in (Q, K, V, dO))
                q, k, v = (t.requires_grad_() for t in (q, k, v))
                out = fn(q, k, v, causal=causal, scale=SCALE, **kw)
                out.backward(do)
                results[fn.__name__, seq, causal, layout] = [out.detach(), q.grad, k.grad, v.grad]
    return results


@pytest.mark.parametrize("p", [2, 3])
def test_a_non_default_scale_equals_torch_attention_with_that_scale(p):
    """The reference is torch's scaled_dot_product_attention(scale=SCALE) on the whole sequence,
    outputs and the gradients of q, k, v (the scale enters dQ and dK too)."""
    per_rank = pplab.launch(scaled_cases, world_size=p, timeout=60)
    for (method, seq, causal, layout) in per_rank[0]:
        Q, K, V, dO = inputs(seq, seed=5)
        Q, K, V = (t.requires_grad_() for t in (Q, K, V))
        O = F.scaled_dot_product_attention(Q, K, V, is_causal=causal, scale=SCALE)
        O.backward(dO)
        for i, (name, want) in enumerate(zip(("output", "dq", "dk", "dv"), (O.detach(), Q.grad, K.grad, V.grad))):
            got = unshard_sequence([r[method, seq, causal, layout][i] for r in per_rank], layout)
            err = (got - want).abs().max().item()
            assert err <= TOL, (method, seq, causal, layout, name, err)


# ----------------------------------------------------------------------------------
# Layouts and the merge


def test_layouts_cover_the_sequence_once_and_zigzag_pairs_early_with_late():
    assert pieces(12, 3, "contiguous") == [[(0, 4)], [(4, 8)], [(8, 12)]]
    assert pieces(12, 3, "zigzag") == [[(0, 2), (10, 12)], [(2, 4), (8, 10)], [(4, 6), (6, 8)]]
    for seq in (0, 1, 5, 12, 13):
        for p in (1, 2, 3, 4):
            for layout in ("contiguous", "zigzag"):
                covered = sorted(i for runs in pieces(seq, p, layout) for a, b in runs for i in range(a, b))
                assert covered == list(range(seq))
                x = torch.arange(seq, dtype=torch.float64).view(1, seq, 1)
                shards = [x[:, [i for a, b in runs for i in range(a, b)]] for runs in pieces(seq, p, layout)]
                assert torch.equal(unshard_sequence(shards, layout), x)


def test_merge_of_two_key_blocks_equals_attention_over_both():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(5, 9, 3, generator=g, dtype=torch.float64) for _ in range(3))
    s = q @ k.transpose(-1, -2)

    def part(cols):
        return torch.softmax(s[..., cols], -1) @ v[..., cols, :], torch.logsumexp(s[..., cols], -1)

    o, lse = merge(*part(slice(0, 4)), *part(slice(4, 9)))
    torch.testing.assert_close(o, torch.softmax(s, -1) @ v, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=0, atol=1e-12)
    empty = torch.full((5, 9), -math.inf, dtype=torch.float64)      # a row that saw no key yet
    o2, lse2 = merge(torch.zeros_like(o), empty, *part(slice(0, 9)))
    torch.testing.assert_close(o2, o, rtol=0, atol=1e-12)
    assert torch.isfinite(merge(torch.zeros_like(o), empty, torch.zeros_like(o), empty)[0]).all()


# ----------------------------------------------------------------------------------
# Bytes from the trace = closed forms


def traced_bytes(seq):
    """(bytes this rank sent in forward, in backward), from its trace, for each method."""
    out = {}
    for name, fn, causal, layout in (("ring zigzag", ring_attention, True, "zigzag"),
                                     ("ring contiguous", ring_attention, False, "contiguous"),
                                     ("ulysses", ulysses_attention, True, "contiguous")):
        kw = {} if fn is ulysses_attention else {"layout": layout}
        Q, K, V, dO = inputs(seq)
        q, k, v, do = (shard_sequence(t, None, layout).requires_grad_() for t in (Q, K, V, dO))
        trace.reset()
        o = fn(q, k, v, causal=causal, **kw)
        fwd = sum(e.bytes_sent for e in trace.events())
        o.backward(do)
        out[name] = (fwd, sum(e.bytes_sent for e in trace.events()) - fwd)
    return out


@pytest.mark.parametrize("p", [2, 3, 4])
def test_bytes_per_rank_equal_the_formulas(p):
    row = B * H * D * 8                     # one token of q (or k, or v), all heads, float64
    for seq in (12, 13):
        res = pplab.launch(traced_bytes, seq, world_size=p)
        n = [sum(b - a for a, b in runs) for runs in pieces(seq, p, "contiguous")]
        for r in range(p):
            # ring: K and V of every block but the right neighbour's (it is the last one we receive);
            # backward again, plus the partial dK, dV of all p blocks
            right = (r + 1) % p
            for layout in ("zigzag", "contiguous"):
                n_l = [sum(b - a for a, b in runs) for runs in pieces(seq, p, layout)]
                assert res[r]["ring " + layout] == (2 * (seq - n_l[right]) * row,
                                                   (2 * (seq - n_l[right]) + 2 * seq) * row)
            # Ulysses: q, k, v keep 1/p of their heads home (3(p-1)·n_r), the output comes back
            # from the other ranks' tokens (S - n_r); backward is the mirror image
            c = row // p
            assert res[r]["ulysses"] == ((3 * (p - 1) * n[r] + seq - n[r]) * c,
                                         ((p - 1) * n[r] + 3 * (seq - n[r])) * c)
        if seq == 12:                        # the textbook forms, with equal shards of N bytes
            N = seq // p * row
            assert res[0]["ring zigzag"] == (2 * (p - 1) * N, (4 * p - 2) * N)
            assert res[0]["ulysses"] == (4 * (p - 1) * N // p, 4 * (p - 1) * N // p)


# ----------------------------------------------------------------------------------
# Overlap, balance, memory: from the trace


def ring_trace(seq, causal, layout):
    Q, K, V, _ = inputs(seq)
    q, k, v = (shard_sequence(t, None, layout) for t in (Q, K, V))
    ring_attention(q, k, v, causal=causal, layout=layout)


@pytest.mark.parametrize("p", [3, 4])
def test_each_block_is_sent_on_before_it_is_computed_and_zigzag_balances_causal_work(p):
    seq = 8 * p
    work = {}
    for layout in ("contiguous", "zigzag"):
        tl = pplab.launch(ring_trace, seq, True, layout, world_size=p).timeline
        for r in range(p):
            spans = tl.select(r, "compute", "F")
            sends = tl.select(r, "comm", "send")
            assert len(sends) == 2 * (p - 1)            # K and V, p-1 times
            # step s computes block r-s; its K/V were already posted to the right neighbour
            for span in spans:
                s = (r - span.meta["block"]) % p
                if s < p - 1:
                    assert sends[2 * s].start <= span.start and sends[2 * s].meta["shape"][-2] == seq // p
        work[layout] = [sum(e.meta["scores"] for e in tl.select(r, "compute", "F")) for r in range(p)]
    n = seq // p
    # contiguous: rank r computes its diagonal block and r full blocks; zigzag: all ranks the same
    assert work["contiguous"] == [(r + 1) * n * n for r in range(p)]
    half = n // 2
    assert work["zigzag"] == [(3 + 2 * (p - 1)) * half * half] * p


def kv_memory(fn, seq, layout):
    Q, K, V, dO = inputs(seq)
    q, k, v, do = (shard_sequence(t, None, layout).requires_grad_() for t in (Q, K, V, dO))
    fn(q, k, v, causal=True, layout=layout).backward(do)
    return max(e.value for e in trace.events() if e.category == "memory"), trace.held()


@pytest.mark.parametrize("p", [2, 4])
def test_peak_kv_memory_per_rank(p):
    seq, block = 8 * p, 2 * B * H * 8 * D * 8          # K and V of one rank's 8 tokens
    ring = pplab.launch(kv_memory, ring_attention, seq, "zigzag", world_size=p)
    gathered = pplab.launch(kv_memory, gathered_kv_attention, seq, "zigzag", world_size=p)
    for r in range(p):
        # ring: its own block, the block being computed and the one arriving (two from p = 3 on)
        assert ring[r] == (min(3, p) * block, 0)
        # all-gather: its own block plus all p blocks gathered
        assert gathered[r] == ((p + 1) * block, 0)


def bf16_run(fn, seq, layout):
    """bf16 shards in: the output and gradients (as float64), and the peak of the 16-bit tensors
    forward and backward make (pplab.memory.PeakMemory): K/V blocks received, the output and the
    gradients; the arithmetic is float32."""
    Q, K, V, dO = (t.to(torch.bfloat16) for t in inputs(seq))
    q, k, v, do = (shard_sequence(t, None, layout).requires_grad_() for t in (Q, K, V, dO))
    with PeakMemory(count=lambda t: t.dtype == torch.bfloat16) as held:
        out = fn(q, k, v, causal=True, layout=layout)
    with PeakMemory(count=lambda t: t.dtype == torch.bfloat16) as held_backward:
        out.backward(do)
    assert {t.dtype for t in (out, q.grad, k.grad, v.grad)} == {torch.bfloat16}
    return [t.double() for t in (out.detach(), q.grad, k.grad, v.grad)], held.peak, held_backward.peak


@pytest.mark.parametrize("p", [3])
def test_bf16_inputs_measured_kv_memory_and_results(p):
    """Both methods in bf16 equal float64 attention on bf16-rounded inputs to bf16's precision, and
    the 16-bit storages each rank's forward makes peak at (block: one rank's K or V, in bytes):
    ring, the block being computed with and the one arriving, 2·min(2, p-1) blocks (its own are its
    inputs); all-gather, everyone's K and V (2p), its own put in place, and the output (1), made
    while they are kept for backward."""
    seq, layout = 12 * p, "zigzag"
    block = B * H * (seq // p) * D * 2
    Q, K, V, dO = (t.to(torch.bfloat16).double().requires_grad_(i < 3) for i, t in enumerate(inputs(seq)))
    out = reference(Q, K, V, True)
    out.backward(dO)
    want = [out.detach(), Q.grad, K.grad, V.grad]
    for fn, kv_blocks in ((ring_attention, 2 * min(2, p - 1)), (gathered_kv_attention, 2 * p + 1)):
        res = pplab.launch(bf16_run, fn, seq, layout, world_size=p)
        for r, (got, peak, peak_backward) in enumerate(res):
            assert peak == kv_blocks * block, (fn.__name__, r, peak / block)
            # backward: the ring's K/V visitors again (the last freed before the gradients are made),
            # then dq, dk, dv in bf16; the all-gather's K/V are its saved ones: only the 3 gradients
            want_backward = max(kv_blocks, 3) if fn is ring_attention else 3
            assert peak_backward == want_backward * block, (fn.__name__, r, peak_backward / block)
        for i in range(4):
            err = (unshard_sequence([got[i] for got, _, _ in res], layout) - want[i]).abs().max().item()
            assert err < 0.05 * want[i].abs().max().item(), (fn.__name__, i, err)


# ----------------------------------------------------------------------------------
# Sub-groups, Ulysses' layout change, bad input


def on_subgroups(seq):
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]        # every rank creates both
    group = groups[pplab.comm.rank() % 2]
    return {"ring": run_one(ring_attention, seq, True, "zigzag", seed=pplab.comm.rank() % 2, group=group),
            "ulysses": run_one(ulysses_attention, seq, True, "contiguous", seed=pplab.comm.rank() % 2, group=group)}


def test_on_two_subgroups_of_four_ranks_at_once():
    seq = 7
    res = pplab.launch(on_subgroups, seq, world_size=4)
    for members, seed in (([0, 2], 0), ([1, 3], 1)):
        want = expected(seq, True, seed)
        for method, layout in (("ring", "zigzag"), ("ulysses", "contiguous")):
            for i in range(4):
                got = unshard_sequence([res[r][method][i] for r in members], layout)
                assert (got - want[i]).abs().max().item() <= TOL, (members, method, i)


def layout_change(seq):
    X = torch.arange(B * H * seq * D, dtype=torch.float64).view(B, H, seq, D)
    x = shard_sequence(X)
    y = seq_to_heads(x)
    lengths = [sum(b - a for a, b in runs) for runs in pieces(seq, pplab.comm.world_size())]
    return y, heads_to_seq(y, lengths)


@pytest.mark.parametrize("p", [3, 4])
def test_ulysses_all_to_all_gives_my_heads_for_the_whole_sequence_and_back(p):
    seq = 10
    X = torch.arange(B * H * seq * D, dtype=torch.float64).view(B, H, seq, D)
    res = pplab.launch(layout_change, seq, world_size=p)
    h = H // p
    for r, (y, back) in enumerate(res):
        assert torch.equal(y, X[:, r * h:(r + 1) * h])              # my heads, every token
        (a, b), = pieces(seq, p)[r]
        assert torch.equal(back, X[:, :, a:b])                      # every head, my tokens


def bad_call(case):
    rank, p = pplab.comm.rank(), pplab.comm.world_size()
    Q, K, V, _ = inputs(8, heads=3)
    q, k, v = (shard_sequence(t) for t in (Q, K, V))
    if case == "heads":
        ulysses_attention(q, k, v)
    elif case == "whole sequence":                  # rank 0 forgot to cut its tokens
        ring_attention(*((Q, K, V) if rank == 0 else (q, k, v)))
    elif case == "causal differs":
        ring_attention(q, k, v, causal=rank == 0)
    elif case == "layout":
        ring_attention(q, k, v, layout="spiral")
    elif case == "uneven gather":
        Q, K, V, _ = inputs(7)
        gathered_kv_attention(*(shard_sequence(t) for t in (Q, K, V)))
    elif case == "shapes":
        ring_attention(q, k[..., :1], v)
    return p


@pytest.mark.parametrize("case, message", [
    ("heads", "3 heads cannot be split over 2 ranks"),
    ("whole sequence", "the ranks hold [8, 4] tokens, but a contiguous layout of 12 tokens over 2 ranks gives them [6, 6]"),
    ("causal differs", "the ranks disagree"),
    ("layout", "unknown layout 'spiral'"),
    ("uneven gather", "all-gather needs equal shards"),
    ("shapes", "q, k, v must agree"),
])
def test_bad_input_is_a_clear_error_on_every_rank(case, message):
    with pytest.raises(pplab.LaunchError) as info:
        pplab.launch(bad_call, case, world_size=2, timeout=30)
    text = str(info.value)
    assert message in text, text
    assert "ranks 0, 1 raised ValueError" in text, text          # every rank refuses, said once


# ----------------------------------------------------------------------------------
# Megatron sequence parallelism: chapter 3's block with the sequence cut between its halves


def dense_block(h=16, a=4, dtype=torch.float64):
    torch.manual_seed(0)
    return TransformerBlock(h, a, 4 * h).to(dtype)


def block_data(s=12, b=2, h=16):
    g = torch.Generator().manual_seed(5)
    return torch.randn(s, b, h, generator=g, dtype=torch.float64), torch.randn(s, b, h, generator=g,
                                                                              dtype=torch.float64)


def megatron_train(sequence_parallel, steps, group=None):
    block = MegatronBlock.from_dense(dense_block(), sequence_parallel=sequence_parallel, group=group)
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    X, Y = block_data()
    x, y = (shard_sequence(X, group, dim=0), shard_sequence(Y, group, dim=0)) if sequence_parallel else (X, Y)
    grads = None
    for step in range(steps):
        opt.zero_grad()
        x_in = x.clone().requires_grad_()
        (((block(x_in) - y) ** 2).sum() / Y.numel()).backward()      # my tokens' share of the global mean
        if step == 0:
            grads = x_in.grad
        opt.step()
    return block(x).detach(), grads


def single_process_training(steps):
    block, (X, Y) = dense_block(), block_data()
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    grads = None
    for step in range(steps):
        opt.zero_grad()
        x_in = X.clone().requires_grad_()
        F.mse_loss(block(x_in), Y).backward()
        if step == 0:
            grads = x_in.grad
        opt.step()
    return block(X).detach(), grads


@pytest.mark.parametrize("p", [1, 2, 4])
def test_megatron_sp_trains_like_one_process(p):
    """3 SGD steps of chapter 3's dense block on one process = TP and TP + SP on p ranks (outputs
    after training, and the input gradient of the first step), to TOL."""
    want_out, want_grad = single_process_training(3)
    assert (want_out - dense_block()(block_data()[0])).abs().max() > 1e-3          # training moved it
    for sp in (True, False):
        res = pplab.launch(megatron_train, sp, 3, world_size=p)
        out = torch.cat([r[0] for r in res]) if sp else res[0][0]
        grad = torch.cat([r[1] for r in res]) if sp else res[0][1]
        assert (out - want_out).abs().max().item() <= TOL, (p, sp)
        assert (grad - want_grad).abs().max().item() <= TOL, (p, sp)


def megatron_on_subgroups():
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return megatron_train(True, 2, group=groups[pplab.comm.rank() % 2])


def test_megatron_sp_on_two_subgroups_of_four_ranks():
    want_out, want_grad = single_process_training(2)
    res = pplab.launch(megatron_on_subgroups, world_size=4)
    for members in ([0, 2], [1, 3]):
        assert (torch.cat([res[r][0] for r in members]) - want_out).abs().max().item() <= TOL
        assert (torch.cat([res[r][1] for r in members]) - want_grad).abs().max().item() <= TOL


S_M, B_M, H_M, A_M = 32, 2, 32, 4


def layer_memory(sequence_parallel, keep_input_shard):
    block = MegatronBlock.from_dense(dense_block(H_M, A_M, torch.bfloat16), dropout=0.1,
                                     sequence_parallel=sequence_parallel, keep_input_shard=keep_input_shard)
    x = torch.randn(S_M, B_M, H_M, dtype=torch.bfloat16)
    x = (shard_sequence(x, dim=0) if sequence_parallel else x).requires_grad_()
    with saved_activations(block.parameters()) as saved:
        y = block(x)
    y.float().sum().backward()
    return saved.bytes


@pytest.mark.parametrize("t", [1, 2, 4])
def test_activation_memory_is_korthikanti_formula(t):
    """Bytes autograd keeps for backward = s·b·h·(34 + 5as/h) / t with TP + SP, and
    s·b·h·(10 + 24/t + 5as/(ht)) with TP alone (bf16, 1-byte dropout masks), plus what the
    formula leaves out: LayerNorm's mean and 1/std, 2 numbers (2 bytes each) per token, 2 LayerNorms."""
    for sp in (True, False):
        ln_stats = 2 * 2 * 2 * S_M * B_M // (t if sp else 1)
        want = activation_bytes_formula(S_M, B_M, H_M, A_M, t, sp) + ln_stats
        assert pplab.launch(layer_memory, sp, True, world_size=t) == [want] * t, (t, sp)
    # chapter 3's column layer keeps the gathered input, [s, b, h], instead of this rank's shard
    keeps_gathered = pplab.launch(layer_memory, True, False, world_size=t)[0]
    assert keeps_gathered - activation_bytes_formula(S_M, B_M, H_M, A_M, t) - 2 * 2 * 2 * S_M * B_M // t == \
        2 * 2 * S_M * B_M * H_M * (1 - 1 / t)


def megatron_bytes(sequence_parallel):
    block = MegatronBlock.from_dense(dense_block(H_M, A_M, torch.float32), sequence_parallel=sequence_parallel)
    x = torch.randn(S_M, B_M, H_M)
    trace.reset(pplab.comm.rank())
    with ring_collectives():
        block(shard_sequence(x, dim=0) if sequence_parallel else x).sum().backward()
    return sum(e.bytes_sent for e in trace.events())


@pytest.mark.parametrize("t", [2, 4])
def test_megatron_bytes_per_rank(t):
    """From the trace (collectives run as traced rings): TP sends 4 all-reduces of A = s·b·h·4 bytes;
    TP + SP the same forward as 2 all-gathers + 2 reduce-scatters, and backward 2 all-gathers more
    (it re-gathers what it did not keep), plus 6 all-reduces of h gradients (LayerNorms, row biases)."""
    A = S_M * B_M * H_M * 4
    assert pplab.launch(megatron_bytes, False, world_size=t) == [8 * (t - 1) * A // t] * t
    assert pplab.launch(megatron_bytes, True, world_size=t) == [(10 * (t - 1) * A + 12 * (t - 1) * H_M * 4) // t] * t


def uneven_megatron():
    block = MegatronBlock.from_dense(dense_block())
    block(shard_sequence(block_data(s=13)[0], dim=0))


def test_megatron_sp_refuses_a_sequence_that_does_not_divide():
    with pytest.raises(pplab.LaunchError) as info:
        pplab.launch(uneven_megatron, world_size=2, timeout=30)
    assert "the ranks hold [7, 6] tokens" in str(info.value) and "divisible by 2" in str(info.value)
    assert "ranks 0, 1 raised ValueError" in str(info.value)
