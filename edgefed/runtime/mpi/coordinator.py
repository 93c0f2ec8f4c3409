"""Rank 0's side of a distributed run: the engine's transport, moving buffers to and from the device ranks.

Per round: down, an `Ibcast` of the command record (the plan, and which reports of the previous round were
applied) and of the server state; up, one point-to-point message per device rank, so a rank that misses its
deadline holds nobody up: a report that comes after deadline + grace is dropped (and its device keeps its
own vectors, since it applies its Deltas only once a command names it accepted). All buffers are allocated
here once; the records are protocol.py's.
"""

from __future__ import annotations

import numpy as np

from edgefed.runtime.mpi import protocol
from edgefed.runtime.mpi.comm import POLL_MAX_S, Backoff, mpi_of, wait
from edgefed.runtime.mpi.protocol import Wire
from edgefed.transport import Evaluation, LocalResults, RoundPlan


class MpiTransport:
    def __init__(self, comm, wire: Wire, owners: np.ndarray, poll_max_s: float = POLL_MAX_S):
        self.comm, self.wire, self.owners, self.poll = comm, wire, owners, poll_max_s
        self.MPI = MPI = mpi_of(comm)
        self.command = wire.command_buffer()
        self.state = wire.state_buffer()
        self.hosted = {r: np.flatnonzero(owners == r) for r in range(1, comm.Get_size())}
        self._recv = {r: np.zeros(max(ids.size, 1) * wire.record_bytes(), np.uint8) for r, ids in self.hosted.items()}
        self._accepted = None  # (round, device ids) to announce with the next command
        self._status = MPI.Status()

    # -- down ---------------------------------------------------------------------------------------------
    def _command(self, command: int, plan: RoundPlan | None = None, devices=None, x=None, vectors=None) -> None:
        self.wire.encode_command(self.command, command, plan, devices, self._accepted)
        self._accepted = None
        wait(self.comm.Ibcast(self.command.view(np.uint8), root=0), self.poll)
        if x is not None:
            self.wire.pack_state(self.state, x, vectors)
            wait(self.comm.Ibcast(self.state, root=0), self.poll)

    # -- up -----------------------------------------------------------------------------------------------
    def _collect(self, tag: int, ranks, round_idx: int | None = None, timeout_s: float | None = None) -> dict:
        """One message per rank in `ranks` with this tag (work: of this round); anything else that arrives is
        an old late report, received and dropped."""
        MPI, status = self.MPI, self._status
        record = self.wire.tags[tag]
        got, expected = {}, set(int(r) for r in ranks)
        backoff = Backoff(self.poll)
        while expected - set(got):
            if self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                src, msg_tag, nbytes = status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)
                buf = self._recv[src]
                self.comm.Recv([buf[:nbytes], MPI.BYTE], source=src, tag=msg_tag)
                if msg_tag == tag and src in expected:
                    records = buf[:nbytes].view(record)
                    if round_idx is None or (records.size and records[0]["round"] == round_idx):
                        got[src] = records.copy()
                backoff.reset()
                continue
            if timeout_s is not None and backoff.elapsed() > timeout_s:
                break
            backoff.pause()
        return got

    # -- the transport interface --------------------------------------------------------------------------
    def local_work(self, plan: RoundPlan, state) -> LocalResults:
        self._command(protocol.ROUND, plan, x=state.x, vectors=state.vectors)
        owners = self.owners[plan.device_ids]
        ranks = np.unique(owners)
        timeout = None
        if plan.deadline_s is not None:  # a rank runs its devices one after another
            timeout = max((float(plan.deadline_s[owners == r].sum()) for r in ranks), default=0.0) + plan.grace_s
        got = self._collect(protocol.TAG_WORK, ranks, plan.round_idx, timeout)
        return self.wire.unpack_work(plan, got.values())

    def accept(self, round_idx: int, device_ids: np.ndarray) -> None:
        """Sent with the next command: the devices whose reports of round_idx were applied."""
        self._accepted = (round_idx, np.asarray(device_ids))

    def evaluate(self, x: np.ndarray) -> Evaluation:
        self._command(protocol.EVAL, x=x)
        got = self._collect(protocol.TAG_EVAL, [r for r, ids in self.hosted.items() if ids.size])
        return self.wire.unpack_evaluation(got.values())

    def start_devices(self, x: np.ndarray, device_ids: np.ndarray) -> dict[str, np.ndarray]:
        """Fresh device vectors for these devices, joining at x; returns their rows in device_ids order."""
        device_ids = np.asarray(device_ids)
        self._command(protocol.START_DEVICES, devices=device_ids, x=x)
        got = self._collect(protocol.TAG_ROWS, np.unique(self.owners[device_ids]))
        return self.wire.unpack_rows(got.values(), device_ids)

    def load_devices(self, rows: dict[str, np.ndarray]) -> None:
        """Every device's vectors (row k: device k) to the rank hosting it."""
        self._command(protocol.LOAD_DEVICES)
        for rank, ids in self.hosted.items():
            if ids.size:
                records = np.zeros(ids.size, self.wire.rows)
                self.wire.pack_rows(records, ids, {name: values[ids] for name, values in rows.items()})
                wait(self.comm.Isend(records.view(np.uint8), dest=rank, tag=protocol.TAG_LOAD), self.poll)

    def close(self, failed: bool = False) -> None:
        """Tell the device ranks to stop and drain what they still send until each says goodbye.

        Draining lets a late report that is still on its way complete, so no rank hangs on it at exit.
        After a failure the caller aborts the world instead.
        """
        if not failed:
            self._command(protocol.STOP)
            self._collect(protocol.TAG_BYE, list(self.hosted))
