"""The round loop: plan -> local work (behind a transport) -> aggregate -> log.

The engine owns the server state and the order of operations; the transport only carries the local work
(in this process or across MPI ranks) and never does math on models; the math lives in `algorithms/` and
`participation/`. Rounds are 1-based; round 0 is the initial model.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from edgefed.algorithms import fedavg, scaffold
from edgefed.config import Config
from edgefed.participation import schemes
from edgefed.participation.dynamics import Dynamics
from edgefed.participation.sampling import select_devices
from edgefed.participation.traces import ReplayTrace
from edgefed.runtime.messages import Evaluation, RoundPlan


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


def local_budgets(cfg: Config, n_train: np.ndarray) -> np.ndarray:
    """K_k for every device: K, or ceil(E * n_k / B) local steps for E epochs of batch B."""
    t = cfg.train
    if t.local_epochs is None:
        return np.full(n_train.size, t.local_steps, dtype=np.int32)
    batch = n_train if t.batch_size == "full" else np.minimum(t.batch_size, n_train)
    return np.array([math.ceil(t.local_epochs * n / b - 1e-9) for n, b in zip(n_train, batch)], np.int32)


class RoundEngine:
    def __init__(self, cfg: Config, n_train: np.ndarray, transport, log, on_round=None, trace=None, deadlines=None):
        self.cfg = cfg
        self.trace = trace  # trace mode: a ReplayTrace (selections and steps) or SampledTraces (steps)
        self.n_train = np.asarray(n_train, dtype=np.int64)
        self.n_devices = self.n_train.size
        self.transport = transport
        self.log = log
        self.on_round = on_round or (lambda summary: None)
        self.dynamics = Dynamics(cfg.dynamics, self.n_devices)
        self.active = self.dynamics.active(0)
        self._budgets = local_budgets(cfg, self.n_train)
        self._deadlines = None if deadlines is None else np.asarray(deadlines, np.float64)
        self.scaffold = cfg.train.algorithm == "scaffold"
        self.c = None  # SCAFFOLD's server control

    # -- planning ----------------------------------------------------------------------------------------
    def learning_rate(self, round_idx: int, shift_round: int = 0) -> float:
        t = self.cfg.train
        if t.lr_schedule == "staircase":
            return t.lr_local / (round_idx - shift_round)
        return t.lr_local

    def plan(self, round_idx: int) -> RoundPlan:
        """Who works in round round_idx (the federation's membership already updated) and how much."""
        lr = self.learning_rate(round_idx, self.dynamics.shift_round(round_idx))
        p = self.cfg.participation
        if isinstance(self.trace, ReplayTrace):  # the recorded selection, within this run's federation
            selected, steps = self.trace.round(round_idx)
            member = self.active[selected]
            selected, steps = selected[member], steps[member]
        else:
            active_ids = np.flatnonzero(self.active)
            count = self.cfg.clients_per_round_count(active_ids.size)
            selected = select_devices(self.cfg.seed, round_idx, active_ids, count)
            steps = None
            if self.trace is not None:
                steps = self.trace.steps(self.cfg.seed, round_idx, selected, self._budgets[selected])
        silent = self.dynamics.silent(round_idx)[selected]
        if silent.any():  # departed but still in the objective: selected, never reporting
            steps = np.where(silent, 0, self._budgets[selected] if steps is None else steps).astype(np.int32)
        budgets = self._budgets[selected]
        return RoundPlan(round_idx, selected, budgets, lr, steps=None if steps is None else np.minimum(steps, budgets),
                         deadline_s=None if self._deadlines is None else self._deadlines[selected], grace_s=p.grace_s)

    # -- evaluation --------------------------------------------------------------------------------------
    def metrics(self, ev: Evaluation) -> tuple[float, float, float]:
        """(train objective, test loss, test accuracy) over the federation, reduced in ascending device id."""
        active_ids = np.flatnonzero(self.active)
        weights = schemes.objective_weights(self.cfg.train.weighting, active_ids, self.n_train)
        # math.fsum, not np.dot: BLAS's ddot sums in a CPU-dependent order (aarch64 and x86-64 differed by 2 ULPs)
        train = math.fsum(weights * ev.train_loss[active_ids])
        n_test = int(ev.n_test[active_ids].sum())
        if n_test == 0:
            return train, math.nan, math.nan
        return (train, float(ev.test_loss_sum[active_ids].sum() / n_test),
                float(ev.test_correct[active_ids].sum() / n_test))

    def _due(self, round_idx: int) -> tuple[bool, bool]:
        """(evaluate now, store the model now)."""
        last = round_idx == self.cfg.rounds
        return (last or round_idx % self.cfg.log.eval_every == 0, last or round_idx % self.cfg.log.every == 0)

    # -- the loop ----------------------------------------------------------------------------------------
    def start(self, x0: np.ndarray) -> None:
        """Log round 0: the initial model (and controls) and its metrics."""
        if self.scaffold:
            controls = self.transport.init_controls(x0, self.cfg.scaffold.init)
            self.c = scaffold.mean_control(controls[np.flatnonzero(self.active)], x0.dtype)
            self.log.set_rows("c_clients", controls)
        train, test_loss, test_acc = self.metrics(self.transport.evaluate(x0))
        self.log.append({"metrics/train_loss": train, "metrics/test_loss": test_loss,
                         "metrics/test_accuracy": test_acc})
        self._stage_and_commit(0, x0, np.zeros(0, np.int64), None, store=True)
        self.on_round(RoundSummary(0, self.cfg.rounds, train, test_loss, test_acc, 0, int(self.active.sum()), 0, 0.0))

    def resume(self, state: dict, done: int) -> np.ndarray:
        """Restore the server state (and the devices' controls) of a resume point; returns x."""
        self.active = self.dynamics.active(done)
        if self.scaffold:
            self.c = state["c"]
            self.transport.load_controls(state["c_clients"])
        return state["x"]

    def run(self, x: np.ndarray, done: int = 0) -> np.ndarray:
        """Rounds done+1 .. R from server model x (the model after round `done`)."""
        for round_idx in range(done + 1, self.cfg.rounds + 1):
            x = self.round(round_idx, x)
        return x

    def _shift(self, round_idx: int, x: np.ndarray):
        """Membership of round round_idx; on an objective shift SCAFFOLD's c is re-averaged over it.

        An arriving device first gets a fresh control (zero, or its full local gradient at x). Returns the
        (ids, rows) of such new controls, which the round's checkpoint writes to the log.
        """
        self.active = self.dynamics.active(round_idx)
        if not (self.scaffold and self.dynamics.shifts_at(round_idx)):
            return None
        arriving = self.dynamics.arriving(round_idx)
        controls = self.log.rows("c_clients")
        sets = None
        if arriving.size:
            rows = self.transport.reset_controls(x, self.cfg.scaffold.init, arriving)
            controls[arriving] = rows
            sets = (arriving, rows)
        self.c = scaffold.mean_control(controls[np.flatnonzero(self.active)], x.dtype)
        return sets

    def round(self, round_idx: int, x: np.ndarray) -> np.ndarray:
        wall0 = time.perf_counter()
        t = self.cfg.train
        control_sets = self._shift(round_idx, x)
        plan = self.plan(round_idx)
        res = self.transport.local_work(plan, x, self.c)

        # A non-finite update is dropped (counted, logged), never averaged in: it weighs as a device that did
        # nothing, as does a late one (its steps arrive as 0).
        nonfinite = ~np.isfinite(res.deltas).all(axis=1)
        if res.delta_c is not None:
            nonfinite |= ~np.isfinite(res.delta_c).all(axis=1)
        late = np.zeros(plan.device_ids.size, bool) if res.late is None else res.late
        counted_steps = np.where(nonfinite | late, 0, res.steps)
        active_ids = np.flatnonzero(self.active)
        coeffs = schemes.coefficients(t.weighting, self.cfg.participation.scheme, plan.device_ids,
                                      active_ids, self.n_train, counted_steps, plan.budgets)
        coeffs *= self.dynamics.boost(plan.device_ids, round_idx)  # fast-reboot of arriving devices
        coeffs[counted_steps == 0] = 0.0  # nothing applied: log 0 (Scheme B's w_k would multiply a zero update)
        x = fedavg.server_update(x, plan.device_ids, res.deltas, coeffs, t.lr_global)
        reported = counted_steps > 0
        self.transport.accept(round_idx, plan.device_ids[reported])
        if self.scaffold:
            self.c = scaffold.server_control_update(self.c, plan.device_ids[reported], res.delta_c[reported],
                                                    active_ids.size)

        evaluate, store = self._due(round_idx)
        metrics = self.metrics(self.transport.evaluate(x)) if evaluate else (math.nan,) * 3
        elapsed = time.perf_counter() - wall0
        self.log.append(self._round_row(plan, res, coeffs, nonfinite, late, metrics, elapsed))
        self._stage_and_commit(round_idx, x, plan.device_ids[reported],
                               None if res.delta_c is None else res.delta_c[reported], store, control_sets)
        self.on_round(RoundSummary(round_idx, self.cfg.rounds, *metrics, int(np.count_nonzero(counted_steps)),
                                   int(self.active.sum()), int(nonfinite.sum()), elapsed, int(late.sum()),
                                   int(np.sum(res.steps[~late & ~nonfinite])), int(plan.budgets.sum()),
                                   int(np.count_nonzero(coeffs))))
        return x

    def _stage_and_commit(self, round_idx, x, reported_ids, delta_c, store: bool, control_sets=None) -> None:
        """Resume state, the stored trajectory rows, then the round marker (last)."""
        slots, rows, sets, stored = {"x": x}, None, None, {"trajectory/round": round_idx, "trajectory/x": x}
        if self.scaffold:
            slots["c"] = self.c
            if delta_c is not None:
                rows = {"c_clients": (reported_ids, delta_c)}
            if control_sets is not None:
                sets = {"c_clients": control_sets}
            stored["scaffold/c"] = self.c
        self.log.stage(round_idx, slots, rows, sets)
        if store:
            if self.scaffold and self.cfg.log.client_controls:
                stored["scaffold/c_clients"] = self.log.rows("c_clients")
            self.log.append(stored)
        self.log.commit(round_idx)

    def _round_row(self, plan, res, coeffs, nonfinite, late, metrics, elapsed) -> dict:
        n, ids = self.n_devices, plan.device_ids

        def scatter(values, dtype, fill=0):
            row = np.full(n, fill, dtype=dtype)
            row[ids] = values
            return row

        return {
            "participation/selected": scatter(True, np.bool_, False),
            "participation/active": self.active.copy(),
            "participation/budget": scatter(plan.budgets, np.int32),
            "participation/steps": scatter(res.steps, np.int32),
            "participation/coeff": scatter(coeffs, np.float64),
            "participation/nonfinite": scatter(nonfinite, np.bool_, False),
            "participation/elapsed_s": scatter(res.elapsed_s, np.float32),
            "participation/cpu_percent": scatter(res.cpu_percent, np.float32, np.nan),
            "participation/cpu_freq_mhz": scatter(_or_nan(res.cpu_freq_mhz), np.float32, np.nan),
            "participation/temperature_c": scatter(_or_nan(res.temperature_c), np.float32, np.nan),
            "participation/late": scatter(late, np.bool_, False),
            "participation/compiled": scatter(False if res.compiled is None else res.compiled, np.bool_, False),
            "metrics/lr": plan.lr,
            "metrics/n_applied": int(np.count_nonzero(coeffs)),
            "metrics/round_elapsed_s": elapsed,
            "metrics/train_loss": metrics[0],
            "metrics/test_loss": metrics[1],
            "metrics/test_accuracy": metrics[2],
        }


def _or_nan(values):
    return np.nan if values is None else values
