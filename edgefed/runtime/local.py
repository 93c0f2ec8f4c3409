"""Devices hosted in this process: the simulator's transport, and the worker behind every MPI device rank.

A `LocalTransport` hosts some devices (all of them in the simulator, its own share on an MPI rank): it
builds their data when first used, keeps the vectors the algorithm gives each device (SCAFFOLD's
controls), runs the algorithm's client update for each selected device (all K steps, a trace's steps, or
as many as fit in the deadline), injects configured faults, drives the CPU competitors, and measures what
each device's work cost.

The selected devices run in `lanes`: one lane per core the process may use, each pinned to its core with a
model of its own (the kernels release the GIL), the devices dealt to the lanes in turn. With one lane they
run one after another in the calling thread. Every device's numbers depend on its own data and streams
only, so the lanes change no byte of a report.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from edgefed import compression
from edgefed.algorithms.base import DELTA_X, DeviceRows, LocalTask, nonzero_rows
from edgefed.errors import EdgefedError
from edgefed.ids import find
from edgefed.kernels import jit_compilations
from edgefed.models import warm_model
from edgefed.participation.submodels import slice_bytes
from edgefed.rng import Purpose, generator, kernel_state
from edgefed.runtime.contention import Competitor, pin
from edgefed.runtime.deadline import BoardReadings, DeadlineRunner, run_all
from edgefed.runtime.device_cache import DeviceCache
from edgefed.runtime.secure import SecureDevices
from edgefed.transport import Evaluation, LocalResults, RoundPlan


class InjectedFault(EdgefedError):
    """A `[[fault]] kind = "raise"` of the config went off."""


def _lowest_priority() -> None:
    """Make the calling thread yield to a competitor on its core (Linux: per-thread nice 19).

    Without this the scheduler splits a contended core about 50/50 whatever the competitor's duty cycle,
    and a 90 % competitor would cost the device only half its CPU.
    """
    if hasattr(os, "setpriority"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _read_only(values: np.ndarray) -> np.ndarray:
    view = values.view()
    view.flags.writeable = False
    return view


@dataclass
class Lane:
    """One worker: the core it is pinned to (None: wherever the OS runs it), a model with workspaces of its
    own, the readings of its core, and its CPU competitor where one is configured."""

    core: int | None
    model: object
    readings: BoardReadings
    competitor: Competitor | None = None
    widths: object | None = None  # [submodel]: the models of its widths (width_models.WidthModels), its own


class RoundWork:
    """The arrays one round's work fills, a row per selected device in plan order."""

    def __init__(self, n_sel: int, d: int, dtype, reports, feedback: bool = False, masked_dtype=None):
        self.vectors = {name: np.zeros((n_sel, d), dtype=dtype) for name in reports}  # as decoded
        # secure aggregation: what each device sends instead (its rows in vectors are zeroed once masked)
        self.masked = None if masked_dtype is None else np.zeros((n_sel, d + 1), masked_dtype)  # + clip count
        self.nonfinite = np.zeros(n_sel, bool)
        self.secagg_s = np.full(n_sel, np.nan, np.float32)
        self.payload = [None] * n_sel  # {report: Encoded} of each device that sent work (compressed uplink)
        self.residuals = {name: np.zeros((n_sel, d), dtype=dtype) for name in reports} if feedback else {}
        self.bytes_up = np.zeros(n_sel, np.int64)
        self.steps = np.zeros(n_sel, np.int32)
        self.elapsed, self.cpu = np.zeros(n_sel, np.float32), np.full(n_sel, np.nan, np.float32)
        self.freq, self.temp = np.full(n_sel, np.nan, np.float32), np.full(n_sel, np.nan, np.float32)
        self.late, self.compiled = np.zeros(n_sel, bool), np.zeros(n_sel, bool)
        self.finish, self.comm = np.full(n_sel, np.nan), np.full(n_sel, np.nan, np.float32)
        self.core = np.full(n_sel, -1, np.int16)
        self.started = np.full(n_sel, np.nan)  # perf_counter when each device began
        self.loss_sq, self.samples = np.zeros(n_sel), np.zeros(n_sel, np.int64)  # what its steps said of their losses

    def results(self, rows=slice(None)) -> LocalResults:
        """In one process the link is all the communication there is (a slow_link fault's, or none). Under
        secure aggregation only the masked inputs go: no report vector leaves."""
        secure = self.masked is not None
        vectors = {} if secure else {name: _read_only(v[rows]) for name, v in self.vectors.items()}
        return LocalResults(vectors, self.steps[rows], self.elapsed[rows], self.cpu[rows], self.late[rows],
                            self.freq[rows], self.temp[rows], self.compiled[rows], self.finish[rows], self.comm[rows],
                            self.core[rows], self.comm[rows], bytes_up=self.bytes_up[rows],
                            masked=_read_only(self.masked[rows]) if secure else None,
                            nonfinite=self.nonfinite[rows] if secure else None,
                            secagg_s=self.secagg_s[rows] if secure else None, loss_sq=self.loss_sq[rows],
                            samples=self.samples[rows])


