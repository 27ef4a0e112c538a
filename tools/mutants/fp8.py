# Chapter 11b's library (pplab/fp8.py, pplab/zero/fp8_gather.py): one-line bugs its tests must catch
# (tests/test_fp8.py). Run with tools/mutate.py's names in scope (see tools/mutants/README.md).

FP8_TESTS = T("test_fp8")

MUTANTS += [
    Mutant("pplab/fp8.py", "return x.float().clamp(-f.max, f.max).to(f.dtype)", "return x.float().to(f.dtype)",
           FP8_TESTS, "fp8: no clamp before the cast (e5m2 overflows to inf)"),
    Mutant("pplab/fp8.py", "padded = torch.zeros(nr * tr, nc * tc)", "padded = torch.ones(nr * tr, nc * tc)",
           FP8_TESTS, "fp8: a ragged tile padded with ones takes part in its amax"),
    Mutant("pplab/fp8.py", "return padded.view(nr, tr, nc, tc).amax(dim=(1, 3))",
           "return padded.view(nr, tr, nc, tc).amax(dim=(1, 3)) if tr == 1 else padded.view(nr, tr, nc, tc)[:, 0].amax(dim=2)",
           FP8_TESTS, "fp8: a tile's amax from its first row only"),
    Mutant("pplab/fp8.py", "amax = max(self.amaxes) if self.amaxes else amax_now", "amax = amax_now",
           FP8_TESTS, "fp8: delayed scaling that uses the current amax (no history)"),
    Mutant("pplab/fp8.py", "return gq @ wq, gq.t() @ xq, None, None", "return g @ wq, g.t() @ xq, None, None",
           FP8_TESTS, "fp8: the output gradient not rounded in backward"),
    Mutant("pplab/zero/fp8_gather.py", "return shard_numel + SCALE_BYTES * math.ceil(shard_numel / block)",
           "return shard_numel + SCALE_BYTES * (shard_numel // block)", FP8_TESTS,
           "fp8 FSDP: the ragged last tile's scale left out of the bytes"),
    Mutant("pplab/zero/fp8_gather.py", "u.full.copy_(torch.cat(pieces, dim=1).view(-1).to(u.full.dtype))",
           "u.full.copy_(torch.cat(pieces[::-1], dim=1).view(-1).to(u.full.dtype))", FP8_TESTS,
           "fp8 FSDP: the gathered shards put in reverse rank order"),
]
