# The loosenings of chapter 11b's checker (fp8_blocks), as issue 38 asks of every checker: the
# tolerance widened 100 times, the cases cut to the tiles that are rows (1×128), the ragged last tiles
# left unchecked. Each is caught by a near-miss wrong answer in tests/wrong_solutions_ch11_fp8_blocks.py.
# Run with tools/mutate.py's names in scope (see tools/mutants/README.md).

FP8 = CHK("fp8_blocks", "scale_with_a_margin or first_row_of_each_tile or ragged_tile_padded_with_ones")

MUTANTS += [
    Mutant("pplab/checks/ch11_frontier/fp8_blocks.py", "TOLERANCE = 1e-5", "TOLERANCE = 1e-3", FP8,
           "FP8 tiles check: tolerance 1e-5 widened 100 times (scale_with_a_margin)"),
    Mutant("pplab/checks/ch11_frontier/fp8_blocks.py", "for (x, tile, what), got in zip(cases, outs):",
           "for (x, tile, what), got in zip(cases[:2], outs):", FP8,
           "FP8 tiles check: 1×128 tiles only, never a tile of several rows (first_row_of_each_tile)"),
    Mutant("pplab/checks/ch11_frontier/fp8_blocks.py", "bad = ~((scales - want).abs() <= TOLERANCE * want + 1e-30)",
           "bad = ~((scales - want).abs() <= TOLERANCE * want + 1e-30); bad[-1, :] = False; bad[:, -1] = False", FP8,
           "FP8 tiles check: the last row and column of tiles (the ragged ones) not compared (ragged_tile_padded_with_ones)"),
]