class Streams:
    """stream(purpose): the model's generator workspace on (seed, purpose, round, device); it remembers the
    workspaces it gave, whose steps say what the device's round saw of its losses (a report field)."""

    def __init__(self, begin):
        self.begin, self.runs = begin, []

    def __call__(self, purpose):
        run = self.begin(purpose)
        self.runs.append(run)
        return run

    def loss_sq(self) -> float:
        return math.fsum(run.loss_sq for run in self.runs)

    def samples(self) -> int:
        return sum(run.samples for run in self.runs)


LABELS_KEPT = 4096  # label counts of devices built that wait for the log at once, at most


class HeldRows:
    """One vector of the hosted devices (SCAFFOLD's c_k, an error-feedback residual), a row held for a
    device only once its start or a report made it other than zero (absent: zero): at a million devices a
    run touches a few thousand."""

    def __init__(self, d: int, dtype):
        self._rows: dict[int, np.ndarray] = {}
        self._zero = _read_only(np.zeros(d, dtype))

    def get(self, k: int) -> np.ndarray:
        """Device k's row, read only."""
        row = self._rows.get(k)
        return self._zero if row is None else _read_only(row)

    def add(self, k: int, delta: np.ndarray) -> None:
        row = self._rows.get(k)
        if row is None:  # from zero, by the same addition a dense row would take (0 + -0.0 is +0.0)
            row = self._rows[k] = np.zeros_like(self._zero)
        row += delta

    def set(self, k: int, row: np.ndarray) -> None:
        if nonzero_rows(row[None])[0]:
            self._rows[k] = np.array(row, self._zero.dtype)
        else:
            self._rows.pop(k, None)

    def load(self, rows: DeviceRows, hosted: np.ndarray) -> None:
        """The stored rows of the hosted devices (the others: zero)."""
        self._rows.clear()
        mine = np.isin(rows.ids, hosted)
        for k, row in zip(rows.ids[mine], rows.rows[mine]):
            self.set(int(k), row)

    def stored(self, n: int) -> DeviceRows:
        """The rows held, over a federation of n devices."""
        ids = np.array(sorted(self._rows), np.int64)
        rows = np.stack([self._rows[int(k)] for k in ids]) if ids.size else np.zeros((0, self._zero.size),
                                                                                   self._zero.dtype)
        return DeviceRows(ids, rows, n)

    def __len__(self) -> int:
        return len(self._rows)


