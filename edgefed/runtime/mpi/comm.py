"""MPI itself: the world (only when launched by mpirun), sleeping waits, and taking the world down.

Waiting never spins: every wait is a non-blocking request polled with short sleeps (MPICH's blocking calls
keep a core at 99 %). mpi4py is imported only when a launcher started more than one rank, so the simulator
never touches MPI.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import threading
import time
from pathlib import Path

from edgefed.errors import EdgefedError

POLL_MAX_S = 0.001
SPIN_S = 300e-6
ABORT_GRACE_S = 0.2

_ENV_SIZES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def launched_size() -> int:
    """World size announced by the launcher's environment (1 when not under mpirun/mpiexec)."""
    for name in _ENV_SIZES:
        value = os.environ.get(name)
        if value and value.isdigit():
            return int(value)
    return 1


def local_mpiexec() -> str | None:
    """The mpiexec beside this Python (the `mpi` extra's MPICH wheel), else the first on PATH, else None."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def outside_world_env(environ=None) -> dict:
    """The environment without any MPI launcher's variables: what a process that starts a world of its own
    (a test, the launcher, a benchmark) hands to it, even when it runs inside a world itself."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_", "MPI_LOCAL", "MV2_"))}


def world():
    """COMM_WORLD when launched with more than one rank, else None (the simulator runs, MPI stays untouched)."""
    if launched_size() <= 1:
        return None
    try:
        import mpi4py

        mpi4py.rc.thread_level = "funneled"  # only the main thread of a rank calls MPI
        from mpi4py import MPI
    except (ImportError, RuntimeError) as exc:
        raise EdgefedError(f"this run was started by mpirun but MPI cannot be loaded ({exc}); "
                           "install it with pip install 'edgefed[mpi]' (or your system's MPI and mpi4py)") from None
    comm = MPI.COMM_WORLD
    return comm if comm.Get_size() > 1 else None


def mpi_of(comm):
    """The MPI module a communicator comes from: mpi4py.MPI, or a test's in-process world (the runtime uses
    only its BYTE, ANY_SOURCE, ANY_TAG and Status beside the communicator's own methods)."""
    return importlib.import_module(type(comm).__module__)


class Backoff:
    """Pause between polls without burning a core: spin for SPIN_S, then sleeps doubling up to poll_max_s.

    The brief spin matters: a large non-blocking broadcast only advances when it is tested.
    """

    def __init__(self, poll_max_s=POLL_MAX_S, wake: threading.Event | None = None):
        """poll_max_s: seconds, or a function giving them now (a device rank polls less while its devices work)."""
        self.poll_max_s = poll_max_s if callable(poll_max_s) else (lambda: poll_max_s)
        self.start = time.perf_counter()
        self.sleep = 20e-6
        self.wake = wake  # set by another thread to end a sleep early (a device's work finished)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def pause(self) -> None:
        if self.elapsed() > SPIN_S:
            if self.wake is None:
                time.sleep(self.sleep)
            elif self.wake.wait(self.sleep):
                self.wake.clear()
                self.sleep = 20e-6
                return
            self.sleep = min(self.sleep * 2, self.poll_max_s())

    def reset(self) -> None:
        self.sleep = 20e-6


def wait(req, poll_max_s=POLL_MAX_S, also=None, wake: threading.Event | None = None) -> None:
    """Wait for a request without burning a core; `also()` runs between polls (a device rank sends finished
    work while it waits for the next command), at once when `wake` is set."""
    backoff = Backoff(poll_max_s, wake)
    while not req.Test():
        if also is not None:
            also()
        backoff.pause()


def abort_with(comm, message: str, code: int = 1, error: bool = True) -> int:
    """Print this rank's error (error False: why it ends the world) and take the whole world down (as
    `python -m mpi4py` does); the code, should the abort come back."""
    said = f"error on rank {comm.Get_rank()}" if error else f"rank {comm.Get_rank()}"
    print(f"edgefed: {said}: {message}", file=sys.stderr, flush=True)
    time.sleep(ABORT_GRACE_S)  # the launcher forwards a rank's stderr asynchronously; an abort can outrun it
    comm.Abort(code)
    return code
