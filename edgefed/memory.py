"""How much memory this process may use, and sizes in words: what every estimate that refuses a run before it
allocates (a model's layers, the devices' data and vectors) compares against."""

from __future__ import annotations

import sys

import psutil

try:
    import resource
except ImportError:  # not on Windows: no address-space limit to read
    resource = None


def memory_limit() -> tuple[int, str]:
    """(bytes this process may use, what sets it): the memory the machine has available, or the address-space
    limit (ulimit -v, a batch system's) when that is lower."""
    mine = psutil.Process().memory_info()
    limit, what = psutil.virtual_memory().available + mine.rss, "the memory available"
    soft = resource.getrlimit(resource.RLIMIT_AS)[0] if resource is not None else -1
    if soft not in (-1, getattr(resource, "RLIM_INFINITY", -1)):
        # the address space counts what the process has mapped already (libraries, reserved arenas)
        room = max(soft - mine.vms, 0) + mine.rss
        if room < limit:
            limit, what = room, "the address-space limit"
    return limit, what


def size_text(n: float) -> str:
    """12 B, 3.4 KB, 5.6 MB, 7.8 GB."""
    for unit in ("B", "KB", "MB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes (0 where the system does not say)."""
    if resource is None:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # (Linux says KB, macOS bytes)
