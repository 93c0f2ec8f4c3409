"""Rank 0's side of a distributed run: the engine's transport, moving buffers to and from the device ranks.

Per round: down, an `Ibcast` of the command record (the plan, and which reports of the previous round were
applied) and of the server state; up, one point-to-point message per device rank (per device, when the
round is over-selected and ends by arrival), so a rank that misses its deadline holds nobody up: a report
that comes after deadline + grace is dropped (and its device keeps its own vectors, since it applies its
Deltas only once a command names it accepted). All buffers are allocated here once; the records are
protocol.py's.

The round's clock starts as its command leaves; each report is timed as it arrives, so a device's
communication time (download, upload, waiting) is its arrival less its local work, and its link alone
that less the time its report waited on the rank.

Every message from a rank, heartbeats included, says it is alive. A rank the coordinator waits on that has
said nothing for `rank_timeout_s` is lost (RankLost): it is hung or its board is gone, and waiting longer
would only cost every round it is selected in. The caller ends the world, naming the rank and its host.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections import deque

import numpy as np

from edgefed.algorithms.base import DeviceRows
from edgefed.errors import RankLost
from edgefed.runtime.mpi import protocol
from edgefed.secagg import protocol as secagg
from edgefed.runtime.mpi.comm import POLL_MAX_S, Backoff, mpi_of, wait
from edgefed.runtime.mpi.protocol import Wire
from edgefed.transport import Evaluation, LocalResults, RoundPlan


class MpiTransport:
    def __init__(self, comm, wire: Wire, owners: np.ndarray, threads=None, poll_max_s: float = POLL_MAX_S,
                 rank_timeout_s: float | None = None, hosts: dict | None = None):
        """threads: {rank: devices it runs at once} (default 1 each); hosts: {rank: host name}, for messages."""
        self.comm, self.wire, self.owners, self.poll = comm, wire, owners, poll_max_s
        self.threads = threads or {}
        self.rank_timeout_s, self.hosts = rank_timeout_s, hosts or {}
        self._heard = {r: time.perf_counter() for r in range(1, comm.Get_size())}
        self._beat = np.zeros(1, np.int64)
        self._checked = 0.0
        self.MPI = MPI = mpi_of(comm)
        self.command = wire.command_buffer()
        self.state = wire.state_buffer()
        self.hosted = {r: np.flatnonzero(owners == r) for r in range(1, comm.Get_size())}
        self._recv = {r: np.zeros(max(ids.size, 1) * wire.record_bytes(), np.uint8) for r, ids in self.hosted.items()}
        self._accepted = None  # (round, device ids) to announce with the next command
        self._down = wire.downlink_buffer()
        self._copy_sent = False  # the ranks hold the copy a compressed downlink's differences add to
        self._residuals = (None, {})  # (round, {device: its residual record}) as they arrive
        self._sending = []  # async: (request, buffer) of the tasks still on their way
        self._out = {}  # async: device -> (its task's plan, when it was sent)
        self._arrived = deque()  # async: (work record, when) of the reports not yet taken
        self._status = MPI.Status()
        self._peaks = {}  # rank -> its peak resident memory, as its work and evaluation records say

    # -- down ---------------------------------------------------------------------------------------------
    def _command(self, command: int, plan: RoundPlan | None = None, devices=None, x=None, vectors=None,
                 downlink=None, relayed: np.ndarray | None = None, **fields) -> None:
        """downlink: a round's encoded differences, sent instead of the state once the ranks hold the copy
        they add to (the first round, and the first after a resume, sends that copy in full); relayed: the
        bytes a SECAGG command broadcasts after it; fields: the rest of the command record (a SECAGG
        command's round and phase)."""
        encoded = downlink is not None and self._copy_sent
        nbytes = 0 if relayed is None else relayed.size
        self.wire.encode_command(self.command, command, plan, devices, self._accepted, downlink=encoded,
                                 payload_bytes=nbytes, **fields)
        self._accepted = None
        wait(self.comm.Ibcast(self.command.head.view(np.uint8), root=0), self.poll, also=self._listen)
        body = self.command.body()
        if body.size:  # (every rank knows it follows from the head)
            wait(self.comm.Ibcast(body, root=0), self.poll, also=self._listen)
        if nbytes:
            wait(self.comm.Ibcast(relayed, root=0), self.poll, also=self._listen)
        elif encoded:
            self.wire.pack_downlink(self._down, downlink)
            wait(self.comm.Ibcast(self._down, root=0), self.poll, also=self._listen)
        elif x is not None:
            self.wire.pack_state(self.state, x, vectors)
            wait(self.comm.Ibcast(self.state, root=0), self.poll, also=self._listen)
            self._copy_sent = self._copy_sent or downlink is not None

    # -- who is alive -------------------------------------------------------------------------------------
    def _listen(self) -> None:
        """While a broadcast waits (on every rank, a stopped one included): take heartbeats, check silence."""
        status = self._status
        while self.comm.Iprobe(self.MPI.ANY_SOURCE, protocol.TAG_ALIVE, status):
            src = status.Get_source()
            self.comm.Recv(self._beat, source=src, tag=protocol.TAG_ALIVE)
            self._heard[src] = time.perf_counter()
        self._check_alive(self._heard)

    def _check_alive(self, ranks) -> None:
        """RankLost for the first of `ranks` (or of `ranks()`) silent past the timeout; looks every 50 ms."""
        now = time.perf_counter()
        if self.rank_timeout_s is None or now - self._checked < 0.05:
            return
        self._checked = now
        for rank in (ranks() if callable(ranks) else ranks):
            silent = now - self._heard[rank]
            if silent > self.rank_timeout_s:
                raise RankLost(int(rank), silent, self.hosts.get(int(rank)))

    # -- up -----------------------------------------------------------------------------------------------
    def _receive(self):
        """(source, tag, the bytes in its receive buffer) of a message waiting from any rank, or None; a
        message of any kind says its rank is alive."""
        MPI, status = self.MPI, self._status
        if not self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
            return None
        src, tag, nbytes = status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)
        if nbytes > self._recv[src].size:  # secure aggregation's replies grow with the neighbourhood
            self._recv[src] = np.zeros(nbytes, np.uint8)
        raw = self._recv[src][:nbytes]
        self.comm.Recv([raw, MPI.BYTE], source=src, tag=tag)
        self._heard[src] = time.perf_counter()
        if tag in (protocol.TAG_WORK, protocol.TAG_EVAL) and nbytes:
            peak = int(raw.view(self.wire.tags[tag])["peak_rss"].max())
            self._peaks[src] = max(self._peaks.get(src, 0), peak)
        return src, tag, raw

    def peak_rss(self) -> dict[int, int]:
        """Each device rank's peak resident memory, bytes, as its reports last said."""
        return dict(self._peaks)

    def _collect(self, tag: int, ranks, unpack=None) -> dict:
        """One message per rank in `ranks` with this tag, as unpack(bytes) makes it (default: the tag's records;
        None: not the one awaited, dropped); anything else that arrives is an old late report, dropped."""
        if unpack is None:
            unpack = lambda raw: raw.view(self.wire.tags[tag]).copy()  # noqa: E731
        got, expected = {}, set(int(r) for r in ranks)
        backoff = Backoff(self.poll)
        while expected - set(got):
            message = self._receive()
            if message is not None:
                src, msg_tag, raw = message
                self._keep_task_report(msg_tag, raw)
                if msg_tag == tag and src in expected:
                    value = unpack(raw)
                    if value is not None:
                        got[src] = value
                backoff.reset()
                continue
            self._check_alive(lambda: expected - set(got))
            backoff.pause()
        return got

    # -- the transport interface --------------------------------------------------------------------------
    def local_work(self, plan: RoundPlan, state, downlink=None) -> LocalResults:
        t0 = time.perf_counter()
        self._command(protocol.ROUND, plan, x=state.x, vectors=state.vectors, downlink=downlink)
        messages, arrivals, ended = self._collect_work(plan, t0, self._timeout(plan))
        return dataclasses.replace(self.wire.unpack_work(plan, messages, arrivals), round_s=ended)

    def _timeout(self, plan: RoundPlan) -> float | None:
        """How long a round can take: a rank runs its selected devices in its lanes (dealt in turn), each
        lane's devices one after another, each for up to its deadline."""
        if plan.deadline_s is None:
            return None
        due = plan.deadline_s if plan.round_deadline_s is None else np.maximum(plan.deadline_s, plan.round_deadline_s)
        owners = self.owners[plan.device_ids]
        longest = 0.0
        for r in np.unique(owners):
            mine, lanes = due[owners == r], self.threads.get(int(r), 1)
            longest = max(longest, max(float(mine[t::lanes].sum()) for t in range(min(lanes, mine.size))))
        return longest + plan.grace_s

    def _collect_work(self, plan: RoundPlan, t0: float, timeout_s: float | None):
        """The round's work records as they arrive, with their arrival times. With over-selection by arrival,
        once `quorum` devices have completed their budget the ranks still working are told to stop, and
        what they did is collected for up to grace_s more. Also returns when the round ended: the quorum's
        arrival, else the last report's or the timeout."""
        record = self.wire.work
        budget = dict(zip(plan.device_ids.tolist(), plan.budgets.tolist()))
        pending, messages, arrivals = set(budget), [], []
        complete, stopped_at = 0, None
        backoff = Backoff(self.poll)
        while pending:
            message = self._receive()
            if message is not None:
                src, msg_tag, raw = message
                if msg_tag == protocol.TAG_RESIDUAL:
                    self._keep_residuals(raw)
                records = raw.view(record) if msg_tag == protocol.TAG_WORK else None
                if records is not None and records.size and records[0]["round"] == plan.round_idx:
                    messages.append(records.copy())
                    arrivals.append(time.perf_counter() - t0)
                    pending -= set(records["device"].tolist())
                    complete += sum(1 for rec in records if not rec["late"] and rec["steps"] == budget[int(rec["device"])])
                    if plan.by_arrival and stopped_at is None and complete >= plan.quorum and pending:
                        stopped_at = time.perf_counter()
                        self._stop_devices(plan.round_idx, pending)
                backoff.reset()  # anything else is a late report of an older round: dropped
                continue
            if stopped_at is not None and time.perf_counter() - stopped_at > plan.grace_s:
                break
            if timeout_s is not None and backoff.elapsed() > timeout_s:
                break
            # every device rank, not only those whose reports are awaited: one stopped after it reported can
            # hold another's next broadcast up (a collective passes through it), and that one, alive and
            # beating, would be waited for forever
            self._check_alive(self._heard)
            backoff.pause()
        ended = (time.perf_counter() if stopped_at is None else stopped_at) - t0
        return messages, arrivals, ended

    def _stop_devices(self, round_idx: int, device_ids) -> None:
        """The round has what it needs: the ranks of these devices stop their work of round_idx."""
        message = np.array([round_idx], np.int64)
        for rank in np.unique(self.owners[np.fromiter(device_ids, np.int64)]):
            wait(self.comm.Isend(message, dest=int(rank), tag=protocol.TAG_CANCEL), self.poll)

    def _keep_residuals(self, raw: np.ndarray) -> None:
        records = raw.view(self.wire.residual)
        if not records.size:
            return
        round_idx = int(records[0]["round"])
        if round_idx != self._residuals[0]:
            if self._residuals[0] is not None and round_idx < self._residuals[0]:
                return  # of a round already over: its devices' reports were not taken
            self._residuals = (round_idx, {})
        for rec in records:
            self._residuals[1][int(rec["device"])] = rec.copy()

    def residuals(self, round_idx: int, device_ids: np.ndarray) -> dict[str, np.ndarray]:
        """The residuals these devices' reports of round_idx leave them, waited for: each rank sends them
        right after its reports."""
        wanted = [int(k) for k in device_ids]
        backoff = Backoff(self.poll)

        def missing():
            got = self._residuals[1] if self._residuals[0] == round_idx else {}
            return [k for k in wanted if k not in got]

        while missing():
            message = self._receive()
            if message is not None:
                src, msg_tag, raw = message
                if msg_tag == protocol.TAG_RESIDUAL:
                    self._keep_residuals(raw)
                backoff.reset()  # anything else is a late report: dropped
                continue
            self._check_alive(self._heard)  # (every device rank: as for the work)
            backoff.pause()
        got = self._residuals[1]
        return {name: np.array([got[k]["vectors"][j] for k in wanted]).reshape(len(wanted), self.wire.dim)
                for j, name in enumerate(self.wire.residuals)}

    # -- secure aggregation: the server relays the protocol's records ---------------------------------
    def secagg_keys(self, plan: RoundPlan) -> np.ndarray:
        return self._secagg(protocol.KEYS, plan.round_idx, plan.device_ids, secagg.KEYS, plan=plan)

    def secagg_shares(self, round_idx: int, keys: np.ndarray) -> np.ndarray:
        return self._secagg(protocol.SHARES, round_idx, keys["device"], secagg.SHARE, keys)

    def secagg_deliver(self, round_idx: int, shares: np.ndarray) -> None:
        """Each rank gets the sealed shares addressed to its devices, point to point."""
        receivers = np.unique(shares["receiver"])
        self._secagg(protocol.DELIVER, round_idx, receivers, None)
        owner = self.owners[shares["receiver"]]
        sends = []
        for rank in np.unique(self.owners[receivers]).tolist():
            raw = self.wire.pack_secagg(round_idx, protocol.DELIVER, shares[owner == rank])
            sends.append((self.comm.Isend([raw, self.MPI.BYTE], dest=int(rank), tag=protocol.TAG_SECAGG), raw))
        for req, _ in sends:
            wait(req, self.poll, also=self._listen)

    def secagg_reveal(self, round_idx: int, survivors: np.ndarray) -> np.ndarray:
        return self._secagg(protocol.REVEAL, round_idx, survivors, secagg.REVEAL)

    def _secagg(self, phase: int, round_idx: int, devices, dtype, payload: np.ndarray | None = None, plan=None):
        """One phase: the command (and the records it relays) to every rank, the records of the ranks that host
        `devices` back, in ascending device order (dtype None: no reply); plan: the round's, whose entries the
        KEYS command carries (a device's [submodel] width: the slice its masks cover)."""
        devices = np.asarray(devices, np.int64)
        relayed = None if payload is None else np.ascontiguousarray(payload).view(np.uint8)
        self._command(protocol.SECAGG, plan, devices, relayed=relayed, round_idx=round_idx, phase=phase)
        if dtype is None:
            return None

        def unpack(raw):
            got_round, got_phase, records = self.wire.unpack_secagg(raw, dtype)
            return records if (got_round, got_phase) == (round_idx, phase) else None

        got = self._collect(protocol.TAG_SECAGG, np.unique(self.owners[devices]), unpack)
        records = np.concatenate([got[r] for r in sorted(got)]) if got else np.zeros(0, dtype)
        key = records.dtype.names[0]  # device, sender, holder: the records in their device's order
        return records[np.argsort(records[key], kind="stable")]

    # -- async: tasks one by one, reports as they come -------------------------------------------------
    def start_task(self, plan: RoundPlan, x: np.ndarray) -> None:
        """Send one device's task (a plan of one device) and the model it starts from to its rank."""
        raw = self.wire.pack_task(plan, x)
        self._sending = [(req, buf) for req, buf in self._sending if not req.Test()]
        device = int(plan.device_ids[0])
        self._out[device] = (plan, time.perf_counter())
        self._sending.append((self.comm.Isend([raw, self.MPI.BYTE], dest=int(self.owners[device]),
                                              tag=protocol.TAG_TASK), raw))

    def _keep_task_report(self, tag: int, raw: np.ndarray) -> None:
        """An async task's report that came while something else was collected (an evaluation): kept, with
        when it came, for next_report."""
        if tag == protocol.TAG_WORK and self._out:
            records = raw.view(self.wire.work)
            if records.size and int(records[0]["device"]) in self._out:
                self._arrived.append((records.copy(), time.perf_counter()))

    def next_report(self) -> tuple[int, LocalResults, float]:
        """(device, its report, when it came: perf_counter) of the next task to finish; the ranks with tasks
        out must stay alive meanwhile."""
        backoff = Backoff(self.poll)
        while not self._arrived:
            message = self._receive()
            if message is not None:
                self._keep_task_report(message[1], message[2])
                backoff.reset()
                continue
            self._check_alive(lambda: np.unique(self.owners[np.fromiter(self._out, np.int64)]))
            backoff.pause()
        records, now = self._arrived.popleft()
        device = int(records[0]["device"])
        plan, sent = self._out.pop(device)
        return device, self.wire.unpack_work(plan, [records], [now - sent]), now

    def accept(self, round_idx: int, device_ids: np.ndarray) -> None:
        """Sent with the next command: the devices whose reports of round_idx were applied."""
        self._accepted = (round_idx, np.asarray(device_ids))

    def evaluate(self, x: np.ndarray) -> Evaluation:
        self._command(protocol.EVAL, x=x)
        got = self._collect(protocol.TAG_EVAL, [r for r, ids in self.hosted.items() if ids.size])
        return self.wire.unpack_evaluation(got.values())

    def probe(self, round_idx: int, x: np.ndarray, device_ids: np.ndarray) -> np.ndarray:
        """The addressed devices' losses at x, each computed on its rank, in device_ids order."""
        device_ids = np.asarray(device_ids)
        self._command(protocol.PROBE, devices=device_ids, x=x, round_idx=round_idx)
        got = self._collect(protocol.TAG_PROBE, np.unique(self.owners[device_ids]))
        losses = {int(rec["device"]): float(rec["loss"]) for records in got.values() for rec in records}
        return np.array([losses[int(k)] for k in device_ids], np.float64)

    def start_devices(self, x: np.ndarray, device_ids: np.ndarray) -> dict[str, np.ndarray]:
        """Fresh device vectors for these devices, joining at x; returns their rows in device_ids order."""
        device_ids = np.asarray(device_ids)
        self._command(protocol.START_DEVICES, devices=device_ids, x=x)
        got = self._collect(protocol.TAG_ROWS, np.unique(self.owners[device_ids]))
        return self.wire.unpack_rows(got.values(), device_ids)

    def load_devices(self, rows: dict[str, DeviceRows]) -> None:
        """The stored vectors and residuals (sparse) to the ranks hosting their devices: the command names
        the devices that hold a row, each rank receives a record for each of its own."""
        held = np.unique(np.concatenate([r.ids for r in rows.values()])).astype(np.int64)
        self._command(protocol.LOAD_DEVICES, devices=held)
        for rank, ids in self.hosted.items():
            ids = ids[np.isin(ids, held)]
            if ids.size:
                records = np.zeros(ids.size, self.wire.load)
                self.wire.pack_rows(records, ids, {name: r.dense(ids) for name, r in rows.items()})
                wait(self.comm.Isend(records.view(np.uint8), dest=rank, tag=protocol.TAG_LOAD), self.poll)

    def close(self, failed: bool = False) -> None:
        """Tell the device ranks to stop and drain what they still send until each says goodbye.

        Draining lets a late report that is still on its way complete, so no rank hangs on it at exit.
        After a failure the caller aborts the world instead.
        """
        if not failed:
            if self.wire.tasks:  # async: the last record of the tasks a rank gets, so it takes every one
                end = self.wire.end_of_tasks()
                self._sending += [(self.comm.Isend([end, self.MPI.BYTE], dest=r, tag=protocol.TAG_TASK), end)
                                  for r in self.hosted]
            for req, _ in self._sending:
                wait(req, self.poll, also=self._listen)
            self._command(protocol.STOP)
            self._collect(protocol.TAG_BYE, list(self.hosted))


