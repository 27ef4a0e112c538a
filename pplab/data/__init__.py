"""A small text to train on, shipped with the package (no download), as character tokens.

    ids = encode(TEXT)                          # one id per character, vocabulary VOCAB
    x, y = batch(batch_size=8, seq=16, step=3)  # [8, 16] windows of the text, y = x shifted by one

The text is a handful of traditional English nursery rhymes (public domain). They repeat
words and lines, so even a tiny model's loss falls well below the uniform guess, ln(|VOCAB|),
within a few dozen steps: a loss curve that means something, on a laptop.
"""
from __future__ import annotations

import torch

TEXT = """\
twinkle, twinkle, little star, how i wonder what you are!
up above the world so high, like a diamond in the sky.
twinkle, twinkle, little star, how i wonder what you are!
mary had a little lamb, its fleece was white as snow;
and everywhere that mary went, the lamb was sure to go.
it followed her to school one day, which was against the rule;
it made the children laugh and play, to see a lamb at school.
jack and jill went up the hill to fetch a pail of water;
jack fell down and broke his crown, and jill came tumbling after.
humpty dumpty sat on a wall, humpty dumpty had a great fall;
all the king's horses and all the king's men
couldn't put humpty together again.
hickory, dickory, dock, the mouse ran up the clock;
the clock struck one, the mouse ran down, hickory, dickory, dock.
baa, baa, black sheep, have you any wool?
yes sir, yes sir, three bags full;
one for the master, and one for the dame,
and one for the little boy who lives down the lane.
little bo peep has lost her sheep, and doesn't know where to find them;
leave them alone, and they'll come home, wagging their tails behind them.
hey diddle diddle, the cat and the fiddle, the cow jumped over the moon;
the little dog laughed to see such sport, and the dish ran away with the spoon.
old mother hubbard went to the cupboard, to give the poor dog a bone;
when she came there, the cupboard was bare, and so the poor dog had none.
little jack horner sat in the corner, eating his christmas pie;
he put in his thumb, and pulled out a plum, and said, what a good boy am i!
"""

VOCAB = sorted(set(TEXT))


def encode(text: str) -> torch.Tensor:
    """Character ids of `text` (every character must be in VOCAB)."""
    index = {c: i for i, c in enumerate(VOCAB)}
    unknown = sorted(set(text) - set(index))
    if unknown:
        raise ValueError(f"characters {unknown} are not in the vocabulary of pplab.data.TEXT")
    return torch.tensor([index[c] for c in text], dtype=torch.long)


def decode(ids) -> str:
    return "".join(VOCAB[int(i)] for i in ids)


def batch(batch_size: int, seq: int, step: int = 0, seed: int = 0):
    """Training pair for `step`: batch_size random windows of seq characters, and the same windows
    shifted one character on (the next character to predict). The same (step, seed) gives the same
    batch on every rank and every run, so a parallel run sees what the single process saw."""
    ids = encode(TEXT)
    if seq + 1 > len(ids):
        raise ValueError(f"seq={seq} is longer than the text ({len(ids) - 1} characters to predict)")
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    starts = torch.randint(0, len(ids) - seq, (batch_size,), generator=g)
    windows = torch.stack([ids[s:s + seq + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]
