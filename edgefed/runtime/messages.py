"""What the engine and a transport exchange each round: plain arrays, nothing that needs pickling."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RoundPlan:
    """Who works this round, how many steps each may take, and with which learning rate."""

    round_idx: int
    device_ids: np.ndarray  # selected devices, ascending
    budgets: np.ndarray  # int32, steps asked of each selected device
    lr: float


@dataclass(frozen=True)
class LocalResults:
    """What the selected devices report, one row per device in plan order."""

    deltas: np.ndarray  # (S, d) model dtype: y_{k,s_k} - x
    steps: np.ndarray  # (S,) int32
    elapsed_s: np.ndarray  # (S,) float32
    cpu_percent: np.ndarray  # (S,) float32, NaN where unmeasured
    delta_c: np.ndarray | None = None  # (S, d) SCAFFOLD's Delta c_k; None for FedAvg


@dataclass(frozen=True)
class Evaluation:
    """Per-device evaluation at one server model, indexed by device id."""

    train_loss: np.ndarray  # (N,) F_k(x), mean over the device's training samples
    test_loss_sum: np.ndarray  # (N,) summed held-out loss
    test_correct: np.ndarray  # (N,) correct held-out predictions
    n_test: np.ndarray  # (N,) held-out samples
