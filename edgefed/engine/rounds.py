"""The round loop: membership -> plan -> local work (behind a transport) -> settle -> weigh -> aggregate -> record.

The engine owns the server state and the order of operations; the transport only carries the local work
(in this process or across MPI ranks) and never does math on models; the math lives in `algorithms/` and
`participation/`. What an algorithm adds to FedAvg (vectors sent down, sent back, kept per device, logged)
the engine reads from the algorithm's declarations. Rounds are 1-based; round 0 is the initial model.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np

from edgefed import compression
from edgefed.algorithms.base import Algorithm, DeviceRows, RoundReports, ServerState, nonzero_rows
from edgefed.config import Config
from edgefed.engine.clock import RoundClock
from edgefed.engine.round_rows import RoundRows
from edgefed.engine.secure import SecureSum
from edgefed.participation import privacy, schemes, submodels
from edgefed.participation.budgets import local_budgets
from edgefed.participation.dynamics import Dynamics, Membership
from edgefed.participation.sampling import evaluation_sample
from edgefed.participation.selection import Choice, Feedback, View, build_policy
from edgefed.runlog import round_ids
from edgefed.participation.timing import Timing, overselected
from edgefed.participation.traces import ReplayTrace
from edgefed.rng import Purpose, generator
from edgefed.transport import PROBE_BYTES, Evaluation, RoundPlan


@dataclass(frozen=True)
class RoundSummary:
    """What a progress line shows after a round."""

    round_idx: int
    rounds: int
    train_loss: float
    test_loss: float
    test_accuracy: float
    participants: int
    n_active: int
    n_dropped: int
    elapsed_s: float
    n_late: int = 0
    steps_done: int = 0
    steps_asked: int = 0
    n_applied: int = 0
    evaluated: bool = True  # the round's metrics were computed (log.eval_every); NaN otherwise
    note: str = ""  # what else the line should say (a secure aggregation the survivors could not unmask)


@dataclass(frozen=True)
class Weighed:
    """A round's reports as its rule weighs them, in plan order."""

    nonfinite: np.ndarray  # (S,) bool: the report held a non-finite value: dropped, never averaged in
    counted: np.ndarray  # (S,) the steps that count: 0 for a late, non-finite or silent report
    coeffs: np.ndarray  # (S,) p_k applied to Delta x_k (0: nothing applied)
    reported: np.ndarray  # (S,) bool: the report is applied
    levels: np.ndarray | None = None  # [submodel]: (widths, S) the coefficients of each width's coordinates


