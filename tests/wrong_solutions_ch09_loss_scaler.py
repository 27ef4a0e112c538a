"""Plausible wrong answers to chapter 9b's loss scaler, as in wrong_solutions_ch00_broadcast.py: WRONG[exercise_id]
lists (answer, regular expressions the check's message must match, timeout or None);
tests/test_checks.py checks that each fails with its message.

Each is `Scaler` (a correct answer, written apart from the solution notebook's: the decision by an
all-reduce of the count of ranks that overflowed) with one method changed.
"""
import torch

from pplab import comm


class Scaler:
    def __init__(self, init_scale=2.0**16, growth_interval=2000):
        self.scale, self.interval, self.good = float(init_scale), growth_interval, 0

    def grads(self, optimizer):
        return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]

    def unscale(self, grads):
        for g in grads:
            g.mul_(1.0 / self.scale)

    def overflow(self, grads):
        count = torch.tensor([0.0 if all(torch.isfinite(g).all() for g in grads) else 1.0])
        comm.all_reduce(count)                          # how many ranks overflowed
        return count.item() > 0

    def grow_or_back_off(self, overflow):
        if overflow:
            self.scale, self.good = self.scale / 2, 0
        else:
            self.good += 1
            if self.good == self.interval:
                self.scale, self.good = self.scale * 2, 0

    def step(self, optimizer):
        grads = self.grads(optimizer)
        self.unscale(grads)
        overflow = self.overflow(grads)
        if not overflow:
            optimizer.step()
        self.grow_or_back_off(overflow)
        return not overflow


class DecidesPerRank(Scaler):
    def overflow(self, grads):                          # each rank looks at its own shard only
        return not all(torch.isfinite(g).all() for g in grads)


class NeverGrows(Scaler):
    def grow_or_back_off(self, overflow):
        if overflow:
            self.scale /= 2


class ForgetsToUnscale(Scaler):
    def unscale(self, grads):
        pass


class SkipsButStillUpdates(Scaler):
    def step(self, optimizer):
        grads = self.grads(optimizer)
        self.unscale(grads)
        overflow = self.overflow(grads)
        optimizer.step()                                # the skip only halves the scale
        self.grow_or_back_off(overflow)
        return not overflow


class Rank0Decides(Scaler):
    def overflow(self, grads):                          # rank 0 checks its own shard and tells the others
        flag = torch.tensor([0.0 if all(torch.isfinite(g).all() for g in grads) else 1.0])
        comm.broadcast(flag, src=0)
        return flag.item() > 0



# Near misses (issue 38): right on 2 ranks only, wrong on a rank other than 0 only, just outside 1e-6.

class NeighbourFlagScaler(Scaler):
    def overflow(self, grads):                          # swaps flags with its ring neighbours only
        rank, p = comm.rank(), comm.world_size()
        mine = torch.tensor([0.0 if all(torch.isfinite(g).all() for g in grads) else 1.0])
        heard = torch.zeros(1)
        comm.exchange(mine, (rank + 1) % p, heard, (rank - 1) % p)
        return bool(mine.item() or heard.item())       # on 2 ranks the neighbour is every other rank


class StepsOnRank0Scaler(Scaler):
    def step(self, optimizer):                          # the step guarded like a checkpoint save
        grads = self.grads(optimizer)
        self.unscale(grads)
        overflow = self.overflow(grads)
        if not overflow and comm.rank() == 0:
            optimizer.step()
        self.grow_or_back_off(overflow)
        return not overflow


class HalfPrecisionUnscaleScaler(Scaler):
    def unscale(self, grads):                           # unscaled in the model's half precision
        for g in grads:
            g.copy_((g / self.scale).half())


STEP_RANK = r"after step \d+, rank \d's "
WRONG = {"loss_scaler": [
    (DecidesPerRank, [r"at step \d+ rank\(s\) \[[\d, ]+\] skipped and rank\(s\) \[[\d, ]+\] stepped: the ranks decided apart",
                      r"Only rank [12]'s shard held the overflow", r"\(0 of 3\)"], None),
    (NeverGrows, [STEP_RANK + r"scale is \d+, expected \d+\. [23] steps in a row without overflow: the scale doubles",
                  r"agreement ✔ · update ✔ · scale ✘ \(2 of 3\)"], None),
    (ForgetsToUnscale, [STEP_RANK + r"shard is \[.*\], expected \[.*\]\. That is SGD on the gradient still multiplied "
                        r"by the scale", r"agreement ✔ · update ✘ · scale ✔ \(2 of 3\)"], None),
    (SkipsButStillUpdates, [STEP_RANK + r"shard is \[.*\], expected \[.*\]\. The step was to be skipped \(rank [12]'s "
                            r"gradient overflowed\), but the shard changed", r"agreement ✔ · update ✘ · scale ✔ \(2 of 3\)"], None),
    (Rank0Decides, [r"at step \d+ every rank stepped, but rank [12]'s gradient held an inf or NaN \(in its shard "
                    r"only\): every rank must skip", r"not only rank 0's"], None),
    (NeighbourFlagScaler, [r"^world_size=3, .*at step \d+ rank\(s\) \[[\d, ]+\] skipped and rank\(s\) \[[\d, ]+\] "
                           r"stepped: the ranks decided apart", r"all-reduce a flag \(max\)"], None),
    (StepsOnRank0Scaler, [r"after step \d+, rank [12]'s shard is \[.*\], expected \[.*\]\. The shard did not move",
                          r"agreement ✔ · update ✘ · scale ✔ \(2 of 3\)"], None),
    (HalfPrecisionUnscaleScaler, [STEP_RANK + r"shard is \[.*\], expected \[.*\]\.",
                                  r"agreement ✔ · update ✘ · scale ✔ \(2 of 3\)"], None),
]}
