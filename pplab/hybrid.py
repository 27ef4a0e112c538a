"""Hybrid parallelism: the tiny GPT trained on a device mesh, TP inside a stage, PP across
stages, data parallelism (DDP or ZeRO) across replicas, every piece from an earlier chapter.

    cfg = GPTConfig(vocab=len(pplab.data.VOCAB))
    out = pplab.launch(train, cfg, dict(dp=2, tp=2), world_size=4, steps=10)
    out[0]["losses"]            # the global batch's mean loss after each step: as on one process
    train_single(cfg, steps=10) # ... which is this

What each rank does, in order:

1. `Mesh(**sizes)` (pplab.mesh) places it: its tp group (the ranks that split each layer), its
   pp group (one rank per stage: its stage index is its pp coordinate), its dp group (the
   replicas that hold the same shards and split the batch).
2. Every rank builds the same dense model (`gpt_layers`, same seed) and keeps its tensor-parallel
   shard (`parallel_layers(..., group=tp)`: chapter 3's layers, chapter 5's sequence parallelism).
3. pp = 1: the shards form one nn.Sequential. pp > 1: chapter 4's PipelineExecutor, given the pp
   group, cuts them into stages (the same cut on every rank: by the dense model's parameter
   counts) and runs the schedule over m micro-batches.
4. Each dp replica takes its share of the global batch (`data_parallel.shard`). Gradients are
   averaged over the dp group by chapter 2 or chapter 6, each step:
   zero=0, pp = 1: DDP, its bucketed all-reduces overlapped with backward;
   zero=0, pp > 1: a pipeline runs one backward per micro-batch, and DDP's hooks would sync each
     of them: the same bucketed all-reduce (`all_reduce_gradients`) runs once, after the flush;
   zero=1, 2: ZeroOptimizer (reduce-scatter, step my shard, all-gather);
   zero=3: FullyShardedModule around the model (pp = 1) or around each of my stages (pp > 1):
     parameters gathered unit by unit for every forward and backward, gradients reduce-scattered.

Why the order pp, dp, tp (tp innermost): TP talks twice per block per micro-batch (forward and
backward all-reduces of [s, b, h]), so its ranks should be the closest; DP talks once per step
(the gradients); PP sends one activation per micro-batch between neighbouring stages only.
"""
from __future__ import annotations

import contextlib
import functools
import time

import torch
import torch.distributed as dist
from torch import nn

from . import data, trace
from .memory import saved_activations
from .data_parallel import DDP, all_reduce_gradients, shard
from .runtime.launcher import device as rank_device
from .mesh import DIMS, Mesh
from .models.gpt import GPTConfig, gpt_layers, gpt_loss, parallel_layers
from .pipeline import PipelineExecutor, make_schedule, partition
from .zero import FullyShardedModule, ZeroOptimizer, held_bytes

__all__ = ["train", "train_single", "check_layout", "comm_rows", "draw_mesh", "layouts", "describe_layout", "GPTConfig"]


