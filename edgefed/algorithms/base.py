"""What an algorithm declares and what it provides, for every engine, transport and log to read.

An algorithm is a small frozen object in the spirit of FedJAX's init/apply: it declares the vectors it adds
to FedAvg's (kept by the server and sent down with x, sent back by a device beside Delta x, kept by each
device between rounds) and provides the client update (a local task in, a report out), the server update
(a state in, a new state out) and its devices' starting state. Nothing here knows about transports or
files: the engine asks the declarations how many vectors move and what to log, so a new algorithm is a new
module here and a line in the registry (algorithms/__init__.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

DELTA_X = "delta_x"  # every report carries Delta x_k = y_{k,s_k} - x first


@dataclass(frozen=True)
class ServerVector:
    """A vector of d the server keeps beside x and sends down with it every round (SCAFFOLD's c)."""

    name: str  # its key in ServerState.vectors, and its resume slot state/{name} in the run log
    column: str  # the run-log dataset that stores it at the stored rounds, e.g. "scaffold/c"
    meaning: str


@dataclass(frozen=True)
class DeviceVector:
    """A vector of d each device keeps between rounds (SCAFFOLD's c_k); the log mirrors every device's.

    A device changes it only by adding its report's `delta` once the coordinator has accepted the report,
    so the device, the server and the log apply the same Deltas and never disagree.
    """

    name: str  # its key in a device's `own` mapping, and the log's row state state/{name} (row k: device k)
    column: str  # the run-log dataset of every device's row at the stored rounds ([log] client_controls)
    meaning: str
    delta: str  # the report vector added to it on acceptance
    owner: str  # who keeps it, for messages about its memory: "SCAFFOLD"
    noun: str  # what it is called there: "controls"


@dataclass(frozen=True)
class DeviceRows:
    """A device vector over n devices, held sparse: the rows of the devices whose vector may differ from
    zero (ids ascending, a row each); every other device's row is exactly zero. This is how device state
    moves at scale (a million devices with a few thousand touched): members' rows to `server_start` and
    `federation_changed`, /state to --resume, a rank's rows on load."""

    ids: np.ndarray  # (m,) int64, ascending
    rows: np.ndarray  # (m, d)
    n: int  # devices the vector is over (the members; the federation)

    def take(self, ids: np.ndarray) -> "DeviceRows":
        """The rows of these devices only (ascending ids), over len(ids) devices."""
        keep = np.isin(self.ids, ids)
        return DeviceRows(self.ids[keep], self.rows[keep], int(np.asarray(ids).size))

    def dense(self, ids: np.ndarray | None = None) -> np.ndarray:
        """The rows of these devices (ascending ids; by default devices 0 .. n-1), zero where none is held."""
        ids = np.arange(self.n) if ids is None else np.asarray(ids, np.int64)
        out = np.zeros((ids.size, self.rows.shape[1]), self.rows.dtype)
        found = np.isin(ids, self.ids)
        out[found] = self.rows[np.searchsorted(self.ids, ids[found])]
        return out

    def nonzero(self) -> "DeviceRows":
        """Only the rows that are not +0.0 (nonzero_rows)."""
        keep = nonzero_rows(self.rows)
        return DeviceRows(self.ids[keep], self.rows[keep], self.n)

    def updated(self, ids: np.ndarray, rows: np.ndarray) -> "DeviceRows":
        """These devices' rows replaced (or added) by the given ones (ascending ids)."""
        kept = ~np.isin(self.ids, ids)
        merged = np.concatenate([self.ids[kept], np.asarray(ids, np.int64)])
        order = np.argsort(merged, kind="stable")
        return DeviceRows(merged[order], np.concatenate([self.rows[kept], rows])[order], self.n)


def nonzero_rows(rows: np.ndarray) -> np.ndarray:
    """Which rows hold anything but +0.0 (bit for bit: a -0.0 is kept, so dropping the others is exact)."""
    rows = np.ascontiguousarray(rows)
    return rows.view(np.uint8).reshape(rows.shape[0], rows.itemsize * int(np.prod(rows.shape[1:]))).any(axis=1)


@dataclass(frozen=True)
class ServerState:
    """The server's model and its other vectors after a round; each round makes a new one."""

    x: np.ndarray
    vectors: Mapping[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class LocalTask:
    """One selected device's work in one round, as its client update sees it."""

    x: np.ndarray  # the server model y_{k,0} starts from: never write into it (in the simulator it is the server's)
    server: Mapping[str, np.ndarray]  # the server vectors sent with x, read only
    own: Mapping[str, np.ndarray]  # this device's vectors, read only (they change on acceptance)
    n_steps: int  # steps asked: K_k, or exactly what a trace gives
    lr: float
    batch_size: int | None  # None: the full local gradient
    runner: Callable  # runner(step_fn, n) -> steps taken: all n, or as many as fit the deadline
    stream: Callable  # stream(purpose) -> the model's LocalRun on (seed, purpose, round, device)


@dataclass(frozen=True)
class RoundReports:
    """What a server update sees: the selected devices' reports, a row each in plan order."""

    device_ids: np.ndarray
    vectors: Mapping[str, np.ndarray]  # DELTA_X and the algorithm's report vectors, (S, d) each
    coeffs: np.ndarray  # p_k applied to Delta x_k; 0 where nothing is applied
    reported: np.ndarray  # (S,) bool: the report counts (steps > 0, finite, on time)
    lr_global: float
    n_federation: int  # N_r, devices in the federation this round


class Algorithm:
    """The interface; FedAvg (fedavg.py) is the smallest algorithm that fills it."""

    default_weighting: str
    server_vectors: tuple[ServerVector, ...] = ()
    device_vectors: tuple[DeviceVector, ...] = ()
    report_vectors: tuple[str, ...] = ()  # sent back beside Delta x
    # model methods its updates call beyond local_steps and the evaluation, so a run compiles (and waits
    # for) only the kernels it reaches: "oracle_grad" (one stochastic gradient), "loss_grad" (the full one)
    model_calls: tuple[str, ...] = ()
    # device_start gives zero vectors whatever the device's data: devices start (and arrive) without their
    # data being built, and none of their rows is held until a report changes it
    zero_start: bool = False

    @classmethod
    def from_config(cls, cfg) -> "Algorithm":
        """The algorithm with the settings of its own config table (FedAvg has none)."""
        return cls()

    @property
    def reports(self) -> tuple[str, ...]:
        """Every vector a report carries, Delta x first."""
        return (DELTA_X, *self.report_vectors)

    def client_update(self, model, data, task: LocalTask, out: Mapping[str, np.ndarray]) -> int:
        """Run the local work; write each of `reports` into out[name] (zeros where none); return s_k."""
        raise NotImplementedError

    def server_update(self, state: ServerState, reports: RoundReports) -> ServerState:
        raise NotImplementedError

    def device_start(self, model, data, x: np.ndarray) -> dict[str, np.ndarray]:
        """A device's vectors when it joins the federation at server model x."""
        return {}

    def server_start(self, x0: np.ndarray, member_rows: Mapping[str, DeviceRows]) -> dict[str, np.ndarray]:
        """The server vectors at round 0, given the members' device vectors (DeviceRows over the members:
        only the rows that may differ from zero)."""
        return {}

    def federation_changed(self, state: ServerState, member_rows: Mapping[str, DeviceRows]) -> ServerState:
        """The server state once devices joined or left the objective (member_rows as in server_start)."""
        return state
