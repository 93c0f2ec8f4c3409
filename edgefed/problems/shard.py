"""A board's shard of a compact arrays file: what one device rank reads instead of the whole file.

A shard is the compact file (compact.py) with every label, device range, name and attribute of the whole, but
the samples of only the rows that rank's devices hold: `x_train` and `x_test` hold those rows, and
`rows_train` and `rows_test` say which rows of the whole they are. A device rank given `[data] shards` reads
`rank-R.h5` there; its problem is built from the same labels as the coordinator's, so the partition, the
devices and every bit of the run are those of a run on the whole file. The coordinator sends the whole
file's identity (`identity`), which the shard must carry (checked before anything is built from it), and a
rank whose devices' rows its shard lacks (a shard of another placement: a board was left out since) is
refused in one line.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import h5py
import numpy as np

from edgefed.errors import ConfigError, ProblemFileError
from edgefed.problems.compact import FORMAT, smallest_int
from edgefed.problems.pool import RowRanges

PARTS = ("train", "test")
COPY_ROWS = 1 << 16  # rows copied at a time


def shard_name(rank: int) -> str:
    return f"rank-{rank}.h5"


def identity(source) -> str:
    """What a run's devices are built from, as a digest: the labels, the devices' rows, the samples' shape and
    type, and which making of the file it is (a conversion's own mark: the same labels with other samples, the
    file made again, are not the same)."""
    h = hashlib.sha256()
    for y in (source.y_train, source.y_test):
        h.update(b"-" if y is None else np.ascontiguousarray(y).tobytes())
    for part in PARTS:
        if part in source.ranges:
            h.update(np.ascontiguousarray(source.ranges[part]).tobytes())
    for d in (source.device_train, source.device_test):
        h.update(b"-" if d is None else np.ascontiguousarray(d, np.int64).tobytes())
    h.update(repr((tuple(source.sample_shape), str(source.x_dtype), source.x_scale, source.made)).encode())
    return h.hexdigest()[:24]


def rows_of(problem, devices: np.ndarray) -> dict[str, np.ndarray]:
    """The rows of each part that these devices' data is read from (held-out test rows come from training)."""
    held_out = problem.source.y_test is None
    train = [problem.train_rows[int(k)] for k in devices]
    test = [problem.test_rows[int(k)] for k in devices]
    empty = [np.zeros(0, np.int64)]
    if held_out:
        return {"train": np.unique(np.concatenate(train + test + empty))}
    return {"train": np.unique(np.concatenate(train + empty)), "test": np.unique(np.concatenate(test + empty))}


def write_shard(problem, devices: np.ndarray, out: Path) -> int:
    """The shard of these devices at out (written beside it, then swapped in); returns its bytes."""
    source = problem.source
    path = getattr(source, "path", None)
    if path is None or Path(path).suffix not in (".h5", ".hdf5") or source.format != FORMAT:
        raise ConfigError(f"{source.name} is not a compact arrays file; convert it first (edgefed data convert "
                          f"{source.name} DATA.h5) and give data.path = DATA.h5")
    rows = rows_of(problem, devices)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with h5py.File(path, "r") as whole, h5py.File(tmp, "w") as f:
            for name in whole:
                if not name.startswith("x_"):
                    whole.copy(whole[name], f, name)
            for key, value in whole.attrs.items():
                f.attrs[key] = value
            for part, wanted in rows.items():
                x = whole[f"x_{part}"]
                chunks = (min(x.chunks[0], wanted.size), *x.chunks[1:]) if wanted.size and x.chunks else None
                ds = f.create_dataset(f"x_{part}", (wanted.size, *x.shape[1:]), dtype=x.dtype, chunks=chunks)
                f.create_dataset(f"rows_{part}", data=wanted.astype(smallest_int(0, int(wanted.max(initial=0)))))
                for first in range(0, wanted.size, COPY_ROWS):
                    block = wanted[first:first + COPY_ROWS]
                    ds[first:first + block.size] = source._read_into(x, block, np.empty((block.size, *x.shape[1:]),
                                                                                      x.dtype))
            f.attrs["shard_of"] = identity(source)
            # what a rank would otherwise scan every row for: the training set's statistics, the ids' range
            if problem._shift is not None:
                f.attrs["standard_shift"], f.attrs["standard_scale"] = problem._shift.ravel(), problem._scale.ravel()
            if source.integer and "token_ids" not in f.attrs:
                high = max((int(block.max()) for part in ("train", "test") if source.y_test is not None or part ==
                            "train" for _, block in source.blocks(part) if block.size), default=-1)
                f.attrs["token_ids"] = high + 1
        os.replace(tmp, out)
    except OSError as exc:
        raise ProblemFileError(f"cannot write the shard {out} ({exc}); choose another --out") from None
    finally:
        tmp.unlink(missing_ok=True)
    return out.stat().st_size


FIX = "make the boards' shards again: launch/pi-cluster.sh data BOARDS CONFIG"


def check_made_from(shard: Path, path, whole: str | None) -> None:
    """A device rank's shard against the coordinator's data (its identity, `whole`), before anything is built
    from it."""
    try:
        with h5py.File(shard, "r") as f:
            made = f.attrs.get("shard_of")
    except OSError:
        return  # (missing or unreadable: opening it says so, naming it)
    if made is None:
        raise ProblemFileError(f"{shard} is not a shard (edgefed data shard writes them); {FIX}")
    if whole is not None and str(made) != whole:
        raise ProblemFileError(f"the shard {shard} was made from other data than the coordinator's data.path {path} "
                               f"(another config's, or the data made again since); {FIX}")


def check_shard(problem, devices: np.ndarray) -> None:
    """A device rank's shard against the devices this world places on the rank: one line saying what to make
    again when it lacks their rows (the boards' placement changed since: a board left out, another seed)."""
    source = problem.source
    if source.shard_of is None:
        return
    held_out = source.y_test is None
    for k in devices:  # a device at a time: no array of every row the rank holds (millions, on a Pi)
        for part, parts in (("train", problem.train_rows), ("test", problem.test_rows)):
            held = source.shard_rows.get("train" if held_out else part, np.zeros(0, np.int64))
            if isinstance(parts, RowRanges):  # [lo, hi) held whole: that many held rows lie within it
                lo, hi = parts.table[int(k)]
                if hi == lo or (held.size and hi - 1 <= held[-1] and np.searchsorted(held, held.dtype.type(hi - 1),
                                "right") - np.searchsorted(held, held.dtype.type(lo)) == hi - lo):
                    continue
                rows = np.arange(lo, hi)
            else:
                rows = parts[int(k)]
            beyond = rows.size and (not held.size or rows[-1] > held[-1])  # (before the cast could wrap it)
            at = np.minimum(np.searchsorted(held, rows.astype(held.dtype)), max(held.size - 1, 0))
            if rows.size and (beyond or not np.array_equal(held[at], rows)):
                raise ProblemFileError(f"the shard {source.path} lacks device {int(k)}'s rows, which this world "
                                       f"places on its rank (the boards' placement or the partition changed since: a "
                                       f"board left out?); {FIX}")
