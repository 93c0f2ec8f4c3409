"""LEAF's two text tasks as token ids (Caldas et al., 2018), what the LEAF reader hands an embedding.

Shakespeare: a sample is a string of 80 characters, its label the next one; each character maps to its
index in LEAF's 80-character vocabulary (`ALL_LETTERS`, as LEAF's models read it). LEAF's own lookup gives
-1 to a character outside it; here such a character reads as a space (UNKNOWN_LETTER), and the run's first
line counts them.

Sent140: a sample is a tweet's five fields (id, date, query, user, text), its label 0 or 1; the text is split
by LEAF's expression `[\\w']+|[.,!?;]` and its first 25 tokens kept (WORDS), padded at the end. The
vocabulary is the training set's words by frequency (ties in code-point order) up to `data.vocab_size`, or
a file's words, one a line, in its order: id PAD pads, UNKNOWN stands for any word outside it, the words
follow from 2.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

ALL_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
UNKNOWN_LETTER = ALL_LETTERS.index(" ")
_LETTER_IDS = np.full(128, -1, np.int64)  # by code point (every letter is ASCII)
_LETTER_IDS[[ord(c) for c in ALL_LETTERS]] = np.arange(len(ALL_LETTERS))

SPLIT = re.compile(r"[\w']+|[.,!?;]")
WORDS = 25
PAD, UNKNOWN = 0, 1
TEXT_FIELD = 4  # of a Sent140 sample's five


def task_of(sample) -> str | None:
    """Which text task a LEAF sample belongs to: "shakespeare", "sent140", or None (numbers)."""
    if isinstance(sample, str):
        return "shakespeare"
    if isinstance(sample, list) and len(sample) == 5 and isinstance(sample[TEXT_FIELD], str):
        return "sent140"
    return None


def letter_ids(texts) -> tuple[np.ndarray, int]:
    """(ids (n, len), characters outside the vocabulary) of strings of one length."""
    n = len(texts)
    width = len(texts[0]) if n else 0
    codes = np.frombuffer("".join(texts).encode("utf-32-le"), np.uint32).reshape(n, width)
    ids = np.where(codes < _LETTER_IDS.size, _LETTER_IDS[np.minimum(codes, _LETTER_IDS.size - 1)], -1)
    unknown = ids < 0
    ids[unknown] = UNKNOWN_LETTER
    return ids, int(np.count_nonzero(unknown))


def tokens(text: str) -> list[str]:
    return SPLIT.findall(text)[:WORDS]


class Vocabulary:
    """Sent140's words and their ids (the module's docstring)."""

    def __init__(self, words):
        self.words = list(words)
        self.ids = {w: i + 2 for i, w in enumerate(self.words)}

    @classmethod
    def from_counts(cls, counts: Counter, size: int) -> "Vocabulary":
        return cls(sorted(counts, key=lambda w: (-counts[w], w))[:size])

    @property
    def num(self) -> int:
        """The ids an embedding over it needs: the words, padding and unknown."""
        return len(self.words) + 2

    def encode(self, texts) -> np.ndarray:
        out = np.full((len(texts), WORDS), PAD, np.int64)
        for i, text in enumerate(texts):
            ids = [self.ids.get(w, UNKNOWN) for w in tokens(text)]
            out[i, :len(ids)] = ids
        return out
