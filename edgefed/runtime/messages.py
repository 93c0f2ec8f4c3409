"""What the engine and a transport exchange each round: plain arrays, nothing that needs pickling."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RoundPlan:
    """Who works this round, how many steps each may take, and with which learning rate."""

    round_idx: int
    device_ids: np.ndarray  # selected devices, ascending
    budgets: np.ndarray  # int32, steps asked of each selected device (K_k)
    lr: float
    steps: np.ndarray | None = None  # trace mode: int32, the exact steps each device takes
    deadline_s: np.ndarray | None = None  # deadline mode: (S,) float64, each device's wall-clock budget
    grace_s: float = 0.0  # past deadline + grace a device's report is late and dropped

    def steps_to_run(self, i: int) -> int:
        return int(self.budgets[i] if self.steps is None else self.steps[i])


@dataclass(frozen=True)
class LocalResults:
    """What the selected devices report, one row per device in plan order."""

    deltas: np.ndarray  # (S, d) model dtype: y_{k,s_k} - x
    steps: np.ndarray  # (S,) int32
    elapsed_s: np.ndarray  # (S,) float32
    cpu_percent: np.ndarray  # (S,) float32, NaN where unmeasured
    delta_c: np.ndarray | None = None  # (S, d) SCAFFOLD's Delta c_k; None for FedAvg
    late: np.ndarray | None = None  # (S,) bool: answered after deadline + grace (or never); dropped
    cpu_freq_mhz: np.ndarray | None = None  # (S,) float32, NaN where the board does not say
    temperature_c: np.ndarray | None = None  # (S,) float32, NaN where the board does not say
    compiled: np.ndarray | None = None  # (S,) bool: the work included Numba compilation (a cold cache)


@dataclass(frozen=True)
class Evaluation:
    """Per-device evaluation at one server model, indexed by device id."""

    train_loss: np.ndarray  # (N,) F_k(x), mean over the device's training samples
    test_loss_sum: np.ndarray  # (N,) summed held-out loss
    test_correct: np.ndarray  # (N,) correct held-out predictions
    n_test: np.ndarray  # (N,) held-out samples
