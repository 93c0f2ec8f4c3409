"""The interface between an engine and a transport: what a round asks of the devices and what comes back.

An engine (engine/) plans and aggregates; a transport (runtime/: in this process, or across MPI ranks)
carries the plan to the devices that host the selected ones and brings their reports back. Neither imports
the other: both speak through the plain arrays below, and an engine drives any object with the methods of
`Transport`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol

import numpy as np

from edgefed.algorithms.base import DeviceRows
from edgefed.ids import find

PROBE_BYTES = 8  # a device's answer when asked for its loss at the server model (power of choice): one float64


@dataclass(frozen=True)
class RoundPlan:
    """Who works this round, how many steps each may take, and with which learning rate."""

    round_idx: int
    device_ids: np.ndarray  # selected devices, ascending
    budgets: np.ndarray  # int32, steps asked of each selected device (K_k)
    lr: float
    steps: np.ndarray | None = None  # int32, the exact steps each device takes (a trace, a simulated deadline)
    deadline_s: np.ndarray | None = None  # (S,) float64, the wall-clock time each device computes for
    grace_s: float = 0.0  # past its round deadline + grace a device's report is late and dropped
    round_deadline_s: np.ndarray | None = None  # (S,) the deadline policy's, by which reports are due
    quorum: int | None = None  # over-selection: the round ends once this many devices completed their budget
    by_arrival: bool = False  # the transport ends the round at the quorum's arrival and stops the others
    down_bytes: int = 0  # what the round's broadcast brings each selected device (for a shaped link's time)
    prescale: np.ndarray | None = None  # secure aggregation: (S,) c_k, each device's factor known before the work
    widths: np.ndarray | None = None  # [submodel]: (S,) float64 each device's width (its slice alone travels);
    # None: the whole model
    down_each: np.ndarray | None = None  # [submodel]: (S,) what the broadcast brings each device (its slice's)

    def down(self) -> np.ndarray | int:
        """What the broadcast brings each device: down_bytes, or each slice's."""
        return self.down_bytes if self.down_each is None else self.down_each

    def steps_to_run(self, i: int) -> int:
        return int(self.budgets[i] if self.steps is None else self.steps[i])


@dataclass(frozen=True)
class LocalResults:
    """What the selected devices report, one row per device in plan order."""

    vectors: Mapping[str, np.ndarray]  # the algorithm's report vectors (Delta x first), (S, d) model dtype
    steps: np.ndarray  # (S,) int32
    elapsed_s: np.ndarray  # (S,) float32
    cpu_percent: np.ndarray  # (S,) float32, NaN where unmeasured
    late: np.ndarray  # (S,) bool: answered after deadline + grace (or never); dropped
    cpu_freq_mhz: np.ndarray  # (S,) float32, NaN where the board does not say
    temperature_c: np.ndarray  # (S,) float32, NaN where the board does not say
    compiled: np.ndarray  # (S,) bool: the work included Numba compilation (a cold cache)
    finish_s: np.ndarray  # (S,) float64: seconds from the round's start to the report (NaN: never came)
    comm_s: np.ndarray  # (S,) float32: of that, what was not local work (links, waiting); NaN: unknown
    core: np.ndarray  # (S,) int16: the core the work ran on (-1: unknown)
    link_s: np.ndarray  # (S,) float32: of comm_s, the links alone (not the wait on the rank); NaN: unknown
    round_s: float = float("nan")  # when the round's last report it takes came (NaN: the caller's wall time)
    bytes_up: np.ndarray | None = None  # (S,) int64: the payload of each report (0: no work sent); None: 0s
    # secure aggregation: the masked inputs (vectors is then empty: no update leaves a device in the clear)
    masked: np.ndarray | None = None  # (S, d + 1) uint{bits}: y_k, the update and its clip count (zeros: none)
    nonfinite: np.ndarray | None = None  # (S,) bool: the device found its update non-finite and sent no y_k
    secagg_s: np.ndarray | None = None  # (S,) float32: the device's protocol time through its masked input
    # what the local steps saw of their losses (Oort's statistical utility): the sum of the squared loss of
    # every sample trained on, and how many (a sample drawn twice counts twice); None: not reported
    loss_sq: np.ndarray | None = None  # (S,) float64
    samples: np.ndarray | None = None  # (S,) int64
    # what the boards' own meters read (runtime/power.py): each device's share of its board's energy in the
    # round, J (NaN: its board has none); None: not read (the simulator)
    energy_read_j: np.ndarray | None = None  # (S,) float64