class LocalTransport:
    def __init__(self, problem, model, algorithm, seed: int, batch_size: int | None, device_ids=None,
                 faults=(), contention=(), cores=None, uplink: compression.Codec = compression.Codec(),
                 links: np.ndarray | None = None, secagg=None, scheme: str = "B", report_losses: bool = False,
                 privacy=None, evaluated: np.ndarray | None = None, cache_mb: float = 1024.0,
                 eval_apart: bool = True, widths=None):
        """cores: the cores this process's lanes are pinned to, one lane each (None: one unpinned lane;
        with contention, a lane on core 0); uplink: how reports are compressed; links: each device's
        shaped link in megabits per second (index: device id; None: not shaped); secagg: the [secagg] table
        when secure aggregation is on, with the participation scheme its devices pre-scale for; report_losses:
        a selection policy reads what the steps say of their losses (a model that pays for them, torch, then
        computes them); privacy: the [privacy] table when the devices add the noise (mechanism "distributed");
        evaluated: the devices the metrics are taken on ([log] eval_devices; None: every device); cache_mb: the
        built devices' data this process keeps ([data] cache_mb); eval_apart: evaluation may run while a late
        worker still computes (deadlines, asynchrony, over-selection), so it gets a model of its own (else it
        shares the first lane's: the memory of a model's workspaces, tens of MB on a board); widths: [submodel]'s
        width models (width_models.WidthModels), by which a device of a plan's width trains its slice."""
        self.problem, self.model, self.algorithm = problem, model, algorithm
        self.eval_model = model.clone() if eval_apart else model
        self.seed, self.batch_size = seed, batch_size
        n = problem.n_devices
        self.device_ids = np.arange(n) if device_ids is None else np.asarray(device_ids, dtype=np.int64)
        # membership by search in the ascending ids, not a dict of every device (a GB and seconds at 10^7)
        ids = self.device_ids
        self._hosted = ids if device_ids is None or (ids[1:] > ids[:-1]).all() else np.sort(ids)
        self.evaluated = self._hosted if evaluated is None else evaluated[self.hosts(evaluated)]
        if hasattr(problem, "host"):
            problem.host(self.device_ids)
        # label counts of the devices built lately, until the log takes them (bounded: a device the log has
        # counted may be built again, and an evaluated one is never asked for)
        self._labels: OrderedDict[int, np.ndarray] = OrderedDict()
        self._labels_lock = threading.Lock()  # (lanes build devices from their threads)
        self.data = DeviceCache(self._build, cache_mb * 2.0 ** 20, keep=self.evaluated)
        self._faults = {(f.device, f.round): f for f in faults}
        self.vectors = None  # {device vector: its HeldRows}, e.g. SCAFFOLD's c_k
        self._pending = None  # (round, device ids, {delta name: rows}, {report: residual rows}) until accepted
        self.uplink, self.links = uplink, links
        self.residual_rows = None  # {report: HeldRows of the error-feedback residuals}, with error feedback
        self.contention = tuple(contention)
        if cores is None and self.contention:
            cores = (min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0,)
        cores = (None,) if not cores else tuple(cores)
        if model.one_lane:  # e.g. a torch module drawing from torch's process-wide generator
            cores = cores[:1]
        if self.contention:
            pin(cores[0])  # competitors start before any priority drop, on their lanes' cores
        self.lanes = [Lane(core, model if i == 0 else model.clone(), BoardReadings(core),
                           Competitor(core) if self.contention else None) for i, core in enumerate(cores)]
        for i, lane in enumerate(self.lanes):
            lane.widths = None if widths is None else widths if i == 0 else widths.clone()
            for model in [lane.model, *([] if widths is None else lane.widths.models.values())]:
                model.report_losses = report_losses
        self._pool = None  # the lanes' threads, when there are several or competitors to yield to
        self._dispatch = None  # the thread a device rank's round runs on while its main thread serves MPI
        self._stop = threading.Event()  # set: the coordinator needs no more of this round's work
        self.secure = None if secagg is None else SecureDevices(secagg, seed, scheme, model.n_trainable, self.device_ids,
                                                                privacy, None if widths is None else widths.positions)

    @property
    def threads(self) -> int:
        return len(self.lanes)

    def warmup(self, on_compile=None) -> tuple[int, float]:
        """Compile (or load from cache) every kernel a round uses, so no round pays for it; on_compile(names,
        dtype): told before what will compile (warm_model).

        Returns (kernels compiled, seconds): compiled is 0 when the cache was warm (`edgefed warmup`).
        """
        if self.device_ids.size == 0:
            return 0, 0.0
        before, t0 = jit_compilations(), time.perf_counter()
        warm_model(self.model, self.data(int(self.device_ids[0])), self.batch_size, self.algorithm.model_calls,
                   on_compile)
        return jit_compilations() - before, time.perf_counter() - t0

    # -- device vectors (SCAFFOLD's controls) ------------------------------------------------------------
    def start_devices(self, x: np.ndarray, device_ids: np.ndarray) -> dict[str, np.ndarray]:
        """Fresh vectors for these (hosted) devices, joining at x; each device keeps its own, the caller gets
        a copy of their rows (in device_ids order) for the log."""
        vectors, zero = self.algorithm.device_vectors, self.algorithm.zero_start
        self._hold_vectors(x.size, x.dtype)
        fresh = [self.algorithm.device_start(self.eval_model, None if zero else self.data(int(k)), x)
                 for k in device_ids]
        rows = {v.name: np.stack([f[v.name] for f in fresh]) if fresh else np.zeros((0, x.size), x.dtype)
                for v in vectors}
        for name, values in rows.items():
            for k, row in zip(device_ids, values):
                self.vectors[name].set(int(k), row)
        return rows

    def _hold_vectors(self, d: int, dtype) -> None:
        if self.vectors is None:
            self.vectors = {v.name: HeldRows(d, dtype) for v in self.algorithm.device_vectors}
        if self.uplink.error_feedback and self.residual_rows is None:
            self.residual_rows = {r: HeldRows(d, dtype) for r in self.algorithm.reports}

    def load_devices(self, rows: dict[str, DeviceRows]) -> None:
        """Restore the hosted devices' vectors and residuals (sparse: the rows any of them holds)."""
        self.vectors = self.residual_rows = None
        self._hold_vectors(self.model.n_trainable, self.model.dtype)
        for name, held in {**self.vectors, **{compression.residual_name(r): h
                                              for r, h in (self.residual_rows or {}).items()}}.items():
            held.load(rows[name], self.device_ids)

    def accept(self, round_idx: int, device_ids: np.ndarray) -> None:
        """The coordinator kept these devices' reports of round_idx: they add their Deltas to their vectors
        and keep the residuals those reports left."""
        if self._pending is None or self._pending[0] != round_idx:
            return  # nothing pending, or a late round the coordinator dropped
        _, ids, deltas, residuals = self._pending
        for i in np.flatnonzero(np.isin(ids, device_ids)):
            k = int(ids[i])
            for v in self.algorithm.device_vectors:
                self.vectors[v.name].add(k, deltas[v.delta][i])
            for name, values in residuals.items():
                self.residual_rows[name].set(k, values[i])
        self._pending = None

    def residuals(self, round_idx: int, device_ids: np.ndarray) -> dict[str, np.ndarray]:
        """The residuals these devices' reports of round_idx leave them (before `accept`), as the log
        names them."""
        _, ids, _, residuals = self._pending
        at = np.searchsorted(ids, device_ids)
        return {compression.residual_name(name): values[at] for name, values in residuals.items()}

    # -- local work --------------------------------------------------------------------------------------
    def local_work(self, plan: RoundPlan, state, downlink=None) -> LocalResults:
        """In one process the devices read the copy of the model they hold (state) directly; a compressed
        downlink's difference only counts in plan.down_bytes."""
        return self.work(plan, state).results()

    def _round_work(self, plan: RoundPlan, state) -> RoundWork:
        word = None if self.secure is None else np.dtype(f"<u{self.secure.settings.bits // 8}")
        return RoundWork(plan.device_ids.size, state.x.shape[0], state.x.dtype, self.algorithm.reports,
                         self.uplink.error_feedback, word)

    # -- secure aggregation: the protocol's phases before and after the work ----------------------------
    def secagg_keys(self, plan: RoundPlan) -> np.ndarray:
        return self.secure.keys(plan.round_idx, plan.device_ids, plan.widths)

    def secagg_shares(self, round_idx: int, keys: np.ndarray) -> np.ndarray:
        return self.secure.shares(round_idx, keys)

    def secagg_deliver(self, round_idx: int, shares: np.ndarray) -> None:
        self.secure.deliver(round_idx, shares)

    def secagg_reveal(self, round_idx: int, survivors: np.ndarray) -> np.ndarray:
        return self.secure.reveal(round_idx, survivors)

    def submit(self, plan: RoundPlan, state, on_device=None):
        """Start the round's work on a thread of its own (MPI device ranks); returns (Future of the
        RoundWork, the RoundWork being filled). on_device(i) is called from the work as row i is done."""
        if self._dispatch is None:
            self._dispatch = ThreadPoolExecutor(1)
        self._stop.clear()
        work = self._round_work(plan, state)
        return self._dispatch.submit(self.work, plan, state, on_device, work), work

    def stop(self) -> None:
        """The round is over for this rank's devices: the working ones end within a chunk, the others
        do not start."""
        self._stop.set()

    def work(self, plan: RoundPlan, state, on_device=None, work: RoundWork | None = None) -> RoundWork:
        """Run the plan's (hosted) devices in the lanes, each from the server state."""
        if work is None:
            work = self._round_work(plan, state)
        self._hold_vectors(state.x.size, state.x.dtype)
        if self.algorithm.device_vectors or work.residuals:  # from the start: an over-selected round is
            # accepted as devices finish
            self._pending = (plan.round_idx, plan.device_ids.copy(),
                             {v.delta: work.vectors[v.delta] for v in self.algorithm.device_vectors}, work.residuals)
        with self.data.held(plan.device_ids):
            for k in plan.device_ids:  # data is built here, once, not by the lanes at the same time
                self.data(int(k))
            lanes = [(lane, list(range(t, plan.device_ids.size, len(self.lanes)))) for t, lane in enumerate(self.lanes)]
            lanes = [(lane, rows) for lane, rows in lanes if rows]
            if len(self.lanes) == 1 and self.lanes[0].core is None:  # one unpinned lane: right here
                for lane, rows in lanes:
                    self._run_lane(lane, rows, plan, state, work, on_device, pin_thread=False)
            else:
                if self._pool is None:
                    initializer = _lowest_priority if self.contention else None
                    self._pool = ThreadPoolExecutor(len(self.lanes), initializer=initializer)
                futures = [self._pool.submit(self._run_lane, lane, rows, plan, state, work, on_device, True)
                           for lane, rows in lanes]
                for future in futures:
                    future.result()  # a device's error surfaces here
        return work

    def _run_lane(self, lane: Lane, rows, plan: RoundPlan, state, work: RoundWork, on_device, pin_thread: bool):
        # In this process the devices read the server's own vectors and the engine reads the devices' reports
        # as they are: read only both ways, so no algorithm changes in place what an MPI rank would only see a
        # copy of. (x stays writable: the kernels are compiled for writable arrays; LocalTask says hands off.)
        if pin_thread and lane.core is not None:
            pin(lane.core)
        x = state.x
        server = {name: _read_only(value) for name, value in state.vectors.items()}
        stoppable = plan.by_arrival
        due = None  # lateness by this machine's clock only where the work raced it (not a simulated deadline)
        if plan.deadline_s is not None:
            due = plan.deadline_s if plan.round_deadline_s is None else plan.round_deadline_s
        for i in rows:
            k = int(plan.device_ids[i])
            if stoppable and self._stop.is_set():
                work.late[i] = True  # over-selected and not needed: never started
                work.finish[i] = math.nan
            else:
                self._run_device(lane, i, k, plan, x, server, work, stoppable)
                if due is not None and work.finish[i] > due[i] + plan.grace_s:
                    work.late[i] = True  # in one process a hung device is only noticed afterwards; work dropped
                    work.steps[i] = 0
                    for values in work.vectors.values():
                        values[i] = 0
                    if work.masked is not None:
                        work.masked[i], work.nonfinite[i] = 0, False
            if on_device is not None:
                on_device(i)
        if lane.competitor is not None:
            lane.competitor.set_load(0.0)

    def _run_device(self, lane: Lane, i: int, k: int, plan: RoundPlan, x, server, work: RoundWork, stoppable):
        data = self.data(k)
        if lane.competitor is not None:
            lane.competitor.set_load(self.contention[k % len(self.contention)])
        own = {name: held.get(k) for name, held in self.vectors.items()}
        compiled_before = jit_compilations()
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        work.started[i] = wall0
        client = None
        if self.secure is not None:
            client = self.secure.client(plan.round_idx, k)
            if client is None:  # a later round began before this device could start: nothing it sent would count
                work.late[i], work.finish[i] = True, math.nan
                return
            client.prepare_mask()  # the masks do not depend on the update: ready before the work
        self._inject_fault(k, plan.round_idx)
        if plan.deadline_s is None and not stoppable:
            runner = run_all
        else:  # chunked: within a deadline (less what the protocol took already), or stoppable
            budget_s = math.inf if plan.deadline_s is None else float(plan.deadline_s[i])
            runner = DeadlineRunner(budget_s - (client.spent_s if client is not None else 0.0),
                                    stop=self._stop if stoppable else None)
        streams = self._streams(lane.model, data, plan.round_idx, k)
        if plan.widths is None:
            task = LocalTask(x, server, own, plan.steps_to_run(i), plan.lr, self.batch_size, runner, streams)
            work.steps[i] = self.algorithm.client_update(lane.model, data, task,
                                                         {name: rows[i] for name, rows in work.vectors.items()})
        else:
            task = LocalTask(x, {}, {}, plan.steps_to_run(i), plan.lr, self.batch_size, runner, streams)
            work.steps[i] = self._train_slice(lane.widths, float(plan.widths[i]), plan.round_idx, k, data, task,
                                              {name: rows[i] for name, rows in work.vectors.items()})
        if self.secure is None:  # under secure aggregation nothing of a device's training leaves it in the clear
            work.loss_sq[i], work.samples[i] = streams.loss_sq(), streams.samples()
        if client is not None:
            self._mask(client, i, plan, work)
        elif work.steps[i] > 0:
            self._compress(i, k, plan.round_idx, work, None if plan.widths is None else plan.widths[i])
        wall = time.perf_counter() - wall0
        work.compiled[i] = jit_compilations() > compiled_before
        work.elapsed[i] = wall
        work.cpu[i] = 100.0 * (time.thread_time() - cpu0) / wall if wall > 0 else math.nan
        work.freq[i], work.temp[i] = lane.readings.frequency_mhz(), lane.readings.temperature_c()
        down = plan.down_bytes if plan.widths is None else self._slice_bytes(plan.down_bytes, plan.widths[i])
        delay = self.link_delay(k, plan.round_idx, down + int(work.bytes_up[i]))
        if delay:
            work.comm[i] = delay  # in one process the link is accounted for, not slept through
        work.finish[i] = wall + delay
        work.core[i] = -1 if lane.core is None else lane.core

    def _train_slice(self, widths, width: float, round_idx: int, k: int, data, task: LocalTask, rows: dict) -> int:
        """[submodel]: device k trains task.x's slice of its width (HeteroFL), or ordered dropout up to it
        (FjORD: its steps' widths from its own stream), and reports the slice's change into rows, zero
        elsewhere. (No server or device vectors: [submodel] runs FedAvg and FedProx.)"""
        at, x = widths.positions[width], task.x
        draws = widths.step_draws(width, generator(self.seed, Purpose.WIDTH, round_idx, k), task.n_steps)
        out = {name: np.zeros(at.size, x.dtype) for name in rows}
        steps = self.algorithm.client_update(widths.trainer(width, draws), data,
                                             dataclasses.replace(task, x=x[at]), out)
        for name, row in rows.items():
            row[at] = out[name]
        return steps

    def _slice_bytes(self, nbytes: int, width: float) -> int:
        """A whole model's plain bytes, of a width's slice."""
        return slice_bytes(nbytes, self.model.n_trainable, self.lanes[0].widths.n_params(float(width)))

    def _mask(self, client, i: int, plan: RoundPlan, work: RoundWork) -> None:
        """Secure aggregation: the device's masked input replaces its report; a non-finite update is not sent."""
        update = work.vectors[DELTA_X][i]
        if work.steps[i] > 0:
            if np.isfinite(update).all():
                work.masked[i] = self.secure.mask(client, update, float(plan.prescale[i]), int(work.steps[i]),
                                                  int(plan.budgets[i]))
                keep = client.setup.kept(client.device)  # (a submodel's slice and the count: the words it holds)
                work.bytes_up[i] = work.masked[i].itemsize * (work.masked.shape[1] if keep is None else
                                                              int(np.count_nonzero(keep)))
            else:
                work.nonfinite[i] = True
        for rows in work.vectors.values():
            rows[i] = 0  # the update never leaves the device in the clear
        work.secagg_s[i] = client.spent_s

    def _compress(self, i: int, k: int, round_idx: int, work: RoundWork, width=None) -> None:
        """Encode device k's report as the uplink sends it (with its residual added, under error feedback):
        the report rows become what the coordinator decodes, the new residuals wait for acceptance."""
        codec, d = self.uplink, work.vectors[DELTA_X].shape[1]
        if not codec.lossy:  # (a plain uplink: [submodel] refuses another, and sends its slice alone)
            sent = len(work.vectors) * codec.nbytes(d, self.model.dtype)
            work.bytes_up[i] = sent if width is None else self._slice_bytes(sent, width)
            return
        rng = generator(self.seed, Purpose.COMPRESS, round_idx, k) if codec.kind == "int8" else None
        sent = {}
        for name, rows in work.vectors.items():  # Delta x first, then the algorithm's, each from the one stream
            residual = self.residual_rows[name].get(k) if codec.error_feedback else None
            enc, left = codec.send(rows[i], residual, rng)
            rows[i] = compression.decode(enc, rows.dtype)
            if left is not None:
                work.residuals[name][i] = left
            sent[name] = enc
        work.payload[i] = sent
        work.bytes_up[i] = sum(enc.nbytes for enc in sent.values())

    def link_delay(self, device_id: int, round_idx: int, nbytes: int = 0) -> float:
        """Seconds this device's link holds its report in this round: a `[[fault]] kind = "slow_link"`'s,
        plus the time the round's nbytes (down and up) take on a shaped link ([device] link_mbps)."""
        fault = self._faults.get((device_id, round_idx))
        delay = fault.seconds if fault is not None and fault.kind == "slow_link" else 0.0
        if self.links is not None:
            delay += compression.transfer_s(nbytes, float(self.links[device_id]))
        return delay

    def _streams(self, model, data, round_idx: int, device_id: int) -> "Streams":
        return Streams(lambda purpose: model.begin(data, kernel_state(self.seed, purpose, round_idx, device_id)))

    def _inject_fault(self, device_id: int, round_idx: int) -> None:
        fault = self._faults.get((device_id, round_idx))
        if fault is None or fault.kind == "slow_link":
            return
        if fault.kind == "raise":
            raise InjectedFault(f"injected fault: device {device_id} raised in round {round_idx} ([[fault]] in the config)")
        held = np.ones(int(fault.mb * 2 ** 20), np.uint8) if fault.kind == "memory" else None  # (every page touched)
        time.sleep(fault.seconds)
        del held

    # -- evaluation --------------------------------------------------------------------------------------
    def probe(self, round_idx: int, x: np.ndarray, device_ids: np.ndarray) -> np.ndarray:
        """The training loss at x of each of these devices this process hosts (NaN: hosted elsewhere)."""
        out = np.full(len(device_ids), np.nan)
        hosted = self.hosts(device_ids)
        for i, k in enumerate(device_ids):
            if hosted[i]:
                out[i] = self.eval_model.train_loss(x, self.data(int(k)))
        return out

    def _build(self, device_id: int):
        data = self.problem.device(device_id)
        if getattr(self.problem, "labels_later", False) and not self.data.keeps(device_id):  # counted now: the
            # cache may not keep the data (an evaluated device's it keeps, and counts from when asked)
            labels = self.problem.labels_of(data)
            with self._labels_lock:
                self._labels[device_id] = labels
                if len(self._labels) > LABELS_KEPT:
                    self._labels.popitem(last=False)
        return data

    def label_counts(self, device_ids) -> np.ndarray:
        """(ids, C) these devices' label counts, for a log that fills them as devices are built."""
        out = []
        for k in map(int, device_ids):
            with self._labels_lock:
                labels = self._labels.pop(k, None)
            if labels is None:  # dropped, or its data kept from before: counted from its data
                data = self.data(k)
                with self._labels_lock:
                    labels = self._labels.pop(k, None)
                labels = self.problem.labels_of(data) if labels is None else labels
            out.append(labels)
        return np.stack(out)

    def hosts(self, device_ids) -> np.ndarray:
        """Whether this process hosts each of these devices."""
        return find(self._hosted, device_ids)[1]

    def peak_rss(self) -> dict[int, int]:
        return {}  # (the devices are this process's: its own peak is the caller's)

    def evaluate(self, x: np.ndarray) -> Evaluation:
        """Evaluation of the hosted devices that are evaluated."""
        n = self.evaluated.size
        train, test_loss = np.full(n, np.nan), np.zeros(n)
        correct, n_test = np.zeros(n, np.int64), np.zeros(n, np.int64)
        for i, k in enumerate(self.evaluated):
            data = self.data(int(k))
            train[i] = self.eval_model.train_loss(x, data)
            if self.problem.has_test:
                test_loss[i], correct[i] = self.eval_model.loss_correct(x, data.X_test, data.y_test)
                if not self.eval_model.has_accuracy:  # a regression: its test metric is the loss only
                    correct[i] = -1
                n_test[i] = data.y_test.shape[0]  # samples (float targets are (n, width))
        return Evaluation(np.asarray(self.evaluated, np.int64), train, test_loss, correct, n_test)

    def close(self, failed: bool = False) -> None:
        for lane in self.lanes:
            if lane.competitor is not None:
                lane.competitor.stop()
                lane.competitor = None
        for pool in (self._pool, self._dispatch):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._dispatch = None
        self.data.clear()
