"""`edgefed export --csv`: a run log as tidy CSV, for pandas and R: one row per round (metrics.csv) and one
per round and device (participation.csv). Rounds are 1-based (round 0, in metrics.csv, is the start)."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from edgefed.analysis.logs import Run
from edgefed.errors import RunLogError

PER_ROUND = ("lr", "n_applied", "round_elapsed_s")  # round rows only (no round 0)
PER_EVAL = ("train_loss", "test_loss", "test_accuracy", "clock_s")  # round 0 too
PER_DEVICE = ("selected", "active", "budget", "steps", "coeff", "late", "nonfinite", "elapsed_s", "cpu_percent",
              "cpu_freq_mhz", "temperature_c", "deadline_s", "comm_s", "core", "compiled")


def _cell(value) -> str:
    if isinstance(value, (bool, np.bool_)):
        return "1" if value else "0"
    if isinstance(value, (float, np.floating)):
        return "" if np.isnan(value) else repr(float(value))
    return str(value)


def export_csv(run: Run, folder: Path) -> list[Path]:
    """Write metrics.csv and participation.csv into folder; returns their paths."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunLogError(f"cannot write CSV into {folder} ({exc}); choose another --csv folder") from None
    metrics = [name for name in PER_EVAL if f"metrics/{name}" in run.data]
    per_round = [name for name in PER_ROUND if f"metrics/{name}" in run.data]
    device_cols = [name for name in PER_DEVICE if f"participation/{name}" in run.data]
    paths = [folder / "metrics.csv", folder / "participation.csv"]
    with open(paths[0], "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["round", *metrics, *per_round])
        for r in range(run.rounds + 1):
            w.writerow([r, *(_cell(run[f"metrics/{m}"][r]) for m in metrics),
                        *(_cell(run[f"metrics/{m}"][r - 1]) if r else "" for m in per_round)])
    with open(paths[1], "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["round", "device", *device_cols])
        columns = [run[f"participation/{name}"] for name in device_cols]
        for r in range(run.rounds):
            for k in range(columns[0].shape[1]):
                w.writerow([r + 1, k, *(_cell(c[r, k]) for c in columns)])
    return paths
