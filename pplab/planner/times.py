"""Measuring what pplab.planner needs on this machine: each layer's time and saved activations
(`measure`), its parameters (`layer_params`), a FLOP-count stand-in for shapes too big to time
here (`estimate`), and what running several ranks on fewer cores adds (`contention`; calibrate.py
turns it into the cost model's terms).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..models.gpt import GPTConfig, gpt_layers, gpt_loss
from ..memory import activation_bytes_formula, saved_activations
from ..tensor_parallel import split_sizes


# ----------------------------------------------------------------------------------
# What each pipeline layer (embedding, blocks, head + loss) costs on one process


@dataclass
class LayerTimes:
    """Per pipeline layer of the dense model: time = fixed + per_sample × samples (seconds),
    forward and backward apart; saved = activation elements per sample; optimizer: s per parameter.
    saved_parallel: elements per sample of the tensor-parallel version of each layer at t = 1
    (pplab's MegatronBlock runs attention unfused and keeps the s×s probabilities; the dense block's
    fused attention does not), which predict cuts for tp > 1 as `parallel_saved` counts; None:
    `saved` is cut the same way."""
    forward_fixed: list
    forward_per_sample: list
    backward_fixed: list
    backward_per_sample: list
    saved: list
    optimizer: float
    source: str = "measured"
    saved_parallel: list | None = None


def _time_once(layer, x, y, last):
    xin = x.detach().requires_grad_(x.is_floating_point())
    start = time.perf_counter()
    out = layer(xin)
    loss = gpt_loss(out, y) if last else out
    mid = time.perf_counter()
    wrt = [t for t in [xin, *layer.parameters()] if t.requires_grad]
    torch.autograd.grad(loss, wrt, torch.ones_like(loss))
    return mid - start, time.perf_counter() - mid, out.detach()


def measure(cfg: GPTConfig, samples=(1, 8), dtype=torch.float32, repeats: int = 10, seed: int = 0,
            statistic=min) -> LayerTimes:
    """Time each layer of the dense tiny GPT alone at two micro-batch sizes and fit a line per layer;
    count its saved activations; time one AdamW step per parameter. statistic: of the `repeats`
    tries; min (the default, as timeit) on a quiet machine; statistics.median on ranks running
    at once, where waiting for a core is part of the time."""
    lo, hi = samples
    layers = gpt_layers(cfg, seed, dtype)
    ids = torch.randint(0, cfg.vocab, (hi, cfg.seq), generator=torch.Generator().manual_seed(seed))
    tries, threads = {}, torch.get_num_threads()  # (n samples, layer) -> [(forward, backward), ...]
    torch.set_num_threads(1)                    # as on a launched rank
    for rep in range(repeats + 1):              # round 0 warms up; sizes take turns against bursts of load
        for n in (lo, hi):
            x = ids[:n]
            for i, layer in enumerate(layers):
                f, b, x = _time_once(layer, x, ids[:n], i == len(layers) - 1)
                if rep:
                    tries.setdefault((n, i), []).append((f, b))
    best = {key: (statistic(f for f, _ in v), statistic(b for _, b in v)) for key, v in tries.items()}
    saved, x = [], ids[:hi]
    for i, layer in enumerate(layers):
        with saved_activations(layer.parameters()) as s:
            out = layer(x.detach().requires_grad_(x.is_floating_point()))
            if i == len(layers) - 1:
                gpt_loss(out, ids[:hi])
        saved.append(s.bytes / hi / torch.finfo(dtype).bits * 8)      # in elements: any dtype_bytes
        x = out.detach()
    params = [p for layer in layers for p in layer.parameters()]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt, steps = torch.optim.AdamW(params), []
    for _ in range(repeats):
        start = time.perf_counter()
        opt.step()
        steps.append(time.perf_counter() - start)
    step = statistic(steps)
    torch.set_num_threads(threads)

    def line(k):                                # (fixed, per sample) through the two sizes
        per = [max(0.0, (best[hi, i][k] - best[lo, i][k]) / (hi - lo)) for i in range(len(layers))]
        return [max(0.0, best[lo, i][k] - lo * s) for i, s in enumerate(per)], per
    (ff, fs), (bf, bs) = line(0), line(1)
    size = torch.finfo(dtype).bits // 8
    return LayerTimes(ff, fs, bf, bs, saved, step / sum(p.numel() for p in params), source=f"measured here, {dtype}",
                      saved_parallel=[n / size for n in parallel_saved(cfg, 1, False, size)])


def parallel_saved(cfg: GPTConfig, t: int = 1, sequence_parallel: bool = False, dtype_bytes: int = 4) -> list:
    """Bytes per sample that each pipeline layer of the tensor-parallel tiny GPT (models.gpt's
    parallel_layers + gpt_loss) keeps for backward on one rank of t (rank 0: the largest shard),
    counted tensor by tensor (tests/test_planner.py holds it against what runs at tp = 2, 4 keep):

      embedding  the ids it looks up (int64) and the mask of my tokens (bool)
      block      replicated, so cut by t only with SP: the 2 LayerNorms' inputs and normalised
                 outputs [s, h] and their mean and 1/std [s];
                 split over t: q, k and v (copied to [b·a/t, s, d] for the batched products),
                 the softmax's s×s probabilities of my a/t heads (Korthikanti's 5as/h term:
                 kept because the attention is unfused), the attention output [s, h/t], fc1's
                 output (GeLU's input) and GeLU's output [s, ffn/t]
      head       LayerNorm's input, mean and 1/std (cut by t with SP), its output [s, h] (gathered
                 whole with SP), the softmax of my vocabulary slice [s, V/t], targets (int64), mask
    """
    s, h, a, d = cfg.seq, cfg.hidden, cfg.heads, dtype_bytes
    cut = t if sequence_parallel else 1
    h_t, a_t, f_t, v_t = h // t, a // t, split_sizes(cfg.ffn, t)[0], split_sizes(cfg.vocab, t)[0]
    ids_and_mask = s * (8 + 1)
    block = d * ((4 * s * h + 4 * s) / cut + 3 * s * h_t + a_t * s * s + s * h_t + 2 * s * f_t)
    head = d * ((s * h + 2 * s) / cut + s * h + s * v_t) + ids_and_mask
    return [ids_and_mask] + [block] * cfg.layers + [head]


def layer_params(cfg: GPTConfig, tp: int) -> list:
    """Parameters per pipeline layer on tp rank 0 (the largest shard: splits as torch.tensor_split)."""
    h, f, v = cfg.hidden, cfg.ffn, cfg.vocab
    V, F, H3 = split_sizes(v, tp)[0], split_sizes(f, tp)[0], split_sizes(3 * h, tp)[0]
    block = 4 * h + (H3 * h + H3) + (h * h // tp + h) + (h * F + F) + (F * h + h)
    return [V * h + cfg.seq * h] + [block] * cfg.layers + [2 * h + h * V]


def estimate(cfg: GPTConfig, flops_per_s: float = 2e10) -> LayerTimes:
    """A stand-in for shapes too big to time here: 2 FLOPs per parameter per token forward (+ attention's
    4·s·h), backward twice that, at `flops_per_s`; activations by Korthikanti's formula (chapter 5)."""
    s, h = cfg.seq, cfg.hidden
    per_token = [2 * n for n in layer_params(cfg, 1)]
    per_token[0] = 0                                    # the embedding is a lookup, not a product
    per_token[1:-1] = [f + 4 * s * h for f in per_token[1:-1]]
    fwd = [f * s / flops_per_s for f in per_token]
    saved = [s * h] + [activation_bytes_formula(s, 1, h, cfg.heads, 1, False) / 2] * cfg.layers + [2 * s * cfg.vocab]
    zeros = [0.0] * len(fwd)
    return LayerTimes(zeros, fwd, zeros, [2 * f for f in fwd], saved, 10 / flops_per_s,
                      source=f"estimated from FLOPs at {flops_per_s:.2g} FLOP/s")


