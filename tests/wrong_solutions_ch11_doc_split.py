"""Plausible wrong answers to chapter 11c's doc_split, as in wrong_solutions.py: WRONG[exercise_id]
lists (answer, regular expressions the check's message must match, timeout or None);
tests/test_checks.py checks that each fails with its message.

`best_split` is a correct answer written apart from the solution notebook's (dynamic programming
over where the last range starts, not bisection); each wrong one changes one step of it or of what
it counts. The near misses: `cuts_rounded_alone` is right for every p = 2 problem and wrong at
p = 3 and 4; `skips_a_token_before_the_last_rank` is wrong on the last rank only;
`just_short_of_the_best` is a few score pairs above the best (the check compares integers:
no tolerance; a check against the bound total/p + the largest token's work lets it pass). CLOSE_BUT_RIGHT: other best splits (ties broken the other way, lists for
tuples) must pass.
"""
from pplab.sequence_parallel.packed import doc_split as the_librarys_own_function   # handed in as it is
from pplab.split import split_sizes


def token_work(doc_lens, forgets_itself=False, late_reset=False):
    """Each token's score pairs: the t-th token of its document sees t keys."""
    work = []
    for d, n in enumerate(doc_lens):
        for t in range(1, n + 1):
            if late_reset and d > 0 and t == 1:
                work.append(work[-1] + 1)           # still counting the document before
            else:
                work.append(t - 1 if forgets_itself else t)
    return work


def best_split(doc_lens, p, work=None, latest=False):
    """The least busiest range, by dynamic programming; `latest`: among equal choices, the latest cut."""
    work = token_work(doc_lens) if work is None else work
    S = len(work)
    prefix = [0]
    for w in work:
        prefix.append(prefix[-1] + w)
    best = {(0, 0): (0, None)}                      # (ranges, tokens) -> (busiest, where the last range starts)
    for k in range(1, p + 1):
        for i in range(S + 1):
            options = [(max(best[k - 1, j][0], prefix[i] - prefix[j]), j) for j in range(i + 1) if (k - 1, j) in best]
            if options:
                value = min(v for v, _ in options)
                best[k, i] = (value, max(j for v, j in options if v == value) if latest
                              else min(j for v, j in options if v == value))
    cuts, i = [S], S
    for k in range(p, 0, -1):
        i = best[k, i][1]
        cuts.append(i)
    cuts.reverse()
    return [(cuts[r], cuts[r + 1]) for r in range(p)]


def doc_split(doc_lens, p):                         # noqa: F811 - the right answer, for reference
    return best_split(doc_lens, p)


def balances_tokens(doc_lens, p):
    bounds = [0]
    for n in split_sizes(sum(doc_lens), p):         # equal tokens, the first ranks one more
        bounds.append(bounds[-1] + n)
    return [(bounds[r], bounds[r + 1]) for r in range(p)]


def forgets_itself(doc_lens, p):
    return best_split(doc_lens, p, token_work(doc_lens, forgets_itself=True))


def resets_late_at_document_boundaries(doc_lens, p):
    return best_split(doc_lens, p, token_work(doc_lens, late_reset=True))


def cuts_rounded_alone(doc_lens, p):
    """Each cut at the token boundary nearest to k/p of the work, chosen alone: the best for one cut."""
    work = token_work(doc_lens)
    prefix = [0]
    for w in work:
        prefix.append(prefix[-1] + w)
    cuts = [0]
    for k in range(1, p):
        goal = k * prefix[-1] / p
        cuts.append(min(range(len(prefix)), key=lambda i: (abs(prefix[i] - goal), -i)))   # a tie: the later
    cuts.append(len(work))
    return [(cuts[r], cuts[r + 1]) for r in range(p)]


def fills_each_rank_to_the_mean(doc_lens, p):
    """Greedy: each rank takes tokens while it stays under the mean work; the last takes the rest."""
    work, out, start = token_work(doc_lens), [], 0
    target = sum(work) / p
    for r in range(p - 1):
        stop, total = start, 0
        while stop < len(work) and total + work[stop] <= target:
            total += work[stop]
            stop += 1
        out.append((start, stop))
        start = stop
    return out + [(start, len(work))]


def skips_a_token_before_the_last_rank(doc_lens, p):
    ranges = best_split(doc_lens, p)
    a, b = ranges[-1]
    ranges[-1] = (min(a + 1, b), b)                 # "the last rank starts after the one before stops"
    return ranges


def inclusive_stops(doc_lens, p):
    return [(a, b - 1) for a, b in best_split(doc_lens, p)]


def returns_the_cut_points(doc_lens, p):
    ranges = best_split(doc_lens, p)
    return [a for a, _ in ranges] + [ranges[-1][1]]


def just_short_of_the_best(doc_lens, p):
    """The nearest miss: of the splits whose cuts lie within 3 tokens of the best split's, one whose
    busiest range has the least work above the best (a few score pairs too many)."""
    import itertools
    work, ranges = token_work(doc_lens), best_split(doc_lens, p)
    S, cuts = len(work), [a for a, _ in ranges[1:]]
    best = max(sum(work[a:b]) for a, b in ranges)
    nearest, found = None, ranges
    for moves in itertools.product(range(-3, 4), repeat=p - 1):
        bounds = [0] + [c + m for c, m in zip(cuts, moves)] + [S]
        if any(a > b for a, b in zip(bounds, bounds[1:])):
            continue
        busiest = max(sum(work[a:b]) for a, b in zip(bounds, bounds[1:]))
        if best < busiest and (nearest is None or busiest < nearest):
            nearest, found = busiest, [(bounds[r], bounds[r + 1]) for r in range(p)]
    return found


def calls_the_library(doc_lens, p):
    from pplab.sequence_parallel import packed
    return packed.doc_split(doc_lens, p)


def best_split_latest_cuts_as_lists(doc_lens, p):
    return [[a, b] for a, b in best_split(doc_lens, p, latest=True)]


BUSIEST = r"^problem \d+ \(documents \[[\d, ]+\], p = \d\): your ranges .* the busiest has \d+, but a split whose busiest has \d+ exists"
WRONG = {
    "doc_split": [
        (the_librarys_own_function, [r"you handed in pplab\.sequence_parallel\.packed's own function"], None),
        (balances_tokens, [BUSIEST, r"balances tokens, not work"], None),
        (forgets_itself, [BUSIEST, r"a token sees itself too"], None),
        (resets_late_at_document_boundaries, [BUSIEST, r"starts a document's count one token late"], None),
        (cuts_rounded_alone, [r"p = [34]\): your ranges", r"for more the cuts must be chosen together"], None),
        (fills_each_rank_to_the_mean, [BUSIEST], None),
        (skips_a_token_before_the_last_rank, [r"rank [123]'s range is \(\d+, \d+\): it must start at rank [012]'s stop"],
         None),
        (inclusive_stops, [r"rank 1's range is .* the stop is the first token not included"], None),
        (returns_the_cut_points, [r"must return a list of p = \d ranges"], None),
        (just_short_of_the_best, [BUSIEST], None),
        (calls_the_library, [r"you use pplab\.sequence_parallel\.packed, the library's answer"], None),
    ],
}

CLOSE_BUT_RIGHT = {"doc_split": [best_split_latest_cuts_as_lists]}
