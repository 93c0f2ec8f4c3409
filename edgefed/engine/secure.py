"""The server's side of secure aggregation in a round: relay the keys and the sealed shares, then from the
survivors' masked inputs and revealed shares the one sum the round applies (docs/design.md 2.15).

The engine holds no device's update: the transport brings masked inputs (words of Z_2^bits that look
random), the metadata the rules need (steps, late, non-finite as the device says), and the protocol's
messages. Which devices survive is the engine's call, as in a plain round: on time, finite, with work.
"""

from __future__ import annotations

import math

import numpy as np

from edgefed.algorithms.base import DELTA_X, RoundReports
from edgefed.errors import Unrecoverable
from edgefed.participation import schemes
from edgefed.secagg import protocol
from edgefed.transport import LocalResults, RoundPlan


class SecureSum:
    """One run's server side: a round's setup and keys from `begin` to `reports`."""

    def __init__(self, cfg, dim: int, transport, n_devices: int, submodels=None):
        """submodels: [submodel] as run (participation.submodels.Submodels): each coordinate is summed among the
        devices whose slice holds it, and scaled by its width's factor."""
        self.cfg, self.dim, self.transport, self.n_devices = cfg, dim, transport, n_devices
        self.submodels = submodels
        self.positions = None if submodels is None else submodels.positions
        self.setup = None
        self.keys = None
        self.alone = None  # [submodel]: the width whose coordinates one survivor held, aborting the round
        self._row = {}  # device -> its row in the round's plan
        self._sent = None  # (S,) bytes each selected device sent for the protocol so far this round

    def begin(self, plan: RoundPlan) -> None:
        """Phases 1-3 before the work: every selected device's keys out and relayed, its sealed shares out and
        relayed to their holders."""
        s = self.cfg.secagg
        self.setup = protocol.round_setup(self.cfg.seed, plan.round_idx, plan.device_ids, s.neighbours, s.threshold,
                                          s.bits, s.clip, self.dim,
                                          protocol.slices_of(self.positions, plan.device_ids, plan.widths))
        self.keys = self.transport.secagg_keys(plan)
        shares = self.transport.secagg_shares(plan.round_idx, self.keys)
        self.transport.secagg_deliver(plan.round_idx, shares)
        self._row = {int(k): i for i, k in enumerate(plan.device_ids)}
        self._sent = np.full(plan.device_ids.size, protocol.KEYS.itemsize, np.int64)
        np.add.at(self._sent, self._rows(shares["sender"]), protocol.SHARE.itemsize)

    def reports(self, plan: RoundPlan, res: LocalResults, coeffs: np.ndarray, reported: np.ndarray,
                counted_steps: np.ndarray, lr_global: float, n_federation: int, levels: np.ndarray | None = None):
        """(RoundReports of the one sum, the round's secagg columns, why the round was aborted or None).
        levels: [submodel]'s, the coefficients of each width's coordinates: the sum then comes as a row a width,
        its own coordinates, each with G over that width's holders (a coordinate's sum holds theirs alone)."""
        survivors = plan.device_ids[reported]
        spent = res.secagg_s.astype(np.float64)  # NaN where the device's report never came
        if levels is None:  # one group: every coordinate, summed over the survivors
            groups = [(coeffs, slice(None), reported)]
        else:
            groups = [(row, coords, reported & (plan.widths >= width))
                      for row, coords, width in zip(levels, self.submodels.levels, self.submodels.widths)]
        rows, g, aborted, clipped = np.zeros((len(groups), self.dim)), np.zeros(len(groups)), None, 0
        self.alone = alone = self._alone(plan, reported) if levels is not None else None
        if alone is not None:  # Bonawitz et al.'s rule, a width at a time: a sum of one would show its update
            aborted = (f"secure aggregation, round {plan.round_idx}: width {alone}'s coordinates have one surviving "
                       "holder, whose sum would show its update; the round is aborted")
        elif survivors.size:
            total = np.zeros(self.setup.words, self.setup.word)
            for i in np.flatnonzero(reported):
                total += res.masked[i]
            reveals = self.transport.secagg_reveal(plan.round_idx, survivors)
            np.add.at(self._sent, self._rows(reveals["holder"]), protocol.REVEAL.itemsize)
            holders, first = np.unique(reveals["holder"], return_index=True)
            spent[self._rows(holders)] += reveals["spent_s"][first]
            try:
                summed = protocol.unmask(self.setup, self.keys, total, survivors, reveals)
            except Unrecoverable as exc:
                aborted = str(exc)
            else:
                decoded, clipped = protocol.decode(self.setup, summed)
                factors = np.zeros(plan.device_ids.size)
                factors[reported] = schemes.device_factors(self.cfg.participation.scheme, plan.prescale[reported],
                                                           counted_steps[reported], plan.budgets[reported])
                for j, (row, coords, holders) in enumerate(groups):
                    rows[j, coords] = decoded[coords]
                    if holders.any():
                        g[j] = schemes.server_factor(row[holders], factors[holders])
        applied = RoundReports(np.zeros(len(groups), np.int64), {DELTA_X: rows}, g, g != 0.0, lr_global, n_federation)
        columns = {"participation/secagg_s": self._scatter(plan, spent.astype(np.float32), np.float32, math.nan),
                   "participation/secagg_bytes": self._scatter(plan, self._sent, np.int64, 0),
                   "metrics/secagg_clipped": clipped, "metrics/secagg_aborted": aborted is not None}
        return applied, columns, aborted

    def _alone(self, plan: RoundPlan, reported: np.ndarray) -> float | None:
        """[submodel]: the narrowest width whose own coordinates exactly one surviving device holds (None: none)."""
        for width, coords in zip(self.submodels.widths, self.submodels.levels):
            if coords.size and np.count_nonzero(reported & (plan.widths >= width)) == 1:
                return width
        return None

    def _rows(self, devices) -> list[int]:
        return [self._row[int(k)] for k in devices]

    def _scatter(self, plan, values, dtype, fill):
        row = np.full(self.n_devices, fill, dtype)
        row[plan.device_ids] = values
        return row
