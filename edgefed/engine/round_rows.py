"""A round's row in the run log, as the engine writes it: each per-device dataset as the round's devices'
values (runlog.Scattered: a large federation's log writes those alone), the bytes that travelled each way,
the energy the boards spent, and what a selection policy considered.

A mixin of RoundEngine: it reads the engine's round (its plan, results, clock, membership and policy) and
computes nothing the round goes on to use.
"""

from __future__ import annotations

import numpy as np

from edgefed.participation.traces import ReplayTrace
from edgefed.runlog import Scattered
from edgefed.transport import PROBE_BYTES, RoundPlan


class RoundRows:
    def _considered_row(self, round_idx: int) -> dict:
        """The log's /participation/candidate and /utility rows: the policy's, or a replay's recorded ones."""
        if not self.considered:
            return {}
        candidate, utility = np.zeros(self.n_devices, bool), np.full(self.n_devices, np.nan)
        if self._choice is not None:
            candidate[self._choice.candidates] = True
            utility[self._choice.candidates] = self._choice.utility
        elif isinstance(self.trace, ReplayTrace) and self.trace.candidate is not None:
            candidate, utility = self.trace.candidate[round_idx - 1], self.trace.utility[round_idx - 1]
        return {"participation/candidate": candidate, "participation/utility": utility}

    def _bytes_down(self, plan: RoundPlan) -> np.ndarray:
        """The broadcast's bytes each device received: the selected ones the model; with a compressed
        downlink every member the difference (each keeps the copy it adds to), and an arriving device the
        whole copy (x_0, which every device builds from the seed, is never sent)."""
        if not self._probes_sent() and not self.downlink.lossy:  # ([submodel]'s: each its slice)
            return Scattered(self.n_devices, plan.device_ids, plan.down(), 0)
        row = self._probe_bytes(0)
        if not self.downlink.lossy:
            row[plan.device_ids] += plan.down()
            return row
        row[self.active] += plan.down_bytes
        if self.members.shifts:
            x = self.state.x
            row[self.members.arriving] = (1 + len(self.algorithm.server_vectors)) * x.size * x.itemsize
        return row

    def _probes_sent(self) -> bool:
        """Whether the row's bytes hold probes (else they are the round's devices' alone)."""
        return self._probed is not None

    def _probe_bytes(self, up: int) -> np.ndarray:
        """What asking for the candidates' losses moved (power of choice): x, whole, down to each candidate
        (up = 0), or a float64 loss up from each that answered."""
        row = np.zeros(self.n_devices, np.int64)
        if self._probed is not None:
            asked, _, answered = self._probed
            row[answered if up else asked] = PROBE_BYTES if up else self.state.x.nbytes
        return row

    def _bytes_up(self, plan: RoundPlan, res) -> np.ndarray:
        """Each report's payload, and each candidate's loss."""
        payload = 0 if res.bytes_up is None else res.bytes_up
        if not self._probes_sent():
            return Scattered(self.n_devices, plan.device_ids, payload, 0)
        row = self._probe_bytes(1)
        row[plan.device_ids] += payload
        return row

    def _energy_row(self, round_idx: int, ids: np.ndarray, busy_s: np.ndarray, held_s, shared: bool = True,
                    read_j: np.ndarray | None = None) -> dict:
        """The devices' energy in the round (docs/design.md 2.21), where the boards' power is known; a replay
        logs the recorded energy. shared: a board's idle power over the round is split among its devices
        (FedBuff: each report's task holds its board alone). read_j: what the boards' own meters read, beside
        it (a measured run under mpiexec)."""
        power = self.timing.power
        if power is None:
            return {}
        recorded = self.clock.recorded_energy(round_idx, ids)
        joules = power.joules(ids, busy_s, held_s, shared) if recorded is None else recorded
        out = {"participation/energy_j": Scattered(self.n_devices, ids, joules, np.nan)}
        if self.timing.reads_energy:
            out["participation/energy_read_j"] = Scattered(self.n_devices, ids, np.nan if read_j is None else read_j,
                                                           np.nan)
        return out

    def _round_row(self, plan, res, settled, coeffs, nonfinite, metrics, elapsed, clock, held_s=None) -> dict:
        """held_s: the seconds the round held each device's board (None: the round's length)."""
        n, ids = self.n_devices, plan.device_ids

        def scatter(values, fill=0):  # (a large federation's log writes the round's devices alone)
            return Scattered(n, ids, values, fill)

        raced = plan.deadline_s is not None  # the core matters where the work raced a wall clock
        return {
            "participation/selected": scatter(True, False),
            "participation/active": Scattered(n, self.federation.absent, False, True),
            "participation/budget": scatter(plan.budgets),
            "participation/steps": scatter(settled.steps),
            "participation/coeff": scatter(coeffs),
            "participation/nonfinite": scatter(nonfinite, False),
            "participation/elapsed_s": scatter(res.elapsed_s),
            "participation/cpu_percent": scatter(res.cpu_percent, np.nan),
            "participation/cpu_freq_mhz": scatter(res.cpu_freq_mhz, np.nan),
            "participation/temperature_c": scatter(res.temperature_c, np.nan),
            "participation/late": scatter(settled.late, False),
            "participation/compiled": scatter(res.compiled, False),
            "participation/deadline_s": scatter(np.nan if plan.round_deadline_s is None else plan.round_deadline_s,
                                                np.nan),
            "participation/comm_s": scatter(self.clock.comm_log(plan.round_idx, ids, settled), np.nan),
            "participation/core": scatter(res.core if raced else -1, -1),
            "participation/bytes_up": self._bytes_up(plan, res),
            "participation/bytes_down": self._bytes_down(plan),
            **self._considered_row(plan.round_idx),
            **({} if plan.widths is None else {"participation/width": scatter(plan.widths, np.nan)}),
            **self._energy_row(plan.round_idx, ids, settled.busy_s, self.clock.round_s if held_s is None else held_s,
                               held_s is None, res.energy_read_j),
            "metrics/lr": plan.lr,
            "metrics/n_applied": int(np.count_nonzero(coeffs)),
            "metrics/round_elapsed_s": elapsed,
            "metrics/train_loss": metrics[0],
            "metrics/test_loss": metrics[1],
            "metrics/test_accuracy": metrics[2],
            "metrics/clock_s": clock,
        }