def check_layout(cfg: GPTConfig, sizes: dict, batch_size: int, microbatches: int = 1, zero: int = 0,
                 sequence_parallel: bool = False, world_size: int | None = None, schedule: str = "1f1b") -> dict:
    """Refuse, with what to change, a layout this model or batch cannot run. Returns the full sizes.
    pplab.planner asks it too, so the planner lists only layouts that train runs."""
    unknown = set(sizes) - set(DIMS)
    if unknown or any(sizes.get(d, 1) != 1 for d in ("ep", "cp")):
        raise ValueError(f"the tiny GPT trains on dp, tp and pp (got {sizes}): it has no experts (ep) "
                         f"and no context parallelism (cp)")
    dp, tp, pp = (sizes.get(d, 1) for d in ("dp", "tp", "pp"))
    if not all(isinstance(n, int) and n >= 1 for n in (dp, tp, pp)):
        raise ValueError(f"mesh sizes must be whole numbers >= 1, got dp={dp}, tp={tp}, pp={pp}")
    if world_size is not None and dp * tp * pp != world_size:
        raise ValueError(f"dp·tp·pp = {dp}·{tp}·{pp} = {dp * tp * pp} but the world has {world_size} ranks: "
                         f"choose sizes whose product is {world_size}")
    if cfg.heads % tp:
        raise ValueError(f"the model has {cfg.heads} attention heads, which tp={tp} does not divide: "
                         f"use tp in {[t for t in range(1, cfg.heads + 1) if cfg.heads % t == 0]}")
    if cfg.vocab < tp:
        raise ValueError(f"a vocabulary of {cfg.vocab} tokens cannot be split over tp={tp} ranks")
    if sequence_parallel and cfg.seq % tp:
        raise ValueError(f"sequence parallelism cuts the {cfg.seq} positions into tp={tp} equal slices: "
                         f"use a sequence length divisible by {tp}")
    stages, split_backward = _schedule_shape(schedule, pp, microbatches) if pp > 1 else (1, False)
    if cfg.layers + 2 < stages:
        chunks = f" × {stages // pp} chunks ({schedule}) = {stages}" if stages > pp else ""
        raise ValueError(f"pp={pp}{chunks} stages, but the model has only {cfg.layers + 2} pipeline layers "
                         f"(embedding, {cfg.layers} blocks, head): use pp <= {(cfg.layers + 2) // (stages // pp)} "
                         f"or more layers")
    if batch_size % dp:
        raise ValueError(f"a global batch of {batch_size} sequences does not split over dp={dp} replicas: "
                         f"use a batch that is a multiple of {dp}")
    if pp > 1 and batch_size // dp < microbatches:
        raise ValueError(f"each replica gets {batch_size // dp} sequences, too few for {microbatches} "
                         f"micro-batches: use microbatches <= {batch_size // dp} or a larger batch")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero!r}: use 0 (DDP), 1 or 2 (ZeroOptimizer), 3 (FullyShardedModule)")
    if zero >= 2 and dp > 1 and split_backward:
        raise ValueError(f"zero={zero} with the {schedule} schedule: it splits each backward into I and W "
                         f"(torch.autograd.grad), which run no gradient hooks, and ZeRO-{zero} reduce-scatters "
                         f"from those hooks; use zero=1, or a schedule with whole backwards (1f1b, gpipe, "
                         f"interleaved-1f1b)")
    if zero == 2 and dp > 1 and stages > pp:
        raise ValueError(f"zero=2 with the {schedule} schedule: each rank holds {stages // pp} chunks, and one "
                         f"backward runs through one chunk only, while ZeRO-2 reduce-scatters a bucket once every "
                         f"parameter in it has its gradient (all of the rank's chunks): use zero=1 or 3, or a "
                         f"schedule with one stage per rank (1f1b, gpipe)")
    return {d: sizes.get(d, 1) for d in DIMS}


@functools.lru_cache(maxsize=256)
def _schedule_shape(schedule: str, pp: int, microbatches: int) -> tuple:
    """(stages the model is cut into, whether backward splits into I and W) of a named schedule."""
    sched = make_schedule(schedule, num_stages=pp, num_microbatches=microbatches)
    return sched.num_stages, sched.split_backward


def _optimizer(params, lr, zero, dp, group):
    params = list(params)
    if zero and dp > 1:                # stage 3: params are FullyShardedModule's shards, stepped as they are
        return ZeroOptimizer(params, torch.optim.AdamW, stage=zero, group=group, lr=lr)
    return torch.optim.AdamW(params, lr=lr)


