"""The MPI wire format: every message a NumPy structured record with named fields, owned by this module.

Every rank builds the same `Wire` from the same config (rank 0 sends the config at setup), so a field
cannot be written under one name and read under another, and the whole protocol can be checked in one
process: `encode_*` / `pack_*` write what a sender puts in its buffer, `decode_*` / `unpack_*` what the
receiver makes of it. The buffers themselves are allocated once (in the coordinator and device server) and
travel as bytes with the buffer collectives; nothing on the per-round path is pickled.

Per round: down, a command (its fixed head by Ibcast, then, in a second Ibcast the head sizes, an entry per
device it is for and the ids of the reports applied) and then the server state (Ibcast, x and the algorithm's server
vectors as rows of one array), or with a compressed downlink the encoded differences to the copy every rank
holds (Ibcast of their bytes); up, one message per device rank holding a work record per device it ran,
whose payload is each report vector as the uplink encodes it (int8 codes, top-k index/value pairs: the
report is as small as the encoding). With error feedback a second, dense message follows it, after the
round's clock: the residuals those reports leave, which the coordinator keeps so --resume restores them
(the bench's bookkeeping, like the evaluation; not counted as the round's bytes).
"""

from __future__ import annotations

import math

import numpy as np

from edgefed import compression
from edgefed.compression import Codec
from edgefed.ids import find
from edgefed.transport import Evaluation, LocalResults, RoundPlan

# Commands (the command record's `command`), and the tags of the messages that answer them.
STOP, ROUND, EVAL, START_DEVICES, LOAD_DEVICES, SECAGG, PROBE = range(7)
TAG_WORK, TAG_EVAL, TAG_ROWS, TAG_LOAD, TAG_BYE, TAG_CANCEL = 11, 12, 13, 14, 15, 16
TAG_ALIVE = 17  # a device rank's heartbeat: one int64, the rank; says only "still here"
TAG_SETUP = 18  # a device rank's report after building its devices (pickled: failure, warm-up, lanes)
TAG_CONFIG = 19  # rank 0's setup for the device ranks (pickled: the config, the owners when the config places
# the devices, or an error)
TAG_RESIDUAL = 20  # error feedback: the residuals a rank's reports of a round leave its devices
TAG_TASK = 21  # async: one device's task, point to point to its rank (the model it starts from inside)
TAG_SECAGG = 22  # secure aggregation: a rank's protocol records of one phase (a SECAGG header, then records)
TAG_PROBE = 23  # a selection policy's question: the addressed devices' losses at the model broadcast with it
# SECAGG phases: keys up; keys down and sealed shares up; sealed shares down; survivors down and reveals up
KEYS, SHARES, DELIVER, REVEAL = range(4)
SECAGG_HEADER = np.dtype([("round", "<i8"), ("phase", "<i8")])
NO_ROUND = -1

# A command travels as a head of fixed size, then (when it names any) its devices' entries and the ids of the
# reports applied, in one second broadcast sized by the head: what a round sends grows with its devices, not
# with the federation (a mask of every device was 34 bytes a device, 340 MB a command at 10^7).
COMMAND_HEAD = np.dtype([
    ("command", "<i8"),
    ("round", "<i8"),
    ("lr", "<f8"),
    ("grace_s", "<f8"),
    ("accepted_round", "<i8"),  # the round whose reports the accepted ids name; NO_ROUND: none
    ("by_arrival", "?"),  # over-selection: a device may be told to stop
    ("downlink", "?"),  # the state follows as encoded differences to the ranks' copy (else in full)
    ("down_bytes", "<i8"),  # what the broadcast brings each selected device (a shaped link's time)
    ("phase", "<i8"),  # SECAGG: which of the protocol's phases (KEYS, SHARES, DELIVER, REVEAL)
    ("payload_bytes", "<i8"),  # SECAGG: the bytes of the records that follow by broadcast (0: none)
    ("n_devices", "<i8"),  # the entries that follow: the devices the command is for (ROUND: the selected)
    ("n_accepted", "<i8"),  # the accepted ids that follow them
], align=True)
COMMAND_ENTRY = np.dtype([
    ("device", "<i8"),  # ascending
    ("budget", "<i4"),  # K_k of a selected device
    ("steps", "<i4"),  # the exact steps (a trace); -1: all of the budget, or what fits
    ("deadline_s", "<f8"),  # what the device computes for; NaN: no deadline
    ("due_s", "<f8"),  # the round deadline its report is due by; NaN: none
    ("prescale", "<f8"),  # secure aggregation: c_k, what the device scales its update by
    ("width", "<f8"),  # [submodel]: the width the device trains; NaN: the whole model
], align=True)


