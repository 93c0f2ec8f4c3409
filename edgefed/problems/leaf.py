"""`[data] kind = "leaf"`: LEAF's JSON layout (Caldas et al., 2018), one device per user in file order.

The folder holds `train/` and `test/`, each a set of `*.json` files read in name order; a file is
`{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}`. Samples are numbers
(FEMNIST's 784 pixels in [0, 1], flat: a `reshape` layer to [1, 28, 28] makes them images) and labels
integers, or text, recognized from the samples: Shakespeare's strings and Sent140's tweets, read as token ids
(text.py). A user's test samples are its own (LEAF splits each user's data); a user with none has none.

JSON is streamed, a user at a time (ijson), into the compact arrays file (compact.py) and never held whole:
`edgefed data convert` writes that file where you say; a run given the folder itself converts it once into a
cache beside it (`.edgefed/` in the folder, or the user's cache folder where the folder cannot be written),
keyed by the files' names, sizes and times, and every process reads its devices' rows from there.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import re
import time
from collections import Counter
from pathlib import Path

import numpy as np

from edgefed.errors import ConfigError, ProblemFileError
from edgefed.outputs import remove_stale_copies
from edgefed.problems.compact import FORMAT_VERSION, CompactWriter
from edgefed.problems.arrays import ArraysSource, shard_file
from edgefed.problems.pool import PoolProblem
from edgefed.problems.text import ALL_LETTERS, PAD, TEXT_FIELD, UNKNOWN, WORDS, Vocabulary, letter_ids, task_of
from edgefed.problems.text import tokens as words_of

TASKS = {None: "numbers", "shakespeare": "Shakespeare's lines (strings)", "sent140": "Sent140's tweets (five fields)"}


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


def _users(path: Path) -> list:
    """A file's users list (a first pass over the file: its user_data is streamed in a second)."""
    import ijson

    try:
        with open(path, "rb") as f:
            users = list(ijson.items(f, "users.item"))
    except (OSError, ijson.JSONError, UnicodeDecodeError) as exc:
        raise ProblemFileError(f"{path} cannot be read as LEAF JSON ({_one_line(exc)})") from None
    if not users:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
        if b'"users"' not in head and b'"user_data"' not in head:
            raise ProblemFileError(f'{path} is not a LEAF file: it needs "users" and "user_data"')
    bad = next((u for u in users if not isinstance(u, str)), None)
    if bad is not None:
        raise ProblemFileError(f"{path}: users lists {bad!r}, not a name; give each user's name as a string")
    return users


def _records(path: Path, users: list):
    """(user, record) of a file's user_data, a user at a time, for the users the file lists (others ignored);
    a listed user without a record is named."""
    import ijson

    listed, seen = set(users), set()
    try:
        with open(path, "rb") as f:
            for user, record in ijson.kvitems(f, "user_data", use_float=True):
                if user in listed and user not in seen:
                    seen.add(user)
                    yield user, record
    except (OSError, ijson.JSONError, UnicodeDecodeError) as exc:
        raise ProblemFileError(f"{path} cannot be read as LEAF JSON ({_one_line(exc)})") from None
    missing = next((u for u in users if u not in seen), None)
    if missing is not None:
        _samples(path, missing, None)


