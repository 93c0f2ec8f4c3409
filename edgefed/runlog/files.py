"""A run log as a file: written only whole (beside its path, then swapped in), its path claimed atomically by
a new run, held by the one process that writes it (holds.py), and the stub a run writes before anything slow."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np

from edgefed import holds
from edgefed.errors import RunLogError
from edgefed.outputs import remove_stale_copies
from edgefed.runlog.reader import ResumePoint, last_completed_round
import edgefed.runlog.schema as schema
from edgefed.runlog.schema import RESTART, _root_attrs

def exists_error(path: Path) -> RunLogError:
    return RunLogError(f"run log {path} already exists; use --resume {path} to continue it, --force to replace it, "
                       "or another --out")


def hold(path: Path, resume_point: ResumePoint | None = None) -> None:
    """Take the log at path for this process to write (holds.py), before its first byte: a RunLogError when a
    live process writes it already (a second writer would swap its copy in under that run), or when the log
    gained rounds since resume_point was read from it (its run ended between the two)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return  # (the log cannot be written there either: writing it says why)
    holder = holds.hold(path)
    if holder is not None:
        again = f"edgefed run --resume {path}" if resume_point is not None else "run it again"
        raise RunLogError(f"run log {path} is being written by {holder}, which is still running; let it finish (or "
                          f"stop it), then {again}")
    done = last_completed_round(path)  # (-1: none, or the log unreadable this moment: its reading will say)
    if resume_point is not None and done >= 0 and done != resume_point.rounds_done:
        holds.let_go(path)
        raise RunLogError(f"run log {path} gained rounds while --resume read it (its run ended just now); "
                          f"edgefed run --resume {path} again")


def let_go(path: Path) -> None:
    """This process writes the log at path no more (see hold)."""
    holds.let_go(path)


def write_stub(path: Path, config_toml: str, restarts=(), claim: bool = False) -> None:
    """A log with its config and no round, written before anything slow (building data, compiling), so a run
    killed during start-up still continues with --resume. Swapped in whole, like every log; claim: the path
    must not exist, and is taken atomically (of two runs started on one --out, one gets "already exists")."""

    def fill(f):
        for key, value in _root_attrs(config_toml, "starting").items():
            f.attrs[key] = value
        _write_restarts(f, restarts)

    _swap_in(Path(path), fill, claim)


def _write_restarts(f: h5py.File, restarts) -> None:
    if not restarts:
        return
    rows = np.zeros(len(restarts), RESTART)
    for row, record in zip(rows, restarts):
        for name in RESTART.names:
            value = record[name]
            row[name] = value.encode("utf-8")[:RESTART[name].itemsize] if isinstance(value, str) else value
    ds = f.create_dataset("launch/restarts", data=rows)
    ds.attrs["meaning"] = "worlds edgefed launch started again on this log: round, time, cause, ranks before and after"


def _swap_in(path: Path, fill, claim: bool = False) -> None:
    """Write a whole log beside path (fill(file) writes its contents), then put it in path's place: an
    existing file is only ever replaced by a complete one. claim: path must not exist; the whole file is
    linked into place atomically (of two runs starting on one --out, one gets "already exists"), so path
    never shows a partial file even to a run killed at that moment."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunLogError(f"cannot create the folder of run log {path} ({exc}); choose another --out") from None
    remove_stale_copies(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with h5py.File(tmp, "w", libver=schema.LIBVER) as f:
            fill(f)
        if claim:
            _link_new(tmp, path)
        else:
            os.replace(tmp, path)
    except OSError as exc:
        raise RunLogError(f"cannot write run log {path} ({exc}); choose another --out") from None
    finally:
        tmp.unlink(missing_ok=True)


def _link_new(tmp: Path, path: Path) -> None:
    """tmp's file at path, which must not exist: a hard link is created atomically or not at all. Where the
    file system has no hard links (FAT on a USB stick), the existence check and the rename are two steps."""
    try:
        os.link(tmp, path)
        return
    except FileExistsError:
        raise exists_error(path) from None
    except OSError:
        pass  # no hard links here
    if path.exists():
        raise exists_error(path)
    os.replace(tmp, path)


def discard_stub(path: Path) -> None:
    """Remove the log at path if no round of it was run (the stub, or the log created over it, with at most round
    0, the start, in it): nothing to lose, so a failure in a run's start-up leaves nothing behind."""
    try:
        with h5py.File(path, "r") as f:
            if "state" in f:
                stub = f.attrs.get("status") == "running" and int(f["state/round"][0]) <= 0
            else:
                stub = f.attrs.get("status") == "starting"
    except (OSError, KeyError, ValueError, TypeError):
        return
    if stub:
        Path(path).unlink(missing_ok=True)

