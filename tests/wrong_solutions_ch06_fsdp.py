"""Plausible wrong answers to chapter 6's FSDP capstone (`FSDP`), each a mistake a student could
make, as in wrong_solutions_ch00_broadcast.py: WRONG[exercise_id] lists (answer, regular expressions the check's
message must match, timeout or None). tests/test_checks.py checks that each fails with its message.

Each wrong answer is `FlatViews` (a correct answer written apart from the solution notebook's:
each unit's parameters are views into one flat buffer whose storage shrinks to 0 bytes between
uses, as pplab.zero.FullyShardedModule does; torch.distributed's collectives; gradients divided
by N before the reduce-scatter) with one switch turned.
"""
import torch
import torch.distributed as dist
from torch import nn

from pplab.zero import FullyShardedModule


class FlatViews:
    free = True                    # free each unit's full parameters after its forward and its backward
    reduce = "reduce_scatter"      # or "all_reduce", or None: each rank keeps its own gradient's piece
    divide = True                  # the mean over the ranks, not the sum
    short_last = False             # the last rank's shard one element short of the padding
    master_in_compute_dtype = False
    gather_in_fp32 = False         # the all-gather in fp32, cast after
    compute_in_fp32 = False        # gathered in compute_dtype, then computed in fp32
    only_rank_0_steps = False
    prefetch = True
    sync_prefetch = ()             # the directions (+1 forward, -1 backward) whose prefetch blocks: no async_op
    low_is_fp16 = False            # any 16-bit compute_dtype taken as fp16
    mean_digits = None             # the mean as the sum times 1/N rounded to this many digits

    def __init__(self, units, compute_dtype=torch.float32):
        self.units, self.dtype = list(units), compute_dtype
        if self.low_is_fp16 and compute_dtype != torch.float32:
            compute_dtype = torch.float16
        self.wire = torch.float32 if self.gather_in_fp32 else compute_dtype        # what the all-gather carries
        self.held = torch.float32 if self.compute_in_fp32 else compute_dtype       # what the layers compute in
        self.n, self.me = dist.get_world_size(), dist.get_rank()
        self.params = [list(u.parameters()) for u in self.units]
        self.flats, self.shards, self.sizes, self.pending, self.waiting = [], [], [], {}, {}
        for k, ps in enumerate(self.params):
            numel = sum(q.numel() for q in ps)
            size = -(-numel // self.n)
            master = torch.cat([q.detach().reshape(-1).float() for q in ps] + [torch.zeros(size * self.n - numel)])
            mine = master[self.me * size:(self.me + 1) * size].clone()
            if self.short_last and self.me == self.n - 1 and size * self.n > numel:
                mine = mine[:-1].clone()
            self.shards.append(nn.Parameter(mine.to(compute_dtype if self.master_in_compute_dtype else torch.float32)))
            flat = torch.zeros(size * self.n, dtype=self.held)
            at = 0
            for q in ps:
                q.data = flat[at:at + q.numel()].view_as(q)
                at += q.numel()
                q.register_post_accumulate_grad_hook(lambda q, k=k: self._grad_ready(k, q))
            flat.untyped_storage().resize_(0)
            self.flats.append(flat)
            self.sizes.append(size)
            self.units[k].register_forward_pre_hook(lambda m, a, k=k: self._use(k, +1))
            self.units[k].register_forward_hook(lambda m, a, out, k=k: self._after_forward(k, out))

    def __call__(self, ids):
        for unit in self.units:
            ids = unit(ids)
        return ids

    def _gather(self, k, direction=0):
        if not 0 <= k < len(self.units) or k in self.pending:
            return
        blocking = direction in self.sync_prefetch
        flat = self.flats[k]
        if self.wire == self.held:
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        else:
            flat = torch.empty(flat.numel(), dtype=self.wire)                 # copied into the layers' later
        work = dist.all_gather_into_tensor(flat, self.shards[k].detach().to(self.wire), async_op=not blocking)
        self.pending[k] = flat, work

    def _use(self, k, direction):
        self._gather(k)
        if k in self.pending:
            full, work = self.pending.pop(k)
            if work is not None:                             # None: it blocked, it is done
                work.wait()
            if full is not self.flats[k]:
                self.flats[k].untyped_storage().resize_(full.numel() * self.flats[k].element_size())
                self.flats[k].copy_(full)
        if self.prefetch:
            self._gather(k + direction, direction)

    def _free(self, k):
        if self.free:
            self.flats[k].untyped_storage().resize_(0)

    def _after_forward(self, k, out):
        self._free(k)
        if out.requires_grad:
            out.register_hook(lambda grad: self._use(k, -1))
        self.waiting[k] = {id(q) for q in self.params[k]}

    def _grad_ready(self, k, q):
        self.waiting[k].discard(id(q))
        if self.waiting[k]:
            return
        flat = torch.zeros(self.sizes[k] * self.n, dtype=self.dtype)
        at = 0
        for q in self.params[k]:
            flat[at:at + q.numel()] = q.grad.reshape(-1)
            at += q.numel()
            q.grad = None
        self._free(k)
        if self.divide and self.mean_digits:
            flat *= round(1 / self.n, self.mean_digits)
        elif self.divide:
            flat /= self.n                                   # the mean's division, before the sum
        if self.reduce == "reduce_scatter":
            piece = torch.empty(self.sizes[k], dtype=self.dtype)
            dist.reduce_scatter_tensor(piece, flat)
        else:
            if self.reduce == "all_reduce":
                dist.all_reduce(flat)
            piece = flat[self.me * self.sizes[k]:(self.me + 1) * self.sizes[k]].clone()
        if self.me == 0 or not self.only_rank_0_steps:
            self.shards[k].grad = piece.to(self.shards[k].dtype)


class NeverFrees(FlatViews):
    """Gathers every unit before each use as it should, but never frees one: all of them held whole."""
    free = False


class AllReduceInstead(FlatViews):
    """All-reduces each unit's whole gradient and keeps its piece: right values, twice the bytes."""
    reduce = "all_reduce"


class NoReduceScatter(FlatViews):
    """Forgets to reduce: each rank keeps the piece of its own batch's gradient."""
    reduce = None


class SumNotMean(FlatViews):
    """Reduce-scatters without dividing by N."""
    divide = False


class LastShardOneShort(FlatViews):
    """Off-by-one padding: the last rank's shard is one element short."""
    short_last = True


class MasterInComputeDtype(FlatViews):
    """Keeps the sharded master in compute_dtype (bf16 / fp16) instead of fp32."""
    master_in_compute_dtype = True


class GathersInFp32(FlatViews):
    """All-gathers the fp32 master and casts after: twice the bytes with a 16-bit compute_dtype."""
    gather_in_fp32 = True


class ComputesInFp32(FlatViews):
    """All-gathers in compute_dtype, but the layers compute in fp32: not what compute_dtype asks."""
    compute_in_fp32 = True


class OnlyRank0Steps(FlatViews):
    """Only rank 0 gives its shard the gradient, so only rank 0's shards move (rank 0 only)."""
    only_rank_0_steps = True


class NoPrefetch(FlatViews):
    """Gathers each unit only when it starts: right values and bytes, no overlap."""
    prefetch = False


class PrefetchesSynchronously(FlatViews):
    """Gathers the next unit early, but without async_op=True: the all-gather blocks before unit k
    computes, so nothing overlaps (the order of calls looks like a prefetch)."""
    sync_prefetch = (+1, -1)


class PrefetchesBackwardSynchronously(FlatViews):
    """Prefetches asynchronously in forward, but blocks on the all-gather of the next unit in backward."""
    sync_prefetch = (-1,)


class HalfForAnyLowPrecision(FlatViews):
    """Takes any 16-bit compute_dtype for fp16: right with fp16 (the 2-rank run), not with bf16 (3 ranks)."""
    low_is_fp16 = True


class GradMeanByARoundedThird(FlatViews):
    """The mean as the sum times 1/N written to 4 digits: exact for N = 2 (0.5), 1e-4 too small for
    N = 3 (0.3333): 100 times the fp32 gradients' tolerance (1e-6), lost in bf16's (2^-6)."""
    mean_digits = 4


class GradMeanToNineDigits(FlatViews):
    """Correct: 1/N to 9 digits is off by 1e-9 at most, far inside fp32's 1e-6 (a passing case, in
    tests/test_checks_zero_near.py)."""
    mean_digits = 9


def LibraryFSDP(units, compute_dtype=torch.float32):
    return FullyShardedModule(nn.Sequential(*units))


WHERE = (r"world_size=[23], compute_dtype=(fp32|fp16|bf16), GPT\(vocab=\d+, seq=\d, hidden=\d+, heads=[13], ffn=\d+, "
         r"[12] block\(s\)\), [12] sequence\(s\) per rank, ")
LOW = r"world_size=[23], compute_dtype=(fp16|bf16), "

WRONG = {"fsdp": [
    (NeverFrees,
     [r"^" + WHERE + r"step 1, rank 0: while unit 1 computed its forward, it held [\d,]+ bytes of full parameters "
      r"\(the parameters of units 0, 1, 2", r"more than the [\d,]+ of unit 1 and the prefetched unit 2: free each "
      r"unit's full parameters after its use",
      r"Parts: forward ✔ · backward ✔ · memory ✘ · traffic ✔ · low precision ✘ \(3 of 5\)"], None),
    (AllReduceInstead,
     [r"^" + WHERE + r"step 1, rank 0 called all_reduce on the gradients: an all-reduce sends twice a "
      r"reduce-scatter's bytes", r"Parts: forward ✔ · backward ✔ · memory ✔ · traffic ✘ · low precision ✘ \(3 of 5\)"],
     None),
    (NoReduceScatter,
     [r"^" + WHERE + r"step 1, rank 0's shards\[\d\] \.grad at \d+ \(unit \d \(\w+\), [\w.]+\[[\d, ]*\]\) is .*, "
      r"expected .* It is rank 0's own gradient", r"backward ✘"], None),
    (SumNotMean,
     [r"^" + WHERE + r"step 1, rank 0's shards\[\d\] \.grad .* It is 2 times that: the reduce-scatter sums over the "
      r"ranks; divide by N = 2", r"Parts: forward ✔ · backward ✘ · memory ✔ · traffic ✔ · low precision ✘ \(3 of 5\)"],
     None),
    (LastShardOneShort,
     [r"^world_size=2, compute_dtype=fp32, .*rank 1's shards\[\d\] has \d+ elements; unit \d \(\w+\) has \d+ "
      r"parameters, padded with zeros to 2 × \d+ = \d+: every rank's shard has ceil\(\d+/2\) = \d+ elements",
      r"forward ✘"], None),
    (MasterInComputeDtype,
     [r"^" + LOW + r".*rank 0's shards\[0\] is torch\.(bfloat16|float16): the sharded master stays fp32",
      r"Parts: forward ✔ · backward ✔ · memory ✔ · traffic ✔ · low precision ✘ \(4 of 5\)"], None),
    (GathersInFp32,
     [r"^" + LOW + r".*step 1, rank 0's all-gather in forward of a unit of \d+ elements per shard put in [\d,]+ bytes, "
      r"4 per element, expected 2: all-gather the shard cast to compute_dtype",
      r"Parts: forward ✔ · backward ✔ · memory ✔ · traffic ✔ · low precision ✘ \(4 of 5\)"], None),
    (ComputesInFp32,
     [r"^" + LOW + r".*step \d, rank \d's (loss is \d\.\d{7}, expected \d\.\d{7} \(relative difference|shards\[\d\] "
      r"\.grad at \d+ )",
      r"Parts: forward ✔ · backward ✔ · memory ✔ · traffic ✔ · low precision ✘ \(4 of 5\)"], None),
    (OnlyRank0Steps,
     [r"^" + WHERE + r"step 1, rank 1's shards\[0\] has no \.grad \(None\)\. After backward every rank's shards must "
      r"hold its piece of the mean gradient", r"backward ✘"], None),
    (NoPrefetch,
     [r"^" + WHERE + r"step 1, rank 0 did not prefetch unit 1 in forward: its all-gather started after unit 0 computed",
      r"Parts: forward ✔ · backward ✔ · memory ✔ · traffic ✘ · low precision ✘ \(3 of 5\)"], None),
    (PrefetchesSynchronously,
     [r"^" + WHERE + r"step 1, rank 0 did not prefetch unit 1 in forward: its all-gather started without "
      r"async_op=True", r"Parts: forward ✔ · backward ✔ · memory ✔ · traffic ✘ · low precision ✘ \(3 of 5\)"], None),
    (PrefetchesBackwardSynchronously,
     [r"^" + WHERE + r"step 1, rank 0 did not prefetch unit \d in backward: its all-gather started without "
      r"async_op=True", r"Parts: forward ✔ · backward ✔ · memory ✔ · traffic ✘ · low precision ✘ \(3 of 5\)"], None),
    (HalfForAnyLowPrecision,
     [r"^world_size=3, compute_dtype=bf16, .*: step 1, rank 0's all-gather in forward of a unit of \d+ elements "
      r"per shard put in [\d,]+ bytes|^world_size=3, compute_dtype=bf16, .*, step \d, rank \d's (loss is|shards)",
      r"Parts: forward ✔ · backward ✔ · memory ✔ · traffic ✔ · low precision ✘ \(4 of 5\)"], None),
    (GradMeanByARoundedThird,
     [r"^world_size=3, compute_dtype=fp32, .*, step 1, rank \d's shards\[\d\] \.grad at \d+ .* \(off by "
      r"[-\d.e]+, more than the [-\d.e]+ allowed\)\. Every element is 0\.999\d+ times that: the mean's division by "
      r"N = 3 is off",
      r"Parts: forward ✔ · backward ✘ · memory ✔ · traffic ✔ · low precision ✔ \(4 of 5\)"], None),
    (LibraryFSDP,
     [r"^exercise 'fsdp' asks you to work out the sharding, gathering and reduce-scattering yourself; you use "
      r"pplab\.zero's FullyShardedModule"], None),
]}