# ----------------------------------------------------------------------------------
# More ranks than cores (this machine): what running at once adds, measured


def contention(cfg: GPTConfig, batch: int, iters: int = 40, steps: int = 8):
    """Call on every launched rank, all at once: (one plain training step's time, no communication; the
    extra time per latency round of tiny all-reduces on 2-rank groups between bursts of compute), each
    the median over tries of the slowest rank, as a step of training waits for its slowest rank."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*gpt_layers(cfg, 0, torch.float32))
    opt, ids = torch.optim.AdamW(model.parameters()), torch.randint(0, cfg.vocab, (batch, cfg.seq))
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)]
    group = pairs[min(rank // 2, len(pairs) - 1)] if rank < 2 * len(pairs) else None
    a, x = torch.randn(96, 96), torch.zeros(256)

    def timed(work, repeats):                  # median over tries of the slowest rank's time, as a step is
        out = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            work()
            took = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            out.append(took.item())
        return statistics.median(out[1:])

    def step():
        gpt_loss(model(ids), ids).backward()
        opt.step()
        opt.zero_grad()

    def loop(talk):
        for _ in range(iters):
            for _ in range(8):
                a @ a
            if talk and group is not None:
                dist.all_reduce(x, group=group)
    plain = timed(step, steps)
    wait = max(0.0, timed(lambda: loop(True), 4) - timed(lambda: loop(False), 4)) / iters / 2   # 2 rounds
    return plain, wait