def _one_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class _Conversion:
    """One pass over a LEAF folder's files into a CompactWriter: the checks of every sample, the task, the
    devices (users with training samples, in file order), the labels; Sent140's words counted to give them ids
    at the end."""

    def __init__(self, folder: Path, out: Path, vocab_size: int, vocab: str | None):
        self.folder, self.out, self.vocab_size, self.vocab = folder, out, vocab_size, vocab
        self.files = {part: sorted((folder / part).glob("*.json")) for part in ("train", "test")}
        if not self.files["train"]:
            raise ConfigError(f"config: data.path = {str(folder)!r} has no train/*.json; give a LEAF data folder "
                              "(with train/ and test/)")
        self.task, self.length, self.first, self.shape, self.unknown = None, 0, None, None, 0
        self.writer = None
        self.devices, self.empty, self.seen_test = [], set(), set()
        self.word_ids, self.words, self.counts = {}, [], []  # Sent140: each distinct word's provisional id
        self.chosen = None if vocab is None else _vocabulary(vocab)  # (a bad file said before the folder is read)

    def run(self) -> str:
        try:
            for part in ("train", "test"):
                for path in self.files[part]:
                    users = _users(path)
                    self._listed(path, part, users)
                    first = len(self.devices)
                    for user, record in _records(path, users):
                        self._user(path, part, user, record)
                    order = {u: i for i, u in enumerate(users)}  # a file's devices in its users' order (its
                    self.devices[first:] = sorted(self.devices[first:], key=order.get)  # user_data may differ)
            if not self.devices:
                raise ConfigError(f"config: data.path = {str(self.folder)!r}: train/ has no users with samples; give "
                                  "a LEAF data folder with users' samples")
            return self._finish()
        except BaseException:
            if self.writer is not None:
                self.writer.discard()
            raise

    def _listed(self, path: Path, part: str, users: list) -> None:
        if part == "train":
            known = set(self.devices) | self.empty
            counts = Counter(users)
            twice = next((u for u in users if u in known or counts[u] > 1), None)
            if twice is not None:
                raise ProblemFileError(f"{path}: user {twice!r} appears twice in train/")
        else:
            counts = Counter(u for u in users if u in self._device_set)
            twice = next((u for u in users if u in self._device_set and (u in self.seen_test or counts[u] > 1)), None)
            if twice is not None:
                raise ProblemFileError(f"{path}: user {twice!r} appears twice in test/")
            self.seen_test.update(u for u in users if u in self._device_set)

    def _user(self, path: Path, part: str, user: str, record) -> None:
        x, y = _samples(path, user, record)
        if part == "train":
            if not x:  # nothing to train on: not a device (the run's first line counts them)
                self.empty.add(user)
                return
            self.devices.append(user)
        elif user not in self._device_set:
            return  # a user with test samples only takes no part
        if not x:
            return
        task = _task(x)
        if self.first is None:
            self.first, self.task = user, task
            self.length = _length(x) if task == "shakespeare" else WORDS
        elif task != self.task:
            raise ProblemFileError(f"{path}: user {user!r}'s samples are {TASKS[task]} but user {self.first!r}'s "
                                   f"{TASKS[self.task]}; give one task's users")
        if task is None:
            values = _values(path, user, x, self.shape)
            self.shape = values.shape[1:]
            if not np.all(np.isfinite(values)):
                raise ConfigError(f"{path}: user {user!r} has samples with NaN or infinity; clean the data")
            bad = next((i for i, label in enumerate(y) if isinstance(label, bool) or not isinstance(label, (int, float))
                        or not math.isfinite(label) or label < 0 or label != int(label)), None)
            if bad is not None:
                raise ProblemFileError(f"{path}: user {user!r}: label {bad} is {y[bad]!r}; a label is a class, an "
                                       "integer from 0")
            self._writer(self.shape, None).add(part, values, np.asarray(y, np.int64), user)
            return
        _text_samples(path, user, x, y, task, self.length, self.first)
        if task == "shakespeare":
            ids, unknown = letter_ids(x)
            labels, unknown_y = letter_ids(y)
            self.unknown += unknown + unknown_y
            self._writer((self.length,), np.uint8).add(part, ids, labels[:, 0], user)
        else:
            labels = np.array([_sentiment(path, user, i, label) for i, label in enumerate(y)], np.uint8)
            self._writer((WORDS,), np.uint32).add(part, self._provisional(x, part == "train"), labels, user)

    @functools.cached_property
    def _device_set(self) -> set:
        return set(self.devices)  # (asked once train/ is read)

    def _writer(self, shape: tuple, ids_dtype) -> CompactWriter:
        if self.writer is None:
            self.writer = CompactWriter(self.out, shape, ids_dtype)
        return self.writer

    def _provisional(self, x: list, count: bool) -> np.ndarray:
        """Tweets as provisional word ids (each distinct word numbered as first seen, from 2; 0 pads), the
        training set's words counted."""
        out = np.zeros((len(x), WORDS), np.uint32)
        ids, words, counts = self.word_ids, self.words, self.counts
        for i, sample in enumerate(x):
            for j, word in enumerate(words_of(sample[TEXT_FIELD])):
                k = ids.get(word)
                if k is None:
                    k = ids[word] = len(words) + 2
                    words.append(word)
                    counts.append(0)
                if count:
                    counts[k - 2] += 1
                out[i, j] = k
        return out

    def _finish(self) -> str:
        users = len(self.devices) + len(self.empty)
        note = f"{users} users, {len(self.empty)} without samples skipped" if self.empty else f"{users} users"
        attrs = {"partition": "natural", "text_task": self.task, "model": None if self.task else "cnn"}
        vocabulary = None
        if self.task == "shakespeare":
            attrs["classes"] = attrs["token_ids"] = len(ALL_LETTERS)
            unknown = f" ({self.unknown} outside them read as a space)" if self.unknown else ""
            note = f"Shakespeare, the next of {len(ALL_LETTERS)} characters{unknown}, {note}"
        elif self.task == "sent140":
            attrs["classes"] = 2
            counts = Counter({w: c for w, c in zip(self.words, self.counts) if c})
            chosen = Vocabulary.from_counts(counts, self.vocab_size) if self.chosen is None else self.chosen
            table = np.full(len(self.words) + 2, UNKNOWN, np.int64)
            table[PAD] = PAD
            for word, k in self.word_ids.items():
                table[k] = chosen.ids.get(word, UNKNOWN)
            self.writer.remap(table)
            vocabulary, attrs["token_ids"] = chosen.words, chosen.num
            note = (f"Sent140, {WORDS} words a tweet, a vocabulary of {chosen.num} ids (0 padding, 1 unknown"
                    f"{', from ' + Path(self.vocab).name if self.vocab else ''}), {note}")
        attrs["note"] = note
        attrs["title"] = f"LEAF {self.folder.name}, {note}"
        attrs["source"] = f"the LEAF folder {self.folder}"
        self.writer.finish(attrs, keys=self.devices, vocabulary=vocabulary, has_test=bool(self.files["test"]))
        return note


