"""The rule every file a command writes follows: an existing file is replaced only with --force, never where a
folder is, and never one of the command's own inputs (not even with --force: `export a.h5 --weights a.h5`
would replace the log it reads)."""

from __future__ import annotations

import os
from pathlib import Path

from edgefed.errors import EdgefedError


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one existing file (through links, `..` and case-folding file systems too)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_output(path, *, force: bool, inputs=(), flag: str = "--out", example: str = "out",
                 exists=None) -> Path:
    """The path a command may write: not a folder, not one of `inputs` ((what, path) pairs: the files the
    command reads), and not an existing file unless force. `exists(path)`: the error for an existing file
    (default: one that names --force). Raises EdgefedError naming the flag and the fix."""
    path = Path(path)
    if path.is_dir():
        raise EdgefedError(f"{flag} {path} is a folder; give a file to write, e.g. {path / example}")
    for what, given in inputs:
        if given is not None and same_file(path, Path(given)):
            raise EdgefedError(f"{flag} {path} is {what}, which this command reads; it is never written over, even "
                               f"with --force: choose another {flag}")
    if path.exists() and not force:
        if exists is not None:
            raise exists(path)
        raise EdgefedError(f"{path} already exists; use --force to replace it, or choose another {flag}")
    return path


def check_folder(folder, names, *, force: bool, inputs=(), flag: str) -> Path:
    """A folder a command writes `names` into: not an existing file, and each of its files checked as
    check_output does."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise EdgefedError(f"{flag} {folder} is a file; give a folder to write {', '.join(names)} into")
    for name in names:
        check_output(folder / name, force=force, inputs=inputs, flag=flag, example=name)
    return folder
