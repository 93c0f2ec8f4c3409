"""An MPI world inside one process: ranks are threads, messages are byte copies.

It implements what edgefed's runtime calls on a communicator (buffer Ibcast, Isend / Irecv / Iprobe /
Recv, and the pickled bcast / gather of setup) with MPI's ordering rules: collectives match in call
order, point-to-point messages between two ranks arrive in order. A sent buffer is read only when the
receiver takes it, and the send completes only then, as MPI allows: a sender that reuses its buffer before
its request completes sends what it wrote later. So the coordinator, the device servers and the rank roles
run unchanged, and the wire protocol is tested without mpiexec. `mpi_of(comm)` finds BYTE, ANY_SOURCE,
ANY_TAG and Status in this module.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections import deque

import numpy as np

ANY_SOURCE, ANY_TAG = -2, -1
BYTE = "byte"
POLL_S = 20e-6


class Status:
    def __init__(self):
        self.source = self.tag = self.count = None

    def Get_source(self):
        return self.source

    def Get_tag(self):
        return self.tag

    def Get_count(self, datatype=BYTE):
        return self.count


class Request:
    """Test() is True once poll() has succeeded."""

    def __init__(self, poll=None):
        self._poll, self._done = poll, poll is None

    def Test(self):
        if not self._done:
            self._done = self._poll()
        return self._done


class Aborted(Exception):
    pass


class Message:
    """A buffer on its way: read when taken, its send complete from then on."""

    def __init__(self, source: int, tag: int, view: np.ndarray):
        self.source, self.tag, self.view, self.taken = source, tag, view, False

    def take_into(self, view: np.ndarray) -> None:
        view[: self.view.size] = self.view
        self.taken = True


class World:
    def __init__(self, size: int):
        self.size = size
        self.lock = threading.Lock()
        self.mail = [deque() for _ in range(size)]  # Messages waiting at each rank
        self.broadcasts = [deque() for _ in range(size)]  # the root's Messages, one per receiving rank
        self.objects = [deque() for _ in range(size)]  # pickled bcast payloads, per receiving rank
        self.gathered = deque()  # (rank, pickled) sent to the root
        self.everyone = []  # (rank, pickled) of every allgather, in turn
        self.aborted = None
        self.sent = []  # (source, dest, tag, bytes) of every point-to-point message; dest -1, tag None: Ibcast

    def comm(self, rank: int) -> "Comm":
        return Comm(self, rank)

    def run(self, mains, timeout_s: float = 120.0) -> dict:
        """mains[rank](comm) on a thread each; returns {rank: result}; a hang or an error fails loudly."""
        results, errors = {}, {}

        def go(rank):
            try:
                results[rank] = mains[rank](self.comm(rank))
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                errors[rank] = exc
                with self.lock:
                    self.aborted = self.aborted or f"rank {rank}: {exc!r}"

        threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"ranks still running after {timeout_s} s (a hang); aborted: {self.aborted}")
        if errors:
            raise next(iter(errors.values()))
        return results


def _view(buf) -> np.ndarray:
    if isinstance(buf, (list, tuple)):  # [buffer, datatype]
        buf = buf[0]
    return np.asarray(buf).reshape(-1).view(np.uint8)


class Comm:
    def __init__(self, world: World, rank: int):
        self.world, self.rank = world, rank
        self._allgathers = 0

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.world.size

    def _wait(self, poll):
        while not poll():
            if self.world.aborted:
                raise Aborted(self.world.aborted)
            time.sleep(POLL_S)

    # -- buffers ---------------------------------------------------------------------------------------
    def Ibcast(self, buf, root=0):
        view, w = _view(buf), self.world
        if self.rank == root:
            w.sent.append((root, -1, None, view.nbytes))
            sent = [Message(root, 0, view) for r in range(w.size) if r != root]
            with w.lock:
                for r, message in zip((r for r in range(w.size) if r != root), sent):
                    w.broadcasts[r].append(message)
            return Request(lambda: all(m.taken for m in sent))

        def poll():
            with w.lock:
                if not w.broadcasts[self.rank]:
                    return False
                w.broadcasts[self.rank].popleft().take_into(view)
            return True

        return Request(poll)

    def Isend(self, buf, dest, tag=0):
        message = Message(self.rank, tag, _view(buf))
        with self.world.lock:
            self.world.sent.append((self.rank, dest, tag, message.view.nbytes))
            self.world.mail[dest].append(message)
        return Request(lambda: message.taken)

    def _take(self, source, tag, into=None, status=None, remove=True):
        box = self.world.mail[self.rank]
        with self.world.lock:
            for i, message in enumerate(box):
                if source in (ANY_SOURCE, message.source) and tag in (ANY_TAG, message.tag):
                    if status is not None:
                        status.source, status.tag, status.count = message.source, message.tag, message.view.size
                    if remove:
                        del box[i]
                        message.take_into(_view(into))
                    return True
            return False

    def Iprobe(self, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        return self._take(source, tag, status=status, remove=False)

    def Recv(self, buf, source=ANY_SOURCE, tag=ANY_TAG):
        self._wait(lambda: self._take(source, tag, into=buf))

    def Irecv(self, buf, source=ANY_SOURCE, tag=ANY_TAG):
        return Request(lambda: self._take(source, tag, into=buf))

    # -- pickled setup ----------------------------------------------------------------------------------
    def bcast(self, obj, root=0):
        w = self.world
        if self.rank == root:
            data = pickle.dumps(obj)
            with w.lock:
                for r in range(w.size):
                    if r != root:
                        w.objects[r].append(data)
            return obj
        got = []

        def poll():
            with w.lock:
                if w.objects[self.rank]:
                    got.append(w.objects[self.rank].popleft())
            return bool(got)

        self._wait(poll)
        return pickle.loads(got[0])

    def allgather(self, obj):
        w = self.world
        with w.lock:
            w.everyone.append((self.rank, pickle.dumps(obj)))
        self._wait(lambda: len(w.everyone) >= w.size * (1 + self._allgathers))
        with w.lock:
            batch = list(w.everyone)[self._allgathers * w.size:(self._allgathers + 1) * w.size]
        self._allgathers += 1
        return [pickle.loads(d) for _, d in sorted(batch)]

    def gather(self, obj, root=0):
        w = self.world
        if self.rank != root:
            with w.lock:
                w.gathered.append((self.rank, pickle.dumps(obj)))
            return None
        self._wait(lambda: len(w.gathered) >= w.size - 1)
        with w.lock:
            items = dict((r, pickle.loads(d)) for r, d in w.gathered)
            w.gathered.clear()
        return [obj if r == root else items[r] for r in range(w.size)]

    def Abort(self, code=1):
        with self.world.lock:
            self.world.aborted = self.world.aborted or f"rank {self.rank} aborted with {code}"
        raise Aborted(self.world.aborted)
