"""Which live process writes a file: an exclusive lock on a small file beside it (".NAME.writer"), which the
operating system lets go of when the process ends, however it ends.

A run holds its log from before its first byte until it closes it, so a second process (a `--resume` started
by hand or by a watchdog, a `--force` run on the same `--out`) learns that the log is being written and goes
no further, instead of swapping its own copy in under the live run. Readers take no lock: a summary, a
report or h5dump of a live log is never refused. The lock file holds the writer's process id and host (for
the message) and is removed by its holder when it lets go; one that a killed process left behind is taken
over as it stands. Where the system has no `flock` (Windows) or the folder cannot take the lock file, nothing
is held and the atomic swaps of the log still keep it whole.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

_held: dict[str, int] = {}  # the files this process holds: their lock file's descriptor


def _lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.writer")


def _key(path: Path) -> str:
    return os.path.abspath(path)


def hold(path) -> str | None:
    """Hold path for this process to write; None when it is held (or nothing can be held here), else who
    holds it ("process 1234 on host pi-a"). Holding a file this process already holds is a no-op."""
    path = Path(path)
    if fcntl is None or _key(path) in _held:
        return None
    lock = _lock_path(path)
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return None  # a folder that cannot take it cannot take the log either: writing it says why
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder(fd)
            os.close(fd)
            return holder
        try:
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                break  # (else its holder removed it between our open and our lock: take the new one)
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    _held[_key(path)] = fd
    return None


def let_go(path) -> None:
    """Stop holding path (nothing if this process does not hold it)."""
    path = Path(path)
    fd = _held.pop(_key(path), None)
    if fd is None:
        return
    try:
        os.unlink(_lock_path(path))  # removed while still locked, so no one takes a file about to go
    except OSError:
        pass
    os.close(fd)


def _holder(fd: int) -> str:
    try:
        pid, _, host = os.pread(fd, 256, 0).decode(errors="replace").strip().partition(" ")
    except OSError:
        pid, host = "", ""
    if not pid.isdigit():
        return "another process"
    return f"process {pid}" + (f" on {host}" if host and host != socket.gethostname() else "")
