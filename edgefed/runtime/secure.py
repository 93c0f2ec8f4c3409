"""The hosted devices' side of secure aggregation: one protocol Client per selected device and round, and
the masked input that replaces a device's report (docs/design.md 2.15).

A device scales its own update by what it knows of itself (its prescale and its steps), clips and encodes
it, adds its masks and sends only that; a non-finite update is not sent at all (the device says so, and
counts as a dropout the survivors' shares unmask). The update itself never leaves the device.
"""

from __future__ import annotations

import numpy as np

from edgefed.participation import privacy, schemes
from edgefed.secagg import protocol


class SecureDevices:
    def __init__(self, settings, seed: int, scheme: str, dim: int, hosted: np.ndarray, private=None,
                 positions: dict | None = None):
        """settings: the run's [secagg] table; hosted: the device ids this process hosts; private: the
        [privacy] table when each device clips its scaled update and adds its share of the noise; positions:
        [submodel]'s, each width's positions in the whole vector (a device masks its slice alone)."""
        self.settings, self.seed, self.scheme, self.dim, self.private = settings, seed, scheme, dim, private
        self.positions = positions
        self.hosted = set(int(k) for k in hosted)
        # (round, {device: Client}) of the current round, replaced as one: a late device's worker still on an
        # older round must never see the new round's clients
        self._current = (None, {})

    def keys(self, round_idx: int, selected: np.ndarray, widths: np.ndarray | None = None) -> np.ndarray:
        """Phase 1: new clients for the hosted ones of the round's selected devices, their KEYS records;
        widths: [submodel]'s, each selected device's (None: the whole model)."""
        s = self.settings
        setup = protocol.round_setup(self.seed, round_idx, selected, s.neighbours, s.threshold, s.bits, s.clip,
                                     self.dim, protocol.slices_of(self.positions, selected, widths))
        clients = {int(k): protocol.Client(setup, k, protocol.Randomness(s.key_source, self.seed, round_idx, int(k)))
                   for k in setup.selected if int(k) in self.hosted}
        self._current = (round_idx, clients)
        return self._records([c.advertise() for c in clients.values()], protocol.KEYS)

    def shares(self, round_idx: int, keys: np.ndarray) -> np.ndarray:
        return self._records([c.share(keys) for c in self._of(round_idx)], protocol.SHARE)

    def deliver(self, round_idx: int, shares: np.ndarray) -> None:
        for c in self._of(round_idx):
            c.receive(shares)

    def reveal(self, round_idx: int, survivors: np.ndarray) -> np.ndarray:
        alive = set(int(k) for k in survivors)
        return self._records([c.reveal(survivors) for c in self._of(round_idx) if c.device in alive], protocol.REVEAL)

    def client(self, round_idx: int, device: int) -> protocol.Client | None:
        """The device's client of round_idx; None once a later round has begun (its work cannot be sent)."""
        current, clients = self._current
        return clients.get(device) if current == round_idx else None

    def mask(self, client: protocol.Client, update: np.ndarray, prescale: float, steps: int, budget: int):
        """y: the device's update scaled by a_k, clipped, encoded and masked (with its count of clipped
        coordinates, masked too)."""
        a = schemes.device_factors(self.scheme, np.array([prescale]), np.array([steps]), np.array([budget]))[0]
        if self.private is None:
            return client.masked_input(update, a)
        # distributed differential privacy (docs/design.md 2.19): a_k Delta_k clipped to C, plus N(0, z^2 C^2 / t)
        # from this device's own stream, so any t survivors (the fewest that unmask) carry the central noise
        p = self.private
        scaled, _ = privacy.clip(update[None, :].astype(np.float64), np.array([a]), p.clip)
        noise = privacy.gaussian(self.seed, client.setup.round_idx, update.size,
                                 p.noise_multiplier * p.clip / np.sqrt(client.setup.threshold), p.noise_source,
                                 client.device)
        return client.masked_input((a * scaled[0] + noise).astype(update.dtype), 1.0)

    def _of(self, round_idx: int):
        current, clients = self._current
        return list(clients.values()) if current == round_idx else []

    @staticmethod
    def _records(parts, dtype) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype)
