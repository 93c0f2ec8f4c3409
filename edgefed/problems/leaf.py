"""`[data] kind = "leaf"`: LEAF's JSON layout (Caldas et al., 2018), one device per user in file order.

The folder holds `train/` and `test/`, each a set of `*.json` files read in name order; a file is
`{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}`. Samples are numbers
(FEMNIST's 784 pixels in [0, 1], flat: a `reshape` layer to [1, 28, 28] makes them images) and labels
integers, or text, recognized from the samples: Shakespeare's strings and Sent140's tweets, read as token ids
(text.py). A user's test samples are its own (LEAF splits each user's data); a user with none has none.

JSON must be parsed whole, so a file is read once for the labels and again, by the processes that host its
users, for their samples; only those are kept.
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np

from edgefed.errors import ConfigError, ProblemFileError
from edgefed.problems.text import ALL_LETTERS, TEXT_FIELD, WORDS, Vocabulary, letter_ids, task_of
from edgefed.problems.text import tokens as words_of
from edgefed.problems.pool import PoolProblem, Source

TASKS = {None: "numbers", "shakespeare": "Shakespeare's lines (strings)", "sent140": "Sent140's tweets (five fields)"}


def _load(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProblemFileError(f"{path} cannot be read as LEAF JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("users"), list) or not isinstance(data.get("user_data"),
                                                                                              dict):
        raise ProblemFileError(f"{path} is not a LEAF file: it needs \"users\" and \"user_data\"")
    return data


def _samples(path: Path, user: str, record) -> tuple[list, list]:
    if not isinstance(record, dict) or "x" not in record or "y" not in record:
        raise ProblemFileError(f"{path}: user {user!r} has no \"x\" and \"y\" in user_data")
    x, y = record["x"], record["y"]
    for key, value in (("x", x), ("y", y)):
        if not isinstance(value, list):
            raise ProblemFileError(f"{path}: user {user!r}'s {key} is {type(value).__name__}, not a list (one entry per "
                                   "sample)")
    if len(x) != len(y):
        raise ProblemFileError(f"{path}: user {user!r} has {len(x)} samples in x but {len(y)} labels in y")
    return x, y


IMAGE_FILE = re.compile(r"\.(png|jpe?g|bmp|gif|tiff?)$", re.IGNORECASE)
FORMS = ("LEAF samples are numbers (FEMNIST's pixels), strings (Shakespeare's lines) or five fields with the text "
         "last (Sent140's tweets)")


def _task(x: list) -> str | None:
    """A user's task from its samples: the most common form among them, so that one bad sample is named as the
    odd one out, not the samples after it (a tie goes to the text task: a broken text sample looks like no task)."""
    counts = Counter(task_of(sample) for sample in x)
    return max(counts, key=lambda task: (counts[task], task is not None))


def _length(x: list) -> int:
    """The length of a user's Shakespeare samples: the most common, so that an odd sample is the one named."""
    counts = Counter(len(sample) for sample in x)
    return max(counts, key=lambda n: (counts[n], n))


def _text_samples(path: Path, user: str, x: list, y: list, task: str, length: int, first: str) -> None:
    """A user's text samples checked: every sample of its task's form (Shakespeare: `length` characters, the
    length of `first`'s samples, and one next character; Sent140: five fields, the text a string), refused naming
    the user, the sample and the fix for its task."""
    for i, (sample, label) in enumerate(zip(x, y)):
        if task_of(sample) != task:
            raise ProblemFileError(f"{path}: user {user!r}: sample {i} is not one of {TASKS[task]} like the others "
                                   f"({str(sample)[:40]!r}); give every sample in one form")
        if task == "shakespeare":
            if not sample:
                raise ProblemFileError(f"{path}: user {user!r}: sample {i} is an empty string; a Shakespeare sample "
                                       "is a window of the role's text (80 characters in LEAF), its label the "
                                       "character after it")
            if len(sample) != length:
                theirs = "the user's other samples have" if user == first else f"user {first!r}'s samples have"
                raise ProblemFileError(f"{path}: user {user!r}: sample {i} has {len(sample)} characters but {theirs} "
                                       f"{length}; give every sample one length")
            if not isinstance(label, str) and IMAGE_FILE.search(sample):  # LEAF's raw FEMNIST: images by name
                raise ProblemFileError(f"{path}: user {user!r}: sample {i} is a file name ({sample[:40]!r}), label "
                                       f"{label!r}; edgefed reads samples as numbers: convert the images to their "
                                       "pixels (LEAF's preprocessed FEMNIST)")
            if not isinstance(label, str) or len(label) != 1:
                raise ProblemFileError(f"{path}: user {user!r}: label {i} is {label!r}; a Shakespeare label is the "
                                       "one character that follows its sample, as a string (\"e\", not a number)")