def gather_setup(comm, timeout_s: float | None, hosts: dict | None = None, poll_max_s: float = 0.01) -> list:
    """Every device rank's setup report (rank order), heard point to point with their heartbeats, so a rank
    that hangs while it builds its devices is found (RankLost) instead of waited for in a collective."""
    MPI = mpi_of(comm)
    status = MPI.Status()
    pending = set(range(1, comm.Get_size()))
    heard = dict.fromkeys(pending, time.perf_counter())
    got = {}
    backoff = Backoff(poll_max_s)
    while pending:
        if comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
            src, tag, nbytes = status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)
            buf = np.empty(nbytes, np.uint8)
            comm.Recv([buf, MPI.BYTE], source=src, tag=tag)
            heard[src] = time.perf_counter()
            if tag == protocol.TAG_SETUP:
                got[src] = pickle.loads(buf.tobytes())
                pending.discard(src)
            backoff.reset()
            continue
        now = time.perf_counter()
        for rank in pending:
            if timeout_s is not None and now - heard[rank] > timeout_s:
                raise RankLost(rank, now - heard[rank], (hosts or {}).get(rank))
        backoff.pause()
    return [got[r] for r in sorted(got)]


def send_setup(comm, message) -> list:
    """The run's setup (or its error) to every device rank, point to point and without waiting: a collective
    would hang on a rank that stopped before taking part, where gather_setup finds it. Returns the requests
    (with their buffer), to complete once the ranks have reported."""
    payload = np.frombuffer(pickle.dumps(message), np.uint8)
    MPI = mpi_of(comm)
    return [payload] + [comm.Isend([payload, MPI.BYTE], dest=r, tag=protocol.TAG_CONFIG)
                        for r in range(1, comm.Get_size())]


def receive_setup(comm, poll_max_s: float = 0.01):
    """A device rank's side of send_setup, waiting without spinning."""
    MPI = mpi_of(comm)
    status = MPI.Status()
    backoff = Backoff(poll_max_s)
    while not comm.Iprobe(0, protocol.TAG_CONFIG, status):
        backoff.pause()
    buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
    comm.Recv([buf, MPI.BYTE], source=0, tag=protocol.TAG_CONFIG)
    return pickle.loads(buf.tobytes())

