"""Arrivals and departures (Ruan et al., docs/design.md 2.6-2.7): who is in the federation, and objective shifts.

A device that arrives in round r0 is outside the federation before r0 (never selected, not in the
objective) and inside from r0 on; its arrival shifts the objective: weights renormalize over the new
federation and the staircase learning rate restarts (r_shift = r0 - 1). With fast-reboot its coefficient
is multiplied by 1 + (b - 1) / (r - r0 + 1)^2: b at arrival, decaying as O(r^-2).
A device that departs in round r1 is gone from r1 on: with `exclude` it leaves the federation (an objective
shift, like an arrival); with `include` it stays in the objective and may still be selected, but it never
reports again (its steps are 0).
A device whose board is away ([[mpi.away]]: `edgefed launch` left the board out from `round` until it was
taken `back`) is silent like a departed `include` device over those rounds: in the objective, selectable,
reporting nothing, its state kept. Its return is no objective shift; with fast-reboot its coefficient is
boosted from its round back r_b as an arrival's is, 1 + (b - 1) / (r - r_b + 1)^2 (the latest of its
arrival and its returns counts).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from edgefed.errors import ConfigError


@dataclass(frozen=True)
class Membership:
    """Who is in the federation in one round, computed once at its top (Dynamics.at)."""

    active: np.ndarray  # (N,) bool: in the objective
    silent: np.ndarray  # (N,) bool: in the objective, never reporting again (departed with `include`)
    shift_round: int  # r_shift: the round before the last objective shift at or before this one (0: none)
    shifts: bool  # the objective shifts this round
    arriving: np.ndarray  # the devices arriving this round, ascending
    boosted: dict  # {device: its fast-reboot multiplier this round}

    def boost(self, device_ids: np.ndarray) -> np.ndarray:
        """Fast-reboot multipliers of the given devices (1 where none applies)."""
        out = np.ones(len(device_ids))
        if self.boosted:
            for i, k in enumerate(device_ids):
                out[i] = self.boosted.get(int(k), 1.0)
        return out


class Dynamics:
    def __init__(self, cfg, n_devices: int, away=()):
        """cfg: the [dynamics] table (arrive, depart, fast_reboot, boost); away: [[mpi.away]]."""
        self.cfg = cfg
        self.n = n_devices
        self.away = [(np.asarray(e.devices, np.int64), e.round, e.back) for e in away]
        for i, (devices, _, _) in enumerate(self.away):
            if devices.size and devices.max() >= n_devices:
                raise ConfigError(f"config: mpi.away[{i}].devices holds {devices.max()}, but the federation has "
                                  f"{n_devices} devices (0..{n_devices - 1})")
        self.arrival = {e.device: e.round for e in cfg.arrive}
        self.departure = {e.device: (e.round, e.policy) for e in cfg.depart}
        shifts = [r for r in self.arrival.values()]
        shifts += [r for r, policy in self.departure.values() if policy == "exclude"]
        self._shifts = sorted(set(shifts))
        # the rounds the masks change in: between two of them a round's masks are the last one's, the same
        # arrays (so what is computed once per federation stays computed: engine.rounds' Federation)
        changes = set(shifts) | {r for r, _ in self.departure.values()}
        changes |= {r for _, start, back in self.away for r in (start, back) if r is not None}
        self._changes = sorted(changes)
        self._masks = (None, None, None)  # (its epoch, active, silent)

    def at(self, round_idx: int) -> Membership:
        """The federation in round round_idx; round 0 is the start."""
        boosted = {}
        if self.cfg.fast_reboot:
            b = self.cfg.boost
            boosted = {k: 1.0 + (b - 1.0) / (round_idx - r0 + 1) ** 2
                       for k, r0 in self.rebooted(round_idx).items()}
        epoch = bisect.bisect_right(self._changes, round_idx)
        if self._masks[0] != epoch:
            active, silent = self.active(round_idx), self.silent(round_idx)
            active.setflags(write=False)  # shared by the epoch's rounds
            silent.setflags(write=False)
            self._masks = (epoch, active, silent)
        return Membership(self._masks[1], self._masks[2], self.shift_round(round_idx),
                          round_idx in self._shifts, self.arriving(round_idx), boosted)

    def active(self, round_idx: int) -> np.ndarray:
        """Membership of the federation (the objective) in round round_idx; round 0 is the start."""
        mask = np.ones(self.n, dtype=bool)
        for k, r0 in self.arrival.items():
            mask[k] = round_idx >= r0  # arrival rounds are >= 1, so round 0 has none of them
        for k, (r1, policy) in self.departure.items():
            if policy == "exclude" and round_idx >= r1:
                mask[k] = False
        return mask

    def silent(self, round_idx: int) -> np.ndarray:
        """Devices in the objective that report nothing this round (departed with `include`, or away)."""
        mask = np.zeros(self.n, dtype=bool)
        for k, (r1, policy) in self.departure.items():
            mask[k] = policy == "include" and round_idx >= r1
        for devices, start, back in self.away:
            if start <= round_idx and (back is None or round_idx < back):
                mask[devices] = True
        return mask

    def rebooted(self, round_idx: int) -> dict:
        """{device: the round it last arrived or came back in, at or before round_idx}."""
        start = {k: r0 for k, r0 in self.arrival.items() if round_idx >= r0}
        for devices, _, back in self.away:
            if back is not None and back <= round_idx:
                for k in devices.tolist():
                    start[k] = max(start.get(k, 0), back)
        return start

    def shift_round(self, round_idx: int) -> int:
        """r_shift: the round before the last objective shift at or before round_idx (0 without one)."""
        before = [r for r in self._shifts if r <= round_idx]
        return before[-1] - 1 if before else 0

    def arriving(self, round_idx: int) -> np.ndarray:
        return np.array(sorted(k for k, r0 in self.arrival.items() if r0 == round_idx), dtype=np.int64)