def _values(path: Path, user: str, x: list, shape: tuple | None) -> np.ndarray:
    """A user's samples as one float64 array; a sample of another shape (than most of the user's samples, or
    than `shape`, the other users') or of values that are not numbers is refused naming the user and sample."""
    try:
        raw = np.asarray(x)
        if raw.dtype.kind in "iuf":  # (True, None, "1": no sample of numbers, though float64 would take them)
            return _shaped(raw.astype(np.float64), path, user, shape)
    except (ValueError, TypeError):
        pass
    shapes = []
    for i, sample in enumerate(x):
        try:
            values = np.asarray(sample)
            if values.dtype.kind not in "iuf":
                raise TypeError
        except (ValueError, TypeError):
            raise ProblemFileError(f"{path}: user {user!r}: sample {i} ({str(sample)[:40]!r}) is not numbers of one "
                                   f"shape like the user's other samples; {FORMS}, one form in a dataset") from None
        shapes.append(values.shape)
    counts = Counter(shapes)
    common = max(counts, key=lambda shape: (counts[shape], shape == shapes[0]))  # the odd sample is the one named
    i = next((i for i, found in enumerate(shapes) if found != common), 0)
    raise ProblemFileError(f"{path}: user {user!r}: sample {i} has shape {shapes[i]} but the user's other samples "
                           f"have {common}; give every sample one shape")


def _shaped(values: np.ndarray, path: Path, user: str, shape: tuple | None) -> np.ndarray:
    if values.ndim < 1 or (shape is not None and values.shape[1:] != shape):
        raise ProblemFileError(f"{path}: user {user!r} has samples of shape {values.shape[1:]}, others {shape}; "
                               "give every sample one shape")
    return values


class LeafSource(Source):
    def __init__(self, folder: Path, vocab_size: int = 10_000, vocab: str | None = None):
        self.folder = folder
        self.task, self.length, self.unknown, self.vocabulary = None, 0, 0, None
        words = Counter()
        self.files = {part: sorted((folder / part).glob("*.json")) for part in ("train", "test")}
        if not self.files["train"]:
            raise ConfigError(f"config: data.path = {str(folder)!r} has no train/*.json; give a LEAF data folder "
                              "(with train/ and test/)")
        users, labels, devices, where, seen_test, empty = [], [], [], {}, set(), set()
        shape, first = None, None
        for part in ("train", "test"):
            part_labels, part_devices = [], []
            for i, path in enumerate(self.files[part]):
                data = _load(path)
                for user in data["users"]:
                    x, y = _samples(path, user, data["user_data"].get(user))
                    if part == "train":
                        if user in where or user in empty:
                            raise ProblemFileError(f"{path}: user {user!r} appears twice in train/")
                        if not x:  # nothing to train on: not a device (the run's first line counts them)
                            empty.add(user)
                            continue
                        where[user] = len(users)
                        users.append(user)
                    elif user not in where:
                        continue  # a user with test samples only takes no part
                    elif user in seen_test:
                        raise ProblemFileError(f"{path}: user {user!r} appears twice in test/")
                    else:
                        seen_test.add(user)
                    if x:  # parsed anyway: checked here, before a log is written
                        task = _task(x)
                        if first is None:
                            first, self.task = user, task
                            self.length = _length(x) if task == "shakespeare" else WORDS
                        elif task != self.task:
                            raise ProblemFileError(f"{path}: user {user!r}'s samples are {TASKS[task]} but user "
                                                   f"{first!r}'s {TASKS[self.task]}; give one task's users")
                        if task is None:
                            values = _values(path, user, x, shape)
                            shape = values.shape[1:]
                            if not np.all(np.isfinite(values)):
                                raise ConfigError(f"{path}: user {user!r} has samples with NaN or infinity; clean "
                                                  "the data")
                        else:
                            _text_samples(path, user, x, y, task, self.length, first)
                        if task == "shakespeare":
                            ids, unknown = letter_ids(y)
                            self.unknown += letter_ids(x)[1] + unknown
                            y = ids[:, 0].tolist()
                        elif task == "sent140":
                            y = [_sentiment(path, user, i, label) for i, label in enumerate(y)]
                            if part == "train":
                                for sample in x:
                                    words.update(words_of(sample[TEXT_FIELD]))
                    part_labels += y
                    part_devices += [where[user]] * len(y)
                self.files[part][i] = (path, [u for u in data["users"] if u in where])
            labels.append(np.asarray(part_labels))
            devices.append(np.asarray(part_devices, np.int64))
        if not users:
            raise ConfigError(f"config: data.path = {str(folder)!r}: train/ has no users with samples; give a LEAF "
                              "data folder with users' samples")
        self.note = (f"{len(users) + len(empty)} users, {len(empty)} without samples skipped" if empty
                     else f"{len(users)} users")
        if self.task == "shakespeare":
            self.n_classes = len(ALL_LETTERS)
            unknown = f" ({self.unknown} outside them read as a space)" if self.unknown else ""
            self.note = f"Shakespeare, the next of {len(ALL_LETTERS)} characters{unknown}, {self.note}"
        elif self.task == "sent140":
            self.n_classes = 2
            self.vocabulary = Vocabulary.from_counts(words, vocab_size) if vocab is None else _vocabulary(vocab)
            self.note = (f"Sent140, {WORDS} words a tweet, a vocabulary of {self.vocabulary.num} ids (0 padding, "
                         f"1 unknown{', from ' + Path(vocab).name if vocab else ''}), {self.note}")
        if self.task is not None:
            self.integer, shape = True, (self.length,)
            self.text = (f"LEAF {self.task.capitalize()}", self.vocabulary.num if self.vocabulary else self.n_classes)
        self._first = {}  # (part, device): its first row (a user's rows are contiguous: one entry per file)
        for part, d in zip(("train", "test"), devices):
            ids, first = np.unique(d, return_index=True)
            self._first.update({(part, int(k)): int(i) for k, i in zip(ids, first)})
        super().__init__(str(folder), tuple(shape), labels[0], labels[1] if self.files["test"] else None,
                         devices[0], devices[1], tuple(users))
        self.finite_checked = True

    def read(self, part: str, rows: np.ndarray) -> np.ndarray:
        """Rows of part; a file is parsed again only if one of its users has a row asked for."""
        device = self.device_train if part == "train" else self.device_test
        # rows run user by user in file order, so each user's block is contiguous
        out = np.empty((rows.size, *self.sample_shape), np.int64 if self.integer else np.float64)
        wanted = set(int(d) for d in np.unique(device[rows])) if rows.size else set()
        order = {u: k for k, u in enumerate(self.device_names)}
        for path, users in self.files[part]:
            if not any(order[u] in wanted for u in users):
                continue
            data = _load(path)
            for user in users:
                k = order[user]
                if k not in wanted:
                    continue
                x, _ = _samples(path, user, data["user_data"][user])
                values = self._values(x)
                lo = self._first[part, k]
                mine = rows[(rows >= lo) & (rows < lo + len(x))]
                out[np.searchsorted(rows, mine)] = values[mine - lo]
        return out


    def _values(self, x: list) -> np.ndarray:
        """A user's samples as the model reads them: numbers, or token ids."""
        if self.task == "shakespeare":
            return letter_ids(x)[0]
        if self.task == "sent140":
            return self.vocabulary.encode([sample[TEXT_FIELD] for sample in x])
        return np.asarray(x, np.float64).reshape(len(x), *self.sample_shape)


