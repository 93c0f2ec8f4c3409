"""The rule every file a command writes follows: an existing file is replaced only with --force, never where a
folder is, never one of the command's own inputs (not even with --force: `export a.h5 --weights a.h5` would
replace the log it reads; a file inside a data folder it reads counts), and only into a folder it can write."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from edgefed.errors import EdgefedError


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one existing file (through links, `..` and case-folding file systems too)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def is_input(path: Path, given: Path) -> bool:
    """Whether writing path would change `given`, a file the command reads or a folder whose files it reads."""
    if same_file(path, given):
        return True
    if not (given.is_dir() and path.exists()):
        return False
    try:
        return path.resolve().is_relative_to(given.resolve())
    except OSError:
        return False


def writable(path, flag: str = "--out") -> Path:
    """path, whose nearest existing ancestor must be a folder this process can write (where the file and its
    temporary copy go); EdgefedError naming the flag otherwise."""
    path = Path(path)
    folder = next((p for p in (path.parent, *path.parent.parents) if p.exists()), Path.cwd())
    try:  # tried, not asked (os.access says yes to root, and of /proc)
        if not folder.is_dir():
            raise OSError
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".edgefed-probe-")
        os.close(handle)
        os.unlink(probe)
    except OSError:
        raise EdgefedError(f"cannot write {path}: {folder} is not a writable folder; choose another {flag}") from None
    return path


def check_output(path, *, force: bool, inputs=(), flag: str = "--out", example: str = "out",
                 exists=None) -> Path:
    """The path a command may write: not a folder (nor a path ending in "/", which names one), not one of
    `inputs` ((what, path) pairs: the files and folders the command reads), not an existing file unless force,
    and in a writable folder. `exists(path)`: the error for an existing file (default: one that names --force).
    Raises EdgefedError naming the flag and the fix."""
    if isinstance(path, str) and path.endswith(("/", os.sep)):  # (Path() would drop it and write a plain file)
        raise EdgefedError(f"{flag} {path} ends in {path[-1]!r}, which names a folder; give a file to write, e.g. "
                           f"{path}{example}")
    path = Path(path)
    if path.is_dir():
        raise EdgefedError(f"{flag} {path} is a folder; give a file to write, e.g. {path / example}")
    for what, given in inputs:
        if given is not None and is_input(path, Path(given)):
            inside = "" if same_file(path, Path(given)) else f"in {given}, "
            raise EdgefedError(f"{flag} {path} is {inside}{what}, which this command reads; it is never written over, "
                               f"even with --force: choose another {flag}")
    if path.exists() and not force:
        if exists is not None:
            raise exists(path)
        raise EdgefedError(f"{path} already exists; use --force to replace it, or choose another {flag}")
    return writable(path, flag)


def check_folder(folder, names, *, force: bool, inputs=(), flag: str) -> Path:
    """A folder a command writes `names` into: not an existing file, and each of its files checked as
    check_output does."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        what = f" to write {', '.join(names)} into" if names else ""
        raise EdgefedError(f"{flag} {folder} is a file; give a folder{what}")
    for name in names:
        check_output(folder / name, force=force, inputs=inputs, flag=flag, example=name)
    return writable(folder / "x", flag).parent


def remove_stale_copies(path: Path) -> None:
    """Half-written copies of path that a killed process left beside it (".NAME.PID.tmp", PID gone): every
    file edgefed writes whole is written so, then swapped in."""
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        pid = tmp.name[len(path.name) + 2:-4]
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                tmp.unlink(missing_ok=True)
            except PermissionError:
                pass