class Command:
    """One command's buffers, kept from one command to the next: the head, and the body its counts size."""

    def __init__(self):
        self.head = np.zeros(1, COMMAND_HEAD)
        self._body = np.zeros(0, np.uint8)

    def __getitem__(self, field: str):
        return self.head[0][field]

    def body(self) -> np.ndarray:
        """The body's bytes as the head sizes them (empty: no second broadcast); grown, never per command."""
        rec = self.head[0]
        nbytes = int(rec["n_devices"]) * COMMAND_ENTRY.itemsize + int(rec["n_accepted"]) * 8
        if nbytes > self._body.size:
            self._body = np.zeros(max(nbytes, 2 * self._body.size), np.uint8)
        return self._body[:nbytes]

    @property
    def entries(self) -> np.ndarray:
        return self._body[:int(self.head[0]["n_devices"]) * COMMAND_ENTRY.itemsize].view(COMMAND_ENTRY)

    @property
    def accepted_ids(self) -> np.ndarray:
        start = int(self.head[0]["n_devices"]) * COMMAND_ENTRY.itemsize
        return self._body[start:start + int(self.head[0]["n_accepted"]) * 8].view("<i8")


class Wire:
    """The record types of one run, identical on every rank.

    n_devices, dim, dtype: the federation and the model; reports: the names of the vectors a work report
    carries (Delta x first); server: the names of the vectors that travel down beside x; device: the names
    of the vectors each device keeps (sent up when they start, down when a resumed run restores them).
    Vectors travel in these orders, whatever order a mapping holds them in. uplink, downlink: the compression
    of the reports and of the broadcast; with the uplink's error feedback a resumed run restores the devices'
    residuals beside their vectors.
    """

    def __init__(self, n_devices: int, dim: int, dtype, reports: tuple[str, ...], server: tuple[str, ...] = (),
                 device: tuple[str, ...] = (), uplink: Codec = Codec(), downlink: Codec = Codec(),
                 tasks: bool = False, secagg_bits: int | None = None):
        self.n_devices, self.dim, self.dtype = n_devices, dim, np.dtype(dtype)
        self.reports, self.server, self.device = tuple(reports), tuple(server), tuple(device)
        self.uplink, self.downlink = uplink, downlink
        self.tasks = tasks  # async: tasks may come point to point, and an end-of-tasks record ends them
        # secure aggregation: a report's payload is the masked input, dim words of this many bits
        self.masked = None if secagg_bits is None else np.dtype(f"<u{secagg_bits // 8}")
        self.residuals = tuple(compression.residual_name(r) for r in self.reports) if uplink.error_feedback else ()
        self.restored = self.device + self.residuals  # what LOAD_DEVICES carries per device
        self._up = uplink.nbytes(dim, self.dtype)  # one encoded report vector
        self._down = downlink.nbytes(dim, self.dtype)  # one encoded broadcast vector
        self.command = COMMAND_HEAD
        payload = len(self.reports) * self._up if self.masked is None else (dim + 1) * self.masked.itemsize
        self.work = np.dtype([
            ("round", "<i8"),
            ("device", "<i8"),
            ("steps", "<i4"),
            ("late", "?"),
            ("compiled", "?"),
            ("elapsed_s", "<f4"),
            ("cpu_percent", "<f4"),
            ("cpu_freq_mhz", "<f4"),
            ("temperature_c", "<f4"),
            ("core", "<i2"),
            ("wait_s", "<f4"),  # of the time from the command to the report leaving: neither work nor link
            ("bytes_up", "<i8"),  # the payload's bytes that carry work (0: none sent)
            ("nonfinite", "?"),  # secure aggregation: the device found its update non-finite and sent none
            ("secagg_s", "<f4"),  # secure aggregation: the device's protocol time through its masked input
            ("loss_sq", "<f8"),  # the squared losses of the samples its steps trained on, summed (Oort's utility)
            ("samples", "<i8"),  # how many samples those were
            ("peak_rss", "<i8"),  # the rank's peak resident memory so far, bytes (the log's rank_peak_rss_mb)
            ("rank", "<i4"),  # the rank that sent it
            ("board_j", "<f8"),  # its board's energy since the rank's last report of the round (or its start) as
            # the board's own meter read it, on the first record of a message (0 on the others); NaN: no meter
            ("payload", "u1", (payload,)),  # the report vectors, encoded, back to back (or the masked input)
        ], align=True)
        self.residual = np.dtype([("round", "<i8"), ("device", "<i8"),
                                  ("vectors", self.dtype, (len(self.reports), dim))], align=True)
        self.evaluation = np.dtype([("device", "<i8"), ("train_loss", "<f8"), ("test_loss_sum", "<f8"),
                                    ("test_correct", "<i8"), ("n_test", "<i8"), ("peak_rss", "<i8")], align=True)
        self.rows = np.dtype([("device", "<i8"), ("vectors", self.dtype, (len(self.device), dim))], align=True)
        self.load = np.dtype([("device", "<i8"), ("vectors", self.dtype, (len(self.restored), dim))], align=True)
        self.bye = np.dtype([("rank", "<i8")])
        self.probe = np.dtype([("device", "<i8"), ("loss", "<f8")])
        self.task = np.dtype([("round", "<i8"), ("device", "<i8"), ("steps", "<i4"), ("budget", "<i4"),
                              ("lr", "<f8"), ("deadline_s", "<f8"), ("down_bytes", "<i8"),
                              ("x", self.dtype, (dim,))], align=True)
        self.tags = {TAG_WORK: self.work, TAG_EVAL: self.evaluation, TAG_ROWS: self.rows, TAG_LOAD: self.load,
                     TAG_BYE: self.bye, TAG_RESIDUAL: self.residual, TAG_PROBE: self.probe}

    # -- async: a task down, its work record up -------------------------------------------------------
    def pack_task(self, plan: RoundPlan, x: np.ndarray) -> np.ndarray:
        """One device's task (plan of one device: round = its start version + 1) and its model, as bytes."""
        rec = np.zeros(1, self.task)
        rec["round"], rec["device"], rec["lr"] = plan.round_idx, plan.device_ids[0], plan.lr
        rec["steps"], rec["budget"] = plan.steps_to_run(0), plan.budgets[0]
        rec["down_bytes"], rec["x"] = plan.down_bytes, x
        rec["deadline_s"] = math.nan if plan.deadline_s is None else plan.deadline_s[0]
        return rec.view(np.uint8)

    def unpack_task(self, raw: np.ndarray) -> tuple[RoundPlan, np.ndarray]:
        rec = raw.view(self.task)[0]
        deadline = None if np.isnan(rec["deadline_s"]) else np.array([rec["deadline_s"]], np.float64)
        # a task stops at its deadline and reports what it did: no report of it is ever late (its due time is
        # infinite), and a stop (the run is over) ends it within a chunk
        plan = RoundPlan(int(rec["round"]), np.array([rec["device"]], np.int64), np.array([rec["budget"]], np.int32),
                         float(rec["lr"]), steps=np.array([rec["steps"]], np.int32), deadline_s=deadline,
                         round_deadline_s=None if deadline is None else np.array([math.inf]), by_arrival=True,
                         down_bytes=int(rec["down_bytes"]))
        return plan, rec["x"].copy()

    def end_of_tasks(self) -> np.ndarray:
        """The task record that tells a rank no more tasks follow (device -1): sent last, before the stop."""
        rec = np.zeros(1, self.task)
        rec["device"] = -1
        return rec.view(np.uint8)

    def is_end_of_tasks(self, raw: np.ndarray) -> bool:
        return int(raw.view(self.task)[0]["device"]) < 0

    def record_bytes(self) -> int:
        """The largest record of any message but the command: a rank's buffers hold that per device."""
        return max(dt.itemsize for dt in self.tags.values())

    def state_buffer(self) -> np.ndarray:
        """The broadcast buffer of the server state: x, then the server vectors, one row each."""
        return np.zeros((1 + len(self.server), self.dim), self.dtype)

    @staticmethod
    def command_buffer() -> Command:
        return Command()

    def downlink_buffer(self) -> np.ndarray:
        """The broadcast buffer of a compressed downlink: x's encoding, then each server vector's."""
        return np.zeros((1 + len(self.server)) * self._down, np.uint8)

    # -- down: a compressed broadcast ------------------------------------------------------------------
    def pack_downlink(self, buf: np.ndarray, encoded: dict) -> None:
        """The encoded differences of x and the server vectors (Encoded each), back to back."""
        for i, name in enumerate(("x",) + self.server):
            self.downlink.to_bytes(encoded[name], buf[i * self._down:(i + 1) * self._down])

    def apply_downlink(self, buf: np.ndarray, held: dict) -> dict:
        """The ranks' copy {"x": ..., server vectors} once the broadcast's differences are added, as the
        coordinator adds them."""
        out = {}
        for i, name in enumerate(("x",) + self.server):
            enc = self.downlink.from_bytes(buf[i * self._down:(i + 1) * self._down], self.dim, self.dtype)
            out[name] = held[name] + compression.decode(enc, self.dtype)
        return out

    # -- down: commands --------------------------------------------------------------------------------
    @staticmethod
    def encode_command(cmd: Command, command: int, plan: RoundPlan | None = None,
                       devices: np.ndarray | None = None, accepted: tuple[int, np.ndarray] | None = None,
                       downlink: bool = False, round_idx: int = 0, phase: int = 0, payload_bytes: int = 0) -> None:
        """Fill the command: a round's plan, or the devices a command is for, and the reports of the previous
        round the coordinator applied; downlink: the state follows encoded, not in full; phase,
        payload_bytes: a SECAGG command's (of round_idx)."""
        ids = plan.device_ids if plan is not None else np.zeros(0, np.int64) if devices is None else devices
        ids = np.asarray(ids, np.int64)
        order = np.argsort(ids, kind="stable")  # entries ascending, whatever order the ids came in
        taken = np.zeros(0, np.int64) if accepted is None else np.sort(np.asarray(accepted[1], np.int64))
        cmd.head[:] = 0
        rec = cmd.head[0]
        rec["command"] = command
        rec["round"] = round_idx if plan is None else plan.round_idx
        rec["phase"], rec["payload_bytes"] = phase, payload_bytes
        rec["accepted_round"] = NO_ROUND if accepted is None else accepted[0]
        rec["n_devices"], rec["n_accepted"] = ids.size, taken.size
        rec["downlink"] = downlink
        cmd.body()[:] = 0
        entries = cmd.entries
        entries["device"] = ids[order]
        entries["steps"] = -1
        entries["deadline_s"] = entries["due_s"] = entries["width"] = math.nan
        cmd.accepted_ids[:] = taken
        if plan is None:
            return
        rec["lr"], rec["grace_s"] = plan.lr, plan.grace_s
        rec["by_arrival"], rec["down_bytes"] = plan.by_arrival, plan.down_bytes
        entries["budget"] = np.asarray(plan.budgets)[order]
        for field, values in (("steps", plan.steps), ("deadline_s", plan.deadline_s),
                              ("due_s", plan.round_deadline_s), ("prescale", plan.prescale), ("width", plan.widths)):
            if values is not None:
                entries[field] = np.broadcast_to(values, ids.shape)[order]

    @staticmethod
    def accepted(cmd: Command) -> tuple[int, np.ndarray] | None:
        """(round, device ids) of the reports the coordinator applied, if the command names any."""
        if cmd["accepted_round"] == NO_ROUND:
            return None
        return int(cmd["accepted_round"]), cmd.accepted_ids.copy()

    @staticmethod
    def _own_entries(cmd: Command, own: np.ndarray) -> np.ndarray:
        """The command's entries of devices in `own` (ascending ids), found by search: O(its devices)."""
        entries = cmd.entries
        return entries[find(own, entries["device"])[1]]

    @classmethod
    def addressed(cls, cmd: Command, own: np.ndarray) -> np.ndarray:
        """Which of `own` (ascending device ids) the command is for, ascending."""
        return cls._own_entries(cmd, own)["device"].copy()

    def decode_plan(self, cmd: Command, own: np.ndarray) -> RoundPlan | None:
        """The part of a ROUND command's plan for the devices in `own`; None when none of them is selected."""
        mine = self._own_entries(cmd, own)
        if mine.size == 0:
            return None
        steps, deadlines, due, widths = mine["steps"], mine["deadline_s"], mine["due_s"], mine["width"]
        return RoundPlan(int(cmd["round"]), mine["device"].copy(), mine["budget"].astype(np.int32), float(cmd["lr"]),
                         steps=None if steps[0] < 0 else steps.astype(np.int32),
                         deadline_s=None if np.isnan(deadlines).all() else deadlines.astype(np.float64),
                         grace_s=float(cmd["grace_s"]),
                         round_deadline_s=None if np.isnan(due).all() else due.astype(np.float64),
                         by_arrival=bool(cmd["by_arrival"]), down_bytes=int(cmd["down_bytes"]),
                         prescale=None if self.masked is None else mine["prescale"].astype(np.float64),
                         widths=None if np.isnan(widths).all() else widths.astype(np.float64))

    # -- both ways: secure aggregation's records ----------------------------------------------------------
    @staticmethod
    def pack_secagg(round_idx: int, phase: int, records: np.ndarray) -> np.ndarray:
        """A rank's reply to a SECAGG command: the header, then its devices' records, as bytes."""
        head = np.zeros(1, SECAGG_HEADER)
        head["round"], head["phase"] = round_idx, phase
        return np.concatenate([head.view(np.uint8), records.view(np.uint8)])

    @staticmethod
    def unpack_secagg(raw: np.ndarray, dtype) -> tuple[int, int, np.ndarray]:
        """(round, phase, records) of a SECAGG reply."""
        head = raw[:SECAGG_HEADER.itemsize].view(SECAGG_HEADER)[0]
        return int(head["round"]), int(head["phase"]), raw[SECAGG_HEADER.itemsize:].view(dtype).copy()

    # -- down: the server state ------------------------------------------------------------------------
    def pack_state(self, buf: np.ndarray, x: np.ndarray, vectors=None) -> None:
        """x and the named server vectors into the broadcast buffer (vectors None: x alone, the rest zero)."""
        buf[0] = x
        buf[1:] = 0
        if vectors is not None:
            for i, name in enumerate(self.server):
                buf[1 + i] = vectors[name]

    def unpack_state(self, buf: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(x, {name: server vector}) as copies: the buffer is reused by the next broadcast."""
        return buf[0].copy(), {name: buf[1 + i].copy() for i, name in enumerate(self.server)}

    # -- up: work reports ------------------------------------------------------------------------------
    def pack_work(self, records: np.ndarray, round_idx: int, ids: np.ndarray, res: LocalResults | None,
                  wait_s=0.0, payload=None) -> None:
        """One record per device; res None: the devices could not start in time (late, no work). wait_s: how
        long each report waited on the rank (for its lane, for the rank's other devices), not working.
        payload: with a compressed uplink, each device's {report: Encoded} (None: it sent no work)."""
        records["round"], records["device"], records["wait_s"] = round_idx, ids, wait_s
        if res is None:
            records["late"], records["secagg_s"] = True, np.nan
            return
        records["steps"], records["late"], records["compiled"] = res.steps, res.late, res.compiled
        records["elapsed_s"], records["cpu_percent"] = res.elapsed_s, res.cpu_percent
        records["cpu_freq_mhz"], records["temperature_c"], records["core"] = res.cpu_freq_mhz, res.temperature_c, res.core
        records["bytes_up"] = 0 if res.bytes_up is None else res.bytes_up
        if res.loss_sq is not None:
            records["loss_sq"], records["samples"] = res.loss_sq, res.samples
        if self.masked is not None:
            records["nonfinite"], records["secagg_s"] = res.nonfinite, res.secagg_s
            records["payload"] = np.ascontiguousarray(res.masked).view(np.uint8).reshape(len(records), -1)
            return
        size = self._up
        for j, name in enumerate(self.reports):
            cut = records["payload"][:, j * size:(j + 1) * size]
            if not self.uplink.lossy:
                cut[...] = np.ascontiguousarray(res.vectors[name]).view(np.uint8).reshape(len(records), size)
                continue
            for i, sent in enumerate(payload):
                if sent is not None:
                    self.uplink.to_bytes(sent[name], cut[i])

    def _report_vectors(self, rec) -> dict:
        """A work record's report vectors, decoded as the coordinator applies them."""
        size, out = self._up, {}
        for j, name in enumerate(self.reports):
            raw = rec["payload"][j * size:(j + 1) * size]
            if self.uplink.lossy:
                out[name] = compression.decode(self.uplink.from_bytes(raw, self.dim, self.dtype), self.dtype)
            else:
                out[name] = raw.view(self.dtype)
        return out

    def pack_residuals(self, records: np.ndarray, round_idx: int, ids: np.ndarray, residuals: dict) -> None:
        """The residuals (rows in ids order, one array per report) the devices' reports of the round leave."""
        records["round"], records["device"] = round_idx, ids
        for j, name in enumerate(self.reports):
            records["vectors"][:, j] = residuals[name]

    def unpack_work(self, plan: RoundPlan, messages, arrivals=None) -> LocalResults:
        """The round's LocalResults from the work records received (arrivals: seconds from the round's start
        to each message); a device without one is late. A device's communication time is its arrival less
        its local work."""
        n_sel = plan.device_ids.size
        row = {int(k): i for i, k in enumerate(plan.device_ids)}
        vectors = {name: np.zeros((n_sel, self.dim), self.dtype) for name in self.reports}
        steps = np.zeros(n_sel, np.int32)
        late = np.ones(n_sel, bool)  # until its report arrives
        compiled = np.zeros(n_sel, bool)
        core = np.full(n_sel, -1, np.int16)
        finish, wait_s = np.full(n_sel, np.nan), np.zeros(n_sel)
        bytes_up, samples, loss_sq = np.zeros(n_sel, np.int64), np.zeros(n_sel, np.int64), np.zeros(n_sel)
        secure = self.masked is not None
        masked = np.zeros((n_sel, self.dim + 1), self.masked) if secure else None
        nonfinite = np.zeros(n_sel, bool)
        secagg_s = np.full(n_sel, np.nan, np.float32)
        measured = {name: np.full(n_sel, np.nan, np.float32)
                    for name in ("elapsed_s", "cpu_percent", "cpu_freq_mhz", "temperature_c")}
        messages = list(messages)
        arrivals = [math.nan] * len(messages) if arrivals is None else arrivals
        for records, arrival in zip(messages, arrivals):
            for rec in records:
                i = row[int(rec["device"])]
                late[i], compiled[i], core[i], finish[i] = rec["late"], rec["compiled"], rec["core"], arrival
                wait_s[i], bytes_up[i] = rec["wait_s"], rec["bytes_up"]
                steps[i] = 0 if rec["late"] else rec["steps"]
                loss_sq[i], samples[i] = rec["loss_sq"], rec["samples"]
                for name, values in measured.items():
                    values[i] = rec[name]
                if secure:
                    secagg_s[i] = rec["secagg_s"]
                    if not rec["late"]:
                        nonfinite[i], masked[i] = rec["nonfinite"], rec["payload"].view(self.masked)
                elif not rec["late"]:
                    for name, values in self._report_vectors(rec).items():
                        vectors[name][i] = values
        comm = finish - measured["elapsed_s"]
        return LocalResults({} if secure else vectors, steps, measured["elapsed_s"], measured["cpu_percent"], late,
                            measured["cpu_freq_mhz"], measured["temperature_c"], compiled, finish,
                            comm.astype(np.float32), core, (comm - wait_s).astype(np.float32), bytes_up=bytes_up,
                            masked=masked, nonfinite=nonfinite if secure else None,
                            secagg_s=secagg_s if secure else None, loss_sq=loss_sq, samples=samples,
                            energy_read_j=boards_read(messages, row, n_sel))

    # -- up: evaluation --------------------------------------------------------------------------------
    @staticmethod
    def pack_evaluation(records: np.ndarray, ev: Evaluation) -> None:
        """records: max(1, evaluated) of them; a rank that evaluates none sends one marked device -1, which
        still carries its peak memory."""
        if not ev.ids.size:
            records["device"] = -1
            return
        records["device"] = ev.ids
        records["train_loss"], records["test_loss_sum"] = ev.train_loss, ev.test_loss_sum
        records["test_correct"], records["n_test"] = ev.test_correct, ev.n_test

    def unpack_evaluation(self, messages) -> Evaluation:
        records = np.concatenate([np.zeros(0, self.evaluation), *messages])
        records = records[records["device"] >= 0]
        records = records[np.argsort(records["device"], kind="stable")]
        return Evaluation(records["device"].astype(np.int64), records["train_loss"].astype(np.float64),
                          records["test_loss_sum"].astype(np.float64), records["test_correct"].astype(np.int64),
                          records["n_test"].astype(np.int64))

    # -- both ways: device vectors ---------------------------------------------------------------------
    def pack_rows(self, records: np.ndarray, ids: np.ndarray, rows: dict[str, np.ndarray]) -> None:
        """Devices' vectors, a record per device: rows[name] holds one row per id, in ids order (records of
        `rows`: the device vectors; of `load`: those and the residuals)."""
        records["device"] = ids
        for j, name in enumerate(self._row_names(records)):
            records["vectors"][:, j] = rows[name]

    def unpack_rows(self, messages, device_ids: np.ndarray, names: tuple | None = None) -> dict[str, np.ndarray]:
        """{name: rows of device_ids, in that order} from the records received (names: in the records'
        order, by default the device vectors)."""
        names = self.device if names is None else names
        at = {int(k): i for i, k in enumerate(device_ids)}
        out = {name: np.zeros((len(device_ids), self.dim), self.dtype) for name in names}
        for records in messages:
            for rec in records:
                i = at[int(rec["device"])]
                for j, name in enumerate(names):
                    out[name][i] = rec["vectors"][j]
        return out

    def _row_names(self, records: np.ndarray) -> tuple:
        return self.restored if records.dtype == self.load else self.device


def boards_read(messages, row: dict, n_sel: int) -> np.ndarray:
    """Each device's share of what its board's meter read in the round: a rank's readings summed over its
    messages, split evenly among its devices that worked (all of them where none did); NaN where a rank has
    no meter."""
    read, rows = {}, {}
    for records in messages:
        for rec in records:
            rank = int(rec["rank"])
            read[rank] = read.get(rank, 0.0) + float(rec["board_j"])
            rows.setdefault(rank, []).append((row[int(rec["device"])], not rec["late"] and rec["steps"] > 0))
    out = np.full(n_sel, np.nan)
    for rank, held in rows.items():
        worked = [i for i, did in held if did] or [i for i, _ in held]
        out[worked] = read[rank] / len(worked)
    return out