def _sentiment(path: Path, user: str, i: int, label) -> int:
    """A Sent140 label, 0 or 1 (LEAF writes them as numbers or as their text)."""
    if isinstance(label, str) and label.strip() in ("0", "1"):
        return int(label)
    if label in (0, 1) and not isinstance(label, bool):
        return int(label)
    raise ProblemFileError(f"{path}: user {user!r}: label {i} is {label!r}; a Sent140 label is 0 or 1")


def _vocabulary(path: str) -> Vocabulary:
    """A vocabulary file: one word a line, the first line id 2 (docs/config.md). A blank line, a repeated word
    or a line the tweets' split would never give as one word is refused naming its line: ids are never
    renumbered behind the user's back."""
    where = f"config: data.vocab = {path!r}"
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where} cannot be read ({exc}); give a text file of words, one a line") from None
    if not lines:
        raise ConfigError(f"{where} holds no words; give a text file of words, one a line")
    seen = {}
    for number, line in enumerate(lines, 1):
        word = line.strip()
        if not word:
            raise ConfigError(f"{where}: line {number} is blank; give one word a line (line 1 is id 2, line n id "
                              "n + 1), with no blank lines")
        if word in seen:
            raise ConfigError(f"{where}: line {number}, {word!r}, repeats line {seen[word]}; give each word once "
                              "(a word's id is its line number + 1)")
        if words_of(word) != [word]:
            raise ConfigError(f"{where}: line {number}, {word!r}, is not one word as tweets are split ([\\w']+, or "
                              "one of . , ! ? ;): no tweet would ever give it; give one word a line")
        seen[word] = number
    return Vocabulary(seen)


@functools.lru_cache(maxsize=16)  # (every validation of a config without a model asks; a rank validates several)
def text_task(folder) -> str | None:
    """The text task of a LEAF folder ("shakespeare", "sent140"), None for numbers or what cannot be told
    from its first training file's first megabyte (the folder is read in full, and checked, by the run)."""
    files = sorted((Path(folder) / "train").glob("*.json"))
    try:
        with open(files[0], encoding="utf-8", errors="replace") as f:
            head = f.read(1 << 20)
    except (IndexError, OSError):
        return None
    found = re.search(r'"x"\s*:\s*\[\s*(\[\s*)?(["\d\-\[])', head)
    if found is None or found.group(2) != '"':
        return None
    return "sent140" if found.group(1) else "shakespeare"


def leaf_problem(cfg, seed: int, dtype, loss: str, spatial: int = 0, tokens: int | None = None,
                 builtin: str | None = None) -> PoolProblem:
    folder = Path(cfg.path)
    if not folder.is_dir():
        raise ConfigError(f"config: data.path = {cfg.path!r} is not a folder; give a LEAF data folder (with train/ "
                          "and test/ of *.json files)")
    source = LeafSource(folder, cfg.vocab_size, cfg.vocab)
    return PoolProblem(cfg, seed, dtype, source, loss, f"LEAF {folder.name}, {source.note}", spatial, tokens, builtin)