class RoundEngine(RoundRows):
    def __init__(self, cfg: Config, algorithm: Algorithm, n_train: np.ndarray, transport, log, on_round=None,
                 trace=None, timing: Timing | None = None, count_labels=None, submodels=None):
        """count_labels: ids -> their devices' label counts, for a log that fills /devices/label_counts as
        the devices are first selected (a large generated federation); None: the log has them all.
        submodels: [submodel] as run (participation.submodels.Submodels; None: every device the whole model)."""
        self.cfg = cfg
        self.count_labels = count_labels
        self.algorithm = algorithm
        self.trace = trace  # trace mode: a ReplayTrace (selections and steps) or SampledTraces (steps)
        self.n_train = np.asarray(n_train, dtype=np.int64)
        self.n_devices = self.n_train.size
        self.transport = transport
        self.log = log
        self.on_round = on_round or (lambda summary: None)
        self.dynamics = Dynamics(cfg.dynamics, self.n_devices, cfg.mpi.away)
        self.members: Membership = self.dynamics.at(0)  # the federation of the round under way
        self._federation: schemes.Federation | None = None
        self._mean_samples: float | None = None  # secure aggregation's prescales' mean count
        self._budgets = local_budgets(cfg.train, self.n_train)
        self.timing = timing or Timing()
        self.clock = RoundClock(self.timing, self.n_devices, cfg.participation.mode,
                                trace if isinstance(trace, ReplayTrace) else None, self._budgets)
        self.selection = build_policy(cfg.selection, cfg.seed, self.n_train, cfg.rounds)
        self.considered = cfg.selection.policy != "uniform"  # the log keeps what the policy considered
        batch = self.n_train if cfg.train.batch_size == "full" else np.minimum(self.n_train, cfg.train.batch_size)
        self._batch = np.maximum(batch, 1)
        self._sizes = np.minimum(self.n_train, self._budgets * self._batch)  # the samples a full round trains on
        self._choice: Choice | None = None  # the round's selection, as the policy made it
        self._probed = None  # (candidates, seconds, those that answered) of the round's loss pass (power of choice)
        # differential privacy around the algorithm's server updates (docs/design.md 2.19)
        self.privacy = privacy.around_updates(cfg, self.n_devices,
                                              trace.selected if isinstance(trace, ReplayTrace) else None)
        self.evaluated = evaluation_sample(cfg.seed, self.n_devices, cfg.log.eval_devices)
        self._recorded_quorum = None  # a replay of an over-selected run: the config whose S was its quorum
        if isinstance(trace, ReplayTrace) and trace.overselected:
            self._recorded_quorum = cfg if trace.per_round is None else dataclasses.replace(
                cfg, train=dataclasses.replace(cfg.train, clients_per_round=trace.per_round))
        self._labelled = np.zeros(self.n_devices, bool)  # whose label counts the log has (count_labels)
        self._held = np.zeros(self.n_devices, bool)  # whose device vectors the log may hold other than zero
        self.state: ServerState | None = None
        _, self.downlink = compression.codecs(cfg.compress)
        self.residual_names = (tuple(compression.residual_name(r) for r in algorithm.reports)
                               if cfg.compress.error_feedback else ())
        self.replica: ServerState | None = None  # the model the devices hold, with a compressed downlink
        self.secure = None  # secure aggregation's server side, set once the model's size is known (start)
        self.submodels = submodels

    @property
    def active(self) -> np.ndarray:
        """(N,) bool: the devices in the federation (the objective) this round."""
        return self.members.active

    @property
    def federation(self) -> schemes.Federation:
        """The members' ids and sample total, made again only when the membership changed."""
        if self._federation is None or self._federation.active is not self.members.active:
            self._federation = schemes.Federation(self.members.active, self.n_train)
        return self._federation

    # -- planning ----------------------------------------------------------------------------------------
    def learning_rate(self, round_idx: int, shift_round: int = 0) -> float:
        t = self.cfg.train
        if t.lr_schedule == "staircase":
            return t.lr_local / (round_idx - shift_round)
        return t.lr_local

    def plan(self, round_idx: int) -> RoundPlan:
        """Who works in round round_idx (the federation's membership already updated) and how much."""
        members = self.members
        lr = self.learning_rate(round_idx, members.shift_round)
        p = self.cfg.participation
        self._choice, self._probed = None, None
        quorum = None
        if not isinstance(self.trace, ReplayTrace):  # the policy's selection
            active_ids = self.federation.ids
            count = self.cfg.clients_per_round_count(active_ids.size)
            if self.timing.overselect > 0:  # over-commit: the first S to complete are taken
                quorum, count = count, overselected(count, self.timing.overselect, active_ids.size)
            self._choice = self.selection.select(self._view(round_idx, active_ids, count))
            selected = self._choice.selected
            steps = None
            if self.trace is not None:
                steps = self.trace.steps(self.cfg.seed, round_idx, selected, self._budgets[selected])
        else:  # the recorded selection, within this run's federation
            selected, steps = self.trace.recorded(round_idx)
            member = self.active[selected]
            selected, steps = selected[member], steps[member]
        budgets = self._budgets[selected]
        deadlines = self.clock.deadlines(selected, budgets, None if self._choice is None else self._choice.deadline_among)
        if deadlines.steps is not None:  # a simulated deadline: the steps that fit at the device's speed
            steps = deadlines.steps if steps is None else np.minimum(steps, deadlines.steps)
        silent = members.silent[selected]
        if silent.any():  # departed but still in the objective: selected, never reporting
            steps = np.where(silent, 0, budgets if steps is None else steps).astype(np.int32)
        prescale = None
        if self.cfg.secagg.enabled:
            if self._mean_samples is None:  # (once: the devices' counts do not change)
                self._mean_samples = float(self.n_train.mean())
            prescale = (schemes.prescales(self.cfg.train.weighting, selected, self.n_train, self._mean_samples)
                        * members.boost(selected))
        return RoundPlan(round_idx, selected, budgets, lr, steps=None if steps is None else np.minimum(steps, budgets),
                         deadline_s=deadlines.compute_s, grace_s=p.grace_s, round_deadline_s=deadlines.due_s,
                         quorum=quorum, by_arrival=quorum is not None and not self.clock.simulated,
                         down_bytes=self.down_bytes(), prescale=prescale, **self._widths(round_idx, selected))

    def _widths(self, round_idx: int, selected: np.ndarray) -> dict:
        """[submodel]: the selected devices' widths (a replay's as it recorded them) and what the broadcast
        brings each. Under secure aggregation no width's coordinates may have one holder (its sum would be its
        update): a device wider than every other selected one trains the widest width another reaches."""
        if self.submodels is None:
            return {}
        recorded = self.trace.width if isinstance(self.trace, ReplayTrace) else None
        widths = (recorded[round_idx - 1, selected] if recorded is not None
                  else self.submodels.device_width[selected]).astype(np.float64)
        if self.cfg.secagg.enabled and recorded is None and widths.size > 1:
            widths = np.minimum(widths, np.sort(widths)[-2])
        return {"widths": widths, "down_each": self.submodels.slice_bytes(self.down_bytes(), widths)}

    # -- selection ---------------------------------------------------------------------------------------
    def _view(self, round_idx: int, members: np.ndarray, count: int) -> View:
        """What a selection policy may read: the members and their weights, the devices' predicted times
        (measured speeds and links, else their profiles'), the deadline's window, and their losses on demand."""
        work = seconds = None  # a policy that reads no speeds (uniform) costs the round nothing here
        if self.selection.reads_speeds:
            forecast = self.clock.forecast(np.arange(self.n_devices), self._budgets)
            work, seconds = forecast.work_s, forecast.round_s
        weights = (schemes.weights_among(self.cfg.train.weighting, members, self.n_train)
                   if self.selection.reads_weights else None)
        return View(round_idx, members, count, weights, seconds, work,
                    self._sizes, self._budgets,
                    least=2 if self.cfg.secagg.enabled else 1, window=lambda c: self.clock.windows(c, self._budgets[c]),
                    deadline_s=None if self.timing.quantile is not None else self.timing.deadlines,
                    losses=lambda c: self._probe(round_idx, c))

    def _probe(self, round_idx: int, ids: np.ndarray) -> np.ndarray:
        """The candidates' local losses F_k(x) at the server model: x to each, a loss back from each that
        answers (a departed device that stays in the objective is silent: NaN), counted in the round's bytes
        and clock."""
        t0 = time.perf_counter()
        answers = ~self.members.silent[ids]
        losses = np.full(ids.size, np.nan)
        if answers.any():
            losses[answers] = self.transport.probe(round_idx, self.state.x, ids[answers])
        seconds = self.clock.probe_s(ids, self.n_train[ids], self._batch[ids], self.state.x.nbytes + PROBE_BYTES,
                                     time.perf_counter() - t0)
        self._probed = (ids, seconds, ids[answers])
        return losses

    def _observe(self, plan: RoundPlan, res, reported: np.ndarray) -> None:
        """What the round's reports tell the selection policy (Oort's utilities)."""
        n = plan.device_ids.size
        loss_sq = np.zeros(n) if res.loss_sq is None else res.loss_sq
        samples = np.zeros(n, np.int64) if res.samples is None else res.samples
        self.selection.observe(Feedback(plan.round_idx, plan.device_ids, reported, loss_sq, samples))

    def _fixed_s(self, plan: RoundPlan) -> int:
        """The round's fixed denominator S: the reports it takes (over-selection's quorum, also in a replay of
        such a run), so p_k = a_k / S (differential privacy's, docs/design.md 2.19)."""
        if plan.quorum is not None:
            return plan.quorum
        if self._recorded_quorum is not None:
            return self._recorded_quorum.clients_per_round_count(self.federation.ids.size)
        return plan.device_ids.size

    # -- the wire ----------------------------------------------------------------------------------------
    def down_bytes(self) -> int:
        """What the round's broadcast brings each selected device: x and the server vectors, as encoded."""
        x = self.state.x
        return (1 + len(self.algorithm.server_vectors)) * self.downlink.nbytes(x.size, x.dtype)

    def _broadcast(self, round_idx: int):
        """(what the devices hold this round, the encoded differences that bring it to them, or None).

        With a compressed downlink the devices keep a copy of the server's vectors; each round the server
        sends the difference to that copy, encoded, and both sides add its decoding to the copy, so what
        the copy misses is sent again in later rounds (docs/design.md 2.13)."""
        if not self.downlink.lossy:
            return self.state, None
        rng = generator(self.cfg.seed, Purpose.COMPRESS, round_idx) if self.downlink.kind == "int8" else None
        current, held = self._vectors(self.state), self._vectors(self.replica)
        encoded, copy = {}, {}
        for name, value in current.items():  # x first, then the server vectors, each from the one stream
            encoded[name] = self.downlink.encode(value - held[name], rng)
            copy[name] = held[name] + compression.decode(encoded[name], value.dtype)
        self.replica = ServerState(copy.pop("x"), copy)
        return self.replica, encoded

    @staticmethod
    def _vectors(state: ServerState) -> dict:
        return {"x": state.x, **state.vectors}

    def _replica_slots(self) -> dict:
        if self.replica is None:
            return {}
        return {compression.replica_name(name): value for name, value in self._vectors(self.replica).items()}

    # -- evaluation --------------------------------------------------------------------------------------
    def metrics(self, ev: Evaluation) -> tuple[float, float, float]:
        """(train objective, test loss, test accuracy) over the federation, reduced in ascending device id;
        with [log] eval_devices over the members of its sample, weighted as the objective weighs them."""
        federation = self.federation
        if self.evaluated is None:
            active_ids = federation.ids
            weights = schemes.objective_weights(self.cfg.train.weighting, federation, self.n_train)
        else:
            active_ids = self.evaluated[self.active[self.evaluated]]
            if not active_ids.size:  # every sampled device has left the federation
                return math.nan, math.nan, math.nan
            weights = schemes.objective_weights(self.cfg.train.weighting, federation, self.n_train, active_ids)
            weights = weights / math.fsum(weights)
        rows = ev.rows(active_ids)
        # math.fsum, not np.dot: BLAS's ddot sums in a CPU-dependent order (aarch64 and x86-64 differed by 2 ULPs)
        train = math.fsum(weights * ev.train_loss[rows])
        n_test = int(ev.n_test[rows].sum())
        if n_test == 0:
            return train, math.nan, math.nan
        correct = ev.test_correct[rows]
        accuracy = math.nan if (correct < 0).any() else float(correct.sum() / n_test)  # < 0: no accuracy (mse)
        return train, float(ev.test_loss_sum[rows].sum() / n_test), accuracy

    def _due(self, round_idx: int) -> tuple[bool, bool]:
        """(evaluate now, store the model now)."""
        last = round_idx == self.cfg.rounds
        every = self.cfg.log.every or 1  # unset (an engine driven without prepare's resolution): every round
        return (last or round_idx % self.cfg.log.eval_every == 0, last or round_idx % every == 0)

    def _declared(self, state: ServerState, method: str) -> ServerState:
        """The state, once it holds exactly the server vectors the algorithm declares: the transports send,
        and the log stores, only those."""
        declared = [v.name for v in self.algorithm.server_vectors]
        if sorted(state.vectors) != sorted(declared):
            raise TypeError(f"{type(self.algorithm).__name__}.{method} gave server vectors {sorted(state.vectors)}, "
                            f"but the algorithm declares {sorted(declared)}")
        return state

    # -- device vectors (SCAFFOLD's controls): kept on the devices, mirrored in the log, sparse ------------------
    def _members(self, rows: dict[str, DeviceRows]) -> dict[str, DeviceRows]:
        return {name: r.take(self.federation.ids) for name, r in rows.items()}

    def _held_rows(self) -> dict[str, DeviceRows]:
        """The log's rows of the devices that may hold one other than zero (the others are zero)."""
        ids = np.flatnonzero(self._held)
        return {v.name: DeviceRows(ids, self.log.read_rows(v.name, ids), self.n_devices)
                for v in self.algorithm.device_vectors}

    def _fresh_rows(self, x: np.ndarray, ids: np.ndarray) -> dict[str, DeviceRows] | None:
        """The vectors these devices start with at x, as the transport's devices took them; None for a zero
        start (nothing to build, send or write: a device holds zero until a report changes it, and a device
        arrives once, before it ever reported)."""
        if self.algorithm.zero_start:
            return None
        ids = np.asarray(ids, np.int64)
        rows = self.transport.start_devices(x, ids)
        for values in rows.values():
            self._held[ids[nonzero_rows(values)]] = True
        return {name: DeviceRows(ids, values, self.n_devices) for name, values in rows.items()}

    # -- the loop ----------------------------------------------------------------------------------------
    def start(self, x0: np.ndarray) -> ServerState:
        """Log round 0: the initial model (and the devices' vectors) and its metrics."""
        rows = {}
        if self.algorithm.device_vectors:
            fresh = self._fresh_rows(x0, np.arange(self.n_devices))
            none = DeviceRows(np.zeros(0, np.int64), np.zeros((0, x0.size), x0.dtype), self.n_devices)
            rows = {v.name: none if fresh is None else fresh[v.name].nonzero() for v in self.algorithm.device_vectors}
            for name, values in rows.items():
                self.log.set_rows(name, values)
        self.state = self._declared(ServerState(x0, self.algorithm.server_start(x0, self._members(rows))), "server_start")
        self._secure_side(x0.size)
        if self.downlink.lossy:  # every device starts from x_0 (and the server's first vectors), sent in full
            self.replica = ServerState(x0.copy(), {name: v.copy() for name, v in self.state.vectors.items()})
        train, test_loss, test_acc = self.metrics(self.transport.evaluate(x0))
        self.log.append({"metrics/train_loss": train, "metrics/test_loss": test_loss,
                         "metrics/test_accuracy": test_acc, "metrics/clock_s": 0.0,
                         **self.privacy.first_row()})
        self._stage_and_commit(0, None, store=True)
        self.on_round(RoundSummary(0, self.cfg.rounds, train, test_loss, test_acc, 0, self.federation.ids.size, 0, 0.0))
        return self.state

    def resume(self, state: dict, done: int, logged: dict | None = None) -> ServerState:
        """Restore the server state (and the devices' vectors) of a resume point; logged: the log's completed
        rounds, from which the clock and the devices' measured speeds continue."""
        self.members = self.dynamics.at(done)
        if logged is not None:
            self.clock.restore(logged, done)
            selected = logged["participation/selected"]
            self._count_labels(np.concatenate([np.zeros(0, np.int64)] + [round_ids(selected, r)
                                                                          for r in range(min(done, selected.shape[0]))]))
        algo = self.algorithm
        self.state = ServerState(state["x"], {v.name: state[v.name] for v in algo.server_vectors})
        self._secure_side(self.state.x.size)
        if self.downlink.lossy:
            held = {name: state[compression.replica_name(name)] for name in self._vectors(self.state)}
            self.replica = ServerState(held.pop("x"), held)
        rows = [v.name for v in algo.device_vectors] + list(self.residual_names)
        if rows:
            self.transport.load_devices({name: state[name] for name in rows})
        for v in algo.device_vectors:
            self._held[state[v.name].ids] = True
        slots = self.selection.slots(self.n_train.size, self.cfg.rounds)
        self.selection.load({name: state[name] for name, _, _ in slots})
        self.privacy.load({name: state[name] for name, _, _ in self.privacy.slots})
        return self.state

    def _extra_slots(self) -> dict:
        """Resume state an engine keeps beside the server's and the policies' (FedBuff's schedule)."""
        return {}

    def _secure_side(self, dim: int) -> None:
        if self.cfg.secagg.enabled:
            self.secure = SecureSum(self.cfg, dim, self.transport, self.n_devices, self.submodels)

    def _count_labels(self, ids: np.ndarray) -> None:
        """The label counts of the devices the log does not have yet, written to it (count_labels)."""
        if self.count_labels is None:
            return
        new = np.unique(np.asarray(ids, np.int64))
        new = new[~self._labelled[new]]
        if new.size:
            self.log.fill_rows("devices/label_counts", new, self.count_labels(new))
            self._labelled[new] = True

    def run(self, done: int = 0) -> ServerState:
        """Rounds done+1 .. R from the current state (the one after round `done`)."""
        for round_idx in range(done + 1, self.cfg.rounds + 1):
            self.round(round_idx)
        return self.state

    def _shift(self, round_idx: int):
        """Membership of round round_idx; on an objective shift the algorithm adapts its server state to the
        new federation (SCAFFOLD: c = mean c_k over the members).

        An arriving device first gets fresh vectors (SCAFFOLD: zero, or its full local gradient at x).
        Returns {name: (ids, rows)} of such new rows, which the round's checkpoint writes to the log.
        """
        self.members = self.dynamics.at(round_idx)
        if not self.members.shifts:
            return None
        rows, sets = {}, None
        arriving = self.members.arriving
        if self.algorithm.device_vectors:
            rows = self._held_rows()
            fresh = self._fresh_rows(self.state.x, arriving) if arriving.size else None
            if fresh is not None:
                rows = {name: rows[name].updated(arriving, values.rows) for name, values in fresh.items()}
                sets = {name: (arriving, values.rows) for name, values in fresh.items()}
        self.state = self._declared(self.algorithm.federation_changed(self.state, self._members(rows)),
                                    "federation_changed")
        return sets

    def round(self, round_idx: int) -> ServerState:
        wall0 = time.perf_counter()
        sets = self._shift(round_idx)
        plan = self.plan(round_idx)
        work0 = time.perf_counter()
        if self.secure is not None:
            self.secure.begin(plan)
        held, downlink = self._broadcast(round_idx)
        res = self.transport.local_work(plan, held, downlink)
        worked = time.perf_counter()
        settled = self.clock.settle(plan, res)
        weighed = self._weigh(plan, res, settled)
        extra, note = self._aggregate(plan, res, weighed)
        done = time.perf_counter()
        # the residuals come to the log for --resume, as the evaluation comes: the bench's traffic, outside
        # the round's clock and bytes (a deployment's devices would keep them)
        accepted = plan.device_ids[weighed.reported]
        residuals = self.transport.residuals(round_idx, accepted) if self.residual_names else {}
        self.transport.accept(round_idx, accepted)
        clock = self.clock.advance(round_idx, settled, done - work0, done - worked,
                                   0.0 if self._probed is None else self._probed[1])
        self._record(plan, res, settled, weighed, extra, note, clock, sets, accepted, residuals, wall0)
        return self.state

    def _weigh(self, plan: RoundPlan, res, settled) -> Weighed:
        """The rule's coefficients of the round's reports. A non-finite update is dropped (counted, logged),
        never averaged in: it weighs as a device that did nothing, as does a late one (its steps count as 0)."""
        nonfinite = np.zeros(plan.device_ids.size, bool) if res.nonfinite is None else res.nonfinite.copy()
        for values in res.vectors.values():
            nonfinite |= ~np.isfinite(values).all(axis=1)
        late = settled.late
        counted = np.where(nonfinite | late, 0, settled.steps)
        # Over-selected devices beyond the quorum are surplus, not stragglers: the weights are over the
        # reports the round took (a replay of such a run weighs the same way).
        surplus = plan.quorum is not None or (isinstance(self.trace, ReplayTrace) and self.trace.overselected)
        pool = ~late if surplus else np.ones(late.size, bool)
        coeffs = np.zeros(plan.device_ids.size)
        # [submodel]: each width's coordinates take the rule over the devices that hold them
        levels = None if plan.widths is None else np.zeros((len(self.submodels.widths), plan.device_ids.size))
        if pool.any() and levels is None:
            coeffs[pool] = schemes.coefficients(self.cfg.train.weighting, self.cfg.participation.scheme,
                                                plan.device_ids[pool], self.federation, self.n_train,
                                                counted[pool], plan.budgets[pool])
        elif pool.any():
            base = schemes.base_weights(self.cfg.train.weighting, plan.device_ids[pool], self.federation, self.n_train)
            levels[:, pool] = submodels.level_coefficients(self.cfg.participation.scheme, base, counted[pool],
                                                           plan.budgets[pool], plan.widths[pool],
                                                           self.submodels.widths)
            coeffs[:] = levels[0]  # (the coordinates every device holds: the plain rule's, which the log keeps)
        boost = self.members.boost(plan.device_ids)  # fast-reboot of arriving devices
        for values in (coeffs,) if levels is None else (coeffs, *levels):
            values *= boost
            values[counted == 0] = 0.0  # nothing applied: log 0 (Scheme B's w_k would multiply a zero update)
        return Weighed(nonfinite, counted, coeffs, counted > 0, levels)

    def _aggregate(self, plan: RoundPlan, res, w: Weighed) -> tuple[dict, str]:
        """The server update from the weighed reports (through secure aggregation's one sum when it is on,
        and the run's privacy around the algorithm's update); the policy told what the reports said. Returns
        the round's further log columns and what its progress line should add."""
        lr_global, n_federation = self.cfg.train.lr_global, self.federation.ids.size
        reports = RoundReports(plan.device_ids, res.vectors, w.coeffs, w.reported, lr_global, n_federation)
        extra, note = {}, ""
        if self.secure is not None:  # the one sum of the survivors' scaled updates, never one of them
            reports, extra, aborted = self.secure.reports(plan, res, w.coeffs, w.reported, w.counted, lr_global,
                                                          n_federation, w.levels)
            if aborted is not None:  # Bonawitz et al.: too few survivors to unmask, the round is abandoned
                note = (f"secagg aborted: {int(w.reported.sum())} of {plan.device_ids.size} survived, "
                        f"threshold {self.secure.setup.threshold}" + (
                            "" if self.secure.alone is None else f"; width {self.secure.alone:g} had one"))
                w.coeffs[:] = 0.0
                w.reported[:] = False
            elif extra["metrics/secagg_clipped"]:  # the sum is not the plain one: say so
                note = f"secagg clipped {extra['metrics/secagg_clipped']} coordinates"
        if w.levels is not None and self.secure is None:  # (no privacy: [submodel] refuses it)
            state, private = submodels.server_update(self.algorithm, self.state, reports, w.levels,
                                                     self.submodels.levels), {}
        else:
            state, private = self.privacy.server_update(self.algorithm, self.state, reports, self._fixed_s(plan),
                                                        plan.round_idx)
        self.state = self._declared(state, "server_update")
        self._observe(plan, res, w.reported)
        return {**extra, **private}, note

    def _record(self, plan: RoundPlan, res, settled, w: Weighed, extra: dict, note: str, clock: float, sets,
                accepted: np.ndarray, residuals: dict, wall0: float) -> None:
        """The round's metrics (when due), its log row, the devices' changed vectors and the resume state
        (sets: the arriving devices' fresh rows; accepted: the devices whose reports were applied; residuals:
        error feedback's of the accepted), then its progress line."""
        round_idx = plan.round_idx
        evaluate, store = self._due(round_idx)
        metrics = self.metrics(self.transport.evaluate(self.state.x)) if evaluate else (math.nan,) * 3
        elapsed = time.perf_counter() - wall0
        self.log.ensure_room(plan.device_ids.size + (0 if sets is None else self.members.arriving.size))
        self.log.append({**self._round_row(plan, res, settled, w.coeffs, w.nonfinite, metrics, elapsed, clock),
                         **extra})
        self._count_labels(plan.device_ids)
        changes = {v.name: (accepted, res.vectors[v.delta][w.reported]) for v in self.algorithm.device_vectors}
        if changes:
            self._held[accepted] = True
        sets = {**(sets or {}), **{name: (accepted, rows) for name, rows in residuals.items()}}
        elapsed = self._stage_and_commit(round_idx, changes, store, sets, wall0)
        late = settled.late
        self.on_round(RoundSummary(round_idx, self.cfg.rounds, *metrics, int(np.count_nonzero(w.counted)),
                                   self.federation.ids.size, int(w.nonfinite.sum()), elapsed, int(late.sum()),
                                   int(np.sum(settled.steps[~late & ~w.nonfinite])), int(plan.budgets.sum()),
                                   int(np.count_nonzero(w.coeffs)), evaluate, note))

    def _stage_and_commit(self, round_idx, changes, store: bool, sets=None, wall0: float | None = None):
        """Resume state, the stored trajectory rows, then the round marker (last).

        changes: {device vector: (reporting ids, their Deltas)} of the round (None at the start). wall0: when
        the round began: its row's round_elapsed_s is rewritten, before the marker, to cover every write of
        the round but the marker's own flush; returned (None without wall0).
        """
        state, algo = self.state, self.algorithm
        slots = {"x": state.x, **{v.name: state.vectors[v.name] for v in algo.server_vectors}, **self._replica_slots(),
                 **self.selection.values(), **self.privacy.values(), **self._extra_slots()}
        stored = {"trajectory/round": round_idx, "trajectory/x": state.x,
                  **{v.column: state.vectors[v.name] for v in algo.server_vectors}}
        self.log.stage(round_idx, slots, changes or None, sets or None)
        if store:
            if self.cfg.log.client_controls:
                stored.update({v.column: self.log.rows(v.name) for v in algo.device_vectors})
            self.log.append(stored)
        elapsed = None
        if wall0 is not None:
            elapsed = time.perf_counter() - wall0
            self.log.amend("metrics/round_elapsed_s", elapsed)
        self.log.commit(round_idx)
        return elapsed