@dataclass(frozen=True)
class Evaluation:
    """The evaluated devices' evaluation at one server model: a row per device of `ids` (ascending), so that
    evaluating a sample of a large federation moves and holds the sample alone."""

    ids: np.ndarray  # the devices evaluated, ascending
    train_loss: np.ndarray  # F_k(x), mean over the device's training samples
    test_loss_sum: np.ndarray  # summed held-out loss
    test_correct: np.ndarray  # correct held-out predictions (-1: no accuracy, a regression)
    n_test: np.ndarray  # held-out samples

    def rows(self, device_ids: np.ndarray) -> np.ndarray:
        """The rows of these devices (each evaluated)."""
        at, found = find(self.ids, device_ids)
        if not found.all():
            raise ValueError("the evaluation lacks some of the devices asked for")
        return at


class Transport(Protocol):
    """What an engine calls; `state` is the algorithm's ServerState (x and the vectors sent with it)."""

    def local_work(self, plan: RoundPlan, state, downlink=None) -> LocalResults:
        """Run the plan on the devices hosting the selected ones. state: what the devices hold (with a
        compressed downlink, their copy once this round's `downlink` {name: Encoded} difference is added)."""

    def residuals(self, round_idx: int, device_ids: np.ndarray) -> dict[str, np.ndarray]:
        """The error-feedback residuals these devices' reports of round_idx leave them (rows in their order),
        before `accept` applies them."""

    def accept(self, round_idx: int, device_ids: np.ndarray) -> None:
        """These devices' reports of round_idx were applied: they update their own vectors."""

    def secagg_keys(self, plan: RoundPlan) -> np.ndarray:
        """Secure aggregation, phase 1: every selected device's KEYS record (ascending device id)."""

    def secagg_shares(self, round_idx: int, keys: np.ndarray) -> np.ndarray:
        """Phase 2: every selected device's sealed SHARE records, given every device's keys."""

    def secagg_deliver(self, round_idx: int, shares: np.ndarray) -> None:
        """Phase 3: each sealed share to the device it is addressed to."""

    def secagg_reveal(self, round_idx: int, survivors: np.ndarray) -> np.ndarray:
        """Phase 5 (after the masked inputs): the survivors' REVEAL records."""

    def probe(self, round_idx: int, x: np.ndarray, device_ids: np.ndarray) -> np.ndarray:
        """These devices' training losses F_k(x) (ascending ids in, a float64 each out), each computed by the
        device itself: a selection policy's candidates (power of choice)."""

    def evaluate(self, x: np.ndarray) -> Evaluation:
        """The evaluated devices' train losses and held-out counts at x, a row each (ids ascending)."""

    def start_devices(self, x: np.ndarray, device_ids: np.ndarray) -> dict[str, np.ndarray]:
        """Fresh device vectors for these devices (joining at x); returns their rows, in their order."""

    def load_devices(self, rows: Mapping[str, DeviceRows]) -> None:
        """Restore the devices' vectors and residuals, e.g. on --resume: the stored rows (DeviceRows over the
        federation); every other device's are zero."""

    def peak_rss(self) -> dict[int, int]:
        """{rank: its peak resident memory, bytes} of the other processes that host devices (none in one
        process: the caller's own is its own peak)."""

    def close(self, failed: bool = False) -> None:
        """End the devices' work (and, under MPI, the device ranks)."""
