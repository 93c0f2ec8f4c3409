"""Which devices' data a process keeps: a device's data is a pure function of (seed, device), so what is dropped
costs only the time to build it again; what is kept is bounded, and chosen by who will ask for it again."""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict

import numpy as np

from edgefed.ids import find


class DeviceCache:
    """The devices' data this process has built, the least recently used dropped beyond `budget` bytes: a
    device's data is a pure function of (seed, device), so dropping it costs only the time to build it again.
    A device's data is kept from its second build on, or from its first if it is one of `keep` (the devices
    evaluated at every evaluation) or `held` (a round's, kept while it runs and let go after unless kept
    for a reason of their own): in a large federation most devices are drawn once in a run, and keeping
    those would fill the budget with data nobody asks for again. Lanes share it from their threads."""

    SEEN = 65_536  # the devices built once that are remembered (the oldest forgotten)

    def __init__(self, build, budget: float, keep=None):
        self.build, self.budget = build, budget
        self._keep = np.zeros(0, np.int64) if keep is None else np.asarray(keep, np.int64)  # ascending
        self._data: OrderedDict[int, object] = OrderedDict()
        self._seen: OrderedDict[int, None] = OrderedDict()  # built once, not kept
        self._held: dict[int, int] = {}  # devices held by the rounds under way (how many hold each)
        self._for_now: set[int] = set()  # kept only because they are held
        self.nbytes = 0
        self._lock = threading.Lock()
        self._building: dict[int, threading.Event] = {}  # a device being built: the others wait for it

    def __call__(self, device_id: int):
        while True:
            with self._lock:
                data = self._data.get(device_id)
                if data is not None:
                    self._data.move_to_end(device_id)
                    return data
                pending = self._building.get(device_id)
                if pending is None:  # this thread builds it (a problem's build is not safe twice at once)
                    pending = self._building[device_id] = threading.Event()
                    break
                self._seen[device_id] = None  # asked for again while being built: kept
            pending.wait()
        try:
            data = self.build(device_id)  # outside the lock: other devices' lanes go on meanwhile
            with self._lock:
                kept = self.keeps(device_id)
                if not kept and device_id not in self._seen and device_id in self._held:
                    self._for_now.add(device_id)
                elif not kept and device_id not in self._seen:  # a first build: remembered, not kept
                    self._remember(device_id)
                    return data
                self._seen.pop(device_id, None)
                self._data[device_id] = data
                self.nbytes += _nbytes(data)
                while self.nbytes > self.budget and len(self._data) > 1:
                    _, dropped = self._data.popitem(last=False)
                    self.nbytes -= _nbytes(dropped)
            return data
        finally:
            with self._lock:
                del self._building[device_id]
            pending.set()

    def keeps(self, device_id: int) -> bool:
        """Whether this device's data is kept from its first build (one of `keep`)."""
        return bool(find(self._keep, [device_id])[1][0])

    @contextlib.contextmanager
    def held(self, device_ids):
        """Keep these devices' data while the block runs (a round's: built before its lanes start, read by
        them); after it, one kept only for that is let go and counts as built once."""
        ids = [int(k) for k in device_ids]
        with self._lock:
            for k in ids:
                self._held[k] = self._held.get(k, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                for k in ids:
                    self._held[k] -= 1
                    if self._held[k]:
                        continue
                    del self._held[k]
                    if k in self._for_now:
                        self._for_now.discard(k)
                        dropped = self._data.pop(k, None)
                        if dropped is not None:
                            self.nbytes -= _nbytes(dropped)
                        self._remember(k)

    def _remember(self, device_id: int) -> None:
        """Note a device built once (the oldest such note forgotten beyond SEEN)."""
        self._seen[device_id] = None
        if len(self._seen) > self.SEEN:
            self._seen.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._seen.clear()
            self._for_now.clear()
            self.nbytes = 0


def _nbytes(data) -> int:
    return sum(v.nbytes for v in vars(data).values() if isinstance(v, np.ndarray))