def convert_leaf(folder: Path, out: Path, vocab_size: int = 10_000, vocab: str | None = None) -> str:
    """Stream a LEAF folder into the compact arrays file at out (swapped in whole); returns how a run
    describes it."""
    return _Conversion(Path(folder), Path(out), vocab_size, vocab).run()


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


CONVERTER = 1  # bumped when the conversion writes other bytes for the same folder: old caches are not read


def cache_key(folder: Path, vocab_size: int, vocab: str | None) -> str:
    """What a folder's conversion depends on: its files' names, sizes and times, then (apart, so that copies
    for other vocabularies of the same files are kept) Sent140's vocabulary."""
    files = [FORMAT_VERSION, CONVERTER]
    for part in ("train", "test"):
        for path in sorted((folder / part).glob("*.json")):
            st = path.stat()
            files.append((part, path.name, st.st_size, st.st_mtime_ns))
    words = [vocab_size]
    if vocab is not None:
        st = Path(vocab).stat()
        words.append((str(Path(vocab).resolve()), st.st_size, st.st_mtime_ns))
    digest = lambda stamp: hashlib.sha256(repr(stamp).encode()).hexdigest()[:12]  # noqa: E731
    return f"{digest(files)}-{digest(words)}"


def cache_places(folder: Path, key: str) -> list[Path]:
    """Where a folder's converted copy may be: beside its files, else in the user's cache folder."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgefed" / "leaf"
    tag = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:12]
    return [folder / ".edgefed" / f"leaf-{key}.h5", home / f"{tag}-leaf-{key}.h5"]


def cached(folder: Path, vocab_size: int, vocab: str | None, convert: bool = True) -> tuple[Path, str | None]:
    """(the folder's converted copy, what was done to make it, or None when it was there already); convert:
    whether this process may make it (a device rank of an MPI run reads the copy its coordinator made)."""
    key = cache_key(folder, vocab_size, vocab)
    places = cache_places(folder, key)
    found = next((p for p in places if p.is_file()), None)
    if found is not None:
        return found, None
    if not convert:
        raise ProblemFileError(f"the LEAF folder {folder} has no converted copy on this machine (the run's "
                               f"coordinator makes it where it runs); convert it here with `edgefed data convert "
                               f"{folder} {folder.name}.h5` and give data.path = that file (launch/pi-cluster.sh "
                               "data copies each board its devices' rows)")
    start = time.perf_counter()
    for place in places:
        try:
            place.parent.mkdir(parents=True, exist_ok=True)
            probe = place.with_name(f".probe-{os.getpid()}")
            probe.touch()
            probe.unlink()
        except OSError:
            continue
        remove_stale_copies(place)  # (a conversion killed half-way)
        for old in place.parent.glob(place.name.replace(key, "*-" + key.split("-")[1])):
            if old != place:
                old.unlink(missing_ok=True)  # an earlier version of the folder's files, this vocabulary's
        convert_leaf(folder, place, vocab_size, vocab)
        return place, (f"LEAF folder {folder}: converted once ({time.perf_counter() - start:.1f} s) to {place}, which "
                       "runs read until its files change")
    raise ProblemFileError(f"the LEAF folder {folder} cannot be converted: neither {places[0].parent} nor "
                           f"{places[1].parent} can be written; convert it with `edgefed data convert {folder} OUT.h5` "
                           "and give data.path = OUT.h5")


def leaf_problem(cfg, seed: int, dtype, loss: str, spatial: int = 0, tokens: int | None = None,
                 builtin: str | None = None, convert: bool = True, shard=None) -> PoolProblem:
    folder = Path(cfg.path)
    if shard is not None:  # a device rank's shard of the folder's converted copy (shard.py)
        source = ArraysSource(shard_file(shard, folder), name=str(folder))
        return PoolProblem(cfg, seed, dtype, source, loss, f"LEAF {folder.name}, {source.note}", spatial, tokens,
                           builtin)
    if not folder.is_dir():
        raise ConfigError(f"config: data.path = {cfg.path!r} is not a folder; give a LEAF data folder (with train/ "
                          "and test/ of *.json files)")
    path, notice = cached(folder, cfg.vocab_size, cfg.vocab, convert)
    source = ArraysSource(path, name=str(folder))
    problem = PoolProblem(cfg, seed, dtype, source, loss, f"LEAF {folder.name}, {source.note}", spatial, tokens,
                          builtin)
    problem.notice = notice
    return problem