def train(cfg: GPTConfig, mesh, steps: int = 5, batch_size: int = 8, lr: float = 3e-3, microbatches=None,
          schedule: str = "1f1b", zero: int = 0, sequence_parallel: bool = False, seed: int = 0,
          dtype=torch.float64, trace_steps=None, before_step=None) -> dict:
    """Train on this rank's place in `mesh` (a Mesh, or its sizes as a dict); call it on every rank.

    microbatches: per step and replica, for pp > 1 (default: 2·pp, as many as the batch allows).
    trace_steps: the steps whose events stay in the trace (default: all); others are paused, e.g.
    trace_steps={2} to draw one step after the first ones (which also check shapes) are done.
    before_step: called as before_step(model, optimizer, mesh) once the step's gradients are final
    (after DP's all-reduce), just before optimizer.step(): e.g. pplab.grad_clip.clip_grad_norm_.
    Returns {"losses": the global batch's mean loss at each step (on every rank), "step_times":
    seconds per step (barrier to barrier), "step_cpu_times": the CPU seconds this rank's process
    spent in each step (its work, without its waiting: unlike step_times, load does not grow them),
    "state_bytes": parameters + gradients + optimizer state
    this rank holds after the optimizer step, before zero_grad (pplab.zero.held_bytes),
    "activation_bytes": the most bytes autograd held for backward at once, "params":
    {"layer.name": this rank's shard after training}, "coords": its place in the mesh}.
    """
    sizes = mesh.sizes if isinstance(mesh, Mesh) else dict(mesh)
    world = dist.get_world_size() if dist.is_initialized() else 1
    pp, dp = sizes.get("pp", 1), sizes.get("dp", 1)
    m = microbatches or (min(2 * pp, batch_size // dp) if pp > 1 else 1)
    check_layout(cfg, sizes, batch_size, m, zero, sequence_parallel, world, schedule)
    dev = rank_device()                # its GPU under NCCL, else the CPU
    # building (broadcasts, shape checks) is not drawn when the steps to draw are chosen
    with trace.paused() if trace_steps is not None else contextlib.nullcontext():
        mesh = mesh if isinstance(mesh, Mesh) else Mesh(**sizes)
        tp_group = mesh.tp_group if mesh.size("tp") > 1 else None
        dense = [layer.to(dev) for layer in gpt_layers(cfg, seed, dtype)]
        layers = parallel_layers(dense, tp_group, sequence_parallel) if tp_group is not None else dense

        def loss_fn(logits, targets):
            return gpt_loss(logits, targets, tp_group, cfg.vocab)

        sharded = zero == 3 and dp > 1             # ZeRO-3: the parameters themselves cut over dp

        def fully_sharded(module):
            return FullyShardedModule(module, group=mesh.dp_group)

        if pp > 1:
            sched = make_schedule(schedule, num_stages=pp, num_microbatches=m)
            cut = [e - s for s, e in partition(dense, sched, "params")]   # the dense counts: one cut for all ranks
            runner = PipelineExecutor(sched, layers, loss_fn, balance=cut, group=mesh.pp_group,
                                      wrap_stage=fully_sharded if sharded else None)
            model = nn.ModuleList(runner.stages.values())
        else:
            model = nn.Sequential(*layers)
            if sharded:
                model = fully_sharded(model)
            elif dp > 1 and zero == 0:
                model = DDP(model, group=mesh.dp_group)
        opt = _optimizer(model.parameters(), lr, zero, dp, mesh.dp_group)

    losses, times, cpu_times, activation_bytes = [], [], [], 0
    for step in range(steps):
        x, y = (t.to(dev) for t in shard(data.batch(batch_size, cfg.seq, step, seed), mesh.rank_in("dp"), dp))
        with (trace.paused() if trace_steps is not None and step not in trace_steps else contextlib.nullcontext()):
            with trace.paused():
                dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            if pp > 1:
                loss = runner.step(x, y)["loss"]
                activation_bytes = max(activation_bytes, runner.peak_bytes)
                if zero == 0 and dp > 1:               # once, after the last micro-batch's backward
                    all_reduce_gradients(model.parameters(), mesh.dp_group)
                if before_step is not None:
                    before_step(model, opt, mesh)
                opt.step()
            else:
                with saved_activations(list(model.parameters()) + list(getattr(model, "module", model).parameters()),
                                       moving=sharded, slices=True) as saved:
                    loss = loss_fn(model(x), y)
                activation_bytes = max(activation_bytes, saved.bytes)
                loss.backward()
                if before_step is not None:
                    before_step(model, opt, mesh)
                opt.step()
                loss = loss.item()
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - start_cpu)
            state_bytes = held_bytes(model, opt)["total"]      # at its peak: gradients still held
            opt.zero_grad()
        with trace.paused():             # the global loss, for the report: one number, untraced
            mine = loss if loss is not None and mesh.rank_in("tp") == 0 else 0.0   # the last stage's (V: on pp rank 0)
            total = torch.tensor([mine], dtype=torch.float64, device=dev)
            dist.all_reduce(total)
        losses.append(total.item() / dp)

    with trace.paused(), contextlib.ExitStack() as whole:
        if sharded:                                  # ZeRO-3: gather my layers whole to report them
            for module in (runner.stages.values() if pp > 1 else [model]):
                whole.enter_context(module.full_parameters())
        named = runner.named_parameters() if pp > 1 else getattr(model, "module", model).named_parameters()
        params = {n: p.detach().clone() for n, p in named}
    return {"losses": losses, "step_times": times, "step_cpu_times": cpu_times, "coords": mesh.coords,
            "state_bytes": state_bytes, "activation_bytes": activation_bytes, "params": params}


def train_single(cfg: GPTConfig, steps: int = 5, batch_size: int = 8, lr: float = 3e-3, seed: int = 0,
                 dtype=torch.float64, before_step=None):
    """The reference: the same model, data and optimizer on one process. Returns (losses, layers).
    before_step(model, optimizer), if given, runs between backward and optimizer.step()."""
    layers = gpt_layers(cfg, seed, dtype)
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = data.batch(batch_size, cfg.seq, step, seed)
        loss = gpt_loss(model(x), y)
        loss.backward()
        if before_step is not None:
            before_step(model, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, layers


def comm_rows(sizes: dict) -> dict:
    """For swimlane.draw(comm_rows=...): each rank's traffic on the row of the mesh dimension it
    serves. TP: collectives over the rank's tp group; PP: sends and receives; DP: collectives over
    its dp group (DDP's all-reduces, ZeRO's reduce-scatters and all-gathers)."""
    from .mesh import groups
    full = {d: sizes.get(d, 1) for d in DIMS}

    def over(dim):
        mine = {r: tuple(g) for g in groups(dim, **full) for r in g}
        return lambda e: e.group is not None and tuple(e.group) == mine[e.rank] and len(e.group) > 1
    return {"TP": over("tp"), "PP": lambda e: e.kind in ("send", "recv"), "DP": over("dp")}


def draw_mesh(sizes: dict, dims=("tp", "dp", "pp")):
    """The mesh as a picture: every global rank a square, one pp stage per block of dp rows × tp
    columns; one panel per dimension, its groups told apart by colour. Returns the figure."""
    import matplotlib.pyplot as plt
    from .mesh import groups
    full = {d: sizes.get(d, 1) for d in DIMS}
    pp, dp, tp = full["pp"], full["dp"], full["tp"]
    where = {r: (c % (pp * dp * tp) // (dp * tp) * (tp + 1) + c % tp, c // tp % dp)
             for r, c in enumerate(range(pp * dp * tp))}
    fig, axes = plt.subplots(1, len(dims), figsize=(2.2 * len(dims) * max(1, (pp * (tp + 1)) / 3.5), 0.9 + 0.8 * dp),
                             squeeze=False)
    colours = plt.get_cmap("tab10").colors
    for ax, dim in zip(axes[0], dims):
        for i, g in enumerate(groups(dim, **full)):
            for r in g:
                x, y = where[r]
                ax.add_patch(plt.Rectangle((x, -y), 0.9, -0.9, color=colours[i % 10], alpha=0.85))
                ax.text(x + 0.45, -y - 0.45, str(r), ha="center", va="center", fontsize=11, color="white",
                        weight="bold")
        ax.set_xlim(-0.2, pp * (tp + 1) - 0.8)
        ax.set_ylim(-dp - 0.4, 0.5)
        ax.set_aspect("equal")
        ax.axis("off")
        n = len(groups(dim, **full))
        ax.set_title(f"{dim}: {n} group{'s' * (n > 1)} of {full[dim]}, one colour each", fontsize=10)
        if pp > 1:
            for st in range(pp):
                ax.text(st * (tp + 1) + tp / 2 - 0.05, 0.25, f"stage {st}", ha="center", fontsize=8, color="#555555")
    fig.suptitle(f"{describe_layout(full)}: global ranks, rows = dp index, columns = tp index", fontsize=10)
    fig.tight_layout()
    plt.close(fig)
    return fig


def layouts(world_size: int, pp_max: int | None = None) -> list[dict]:
    """Every dp × tp × pp factorisation of world_size (for tables and plans)."""
    out = []
    for pp in range(1, world_size + 1):
        for tp in range(1, world_size + 1):
            if world_size % (pp * tp) == 0 and (pp_max is None or pp <= pp_max):
                out.append({"dp": world_size // (pp * tp), "tp": tp, "pp": pp})
    return out


def describe_layout(sizes: dict) -> str:
    """'dp=2×tp=2' for {'dp': 2, 'tp': 2, 'pp': 1}."""
    used = [f"{d}={sizes[d]}" for d in ("pp", "dp", "tp") if sizes.get(d, 1) > 1]
    return "×".join(used) or "1 rank"

