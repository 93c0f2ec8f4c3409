"""Energy to accuracy beside time to accuracy: examples/sweeps/energy.toml's rules for stragglers (Schemes
A, B, C, FedNova, drop-stragglers, FedBuff) on one simulated Pi 4B cluster, ranked both ways, with the share
of each run's energy its busy cores drew (the rest: the boards' idle power over the time they were held).

    python benchmarks/energy_ranking.py runs/energy benchmarks/figures/energy-vs-time.png

The sweep is run into the folder first when it is not there yet (`edgefed sweep` skips what is done).
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import numpy as np

from edgefed import hwprofile
from edgefed.analysis.figures import energy
from edgefed.analysis.logs import Run
from edgefed.orchestration.sweep import run_sweep

SWEEP = Path(__file__).resolve().parents[1] / "examples" / "sweeps" / "energy.toml"


def label(row: dict) -> str:
    if row["participation.mode"] == "async":
        return f"FedBuff, M = {row['async.buffer']}"
    return {"fednova": "FedNova", "drop": "drop-stragglers"}.get(row["participation.scheme"],
                                                               f"Scheme {row['participation.scheme']}")


def busy_share(run: Run, power) -> float:
    """The share of a run's energy its busy cores drew. A round charges its boards' idle power over its whole
    length (E less that is the busy part); a FedBuff task holds its board only while it computes (no links
    here), so its share is busy / (busy + idle) watts."""
    if "participation/staleness" in run.data:
        return power.busy_w_per_core / (power.busy_w_per_core + power.idle_w)
    joules = run["participation/energy_j"]
    worked = run["participation/selected"] & (joules > 0)
    idle = float((worked.sum(axis=1) * np.diff(run.clock)).sum()) * power.idle_w
    spent = float(np.nansum(joules))
    return (spent - idle) / spent


def main() -> None:
    folder, out = Path(sys.argv[1]), Path(sys.argv[2])
    if not (folder / "summary.csv").is_file():
        assert run_sweep(SWEEP, folder, on_line=lambda line: None) == 0
    with open(folder / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    with open(folder / "cells.csv") as f:
        cells = {row["cell"]: row for row in csv.DictReader(f)}
    series, share = {}, {}
    power = hwprofile.load_profile("pi4b").power
    for row in rows:
        run = Run.read(folder / row["log"])
        series.setdefault(label(row), []).append(run)
        share.setdefault(label(row), []).append(busy_share(run, power))
    names = {label(next(r for r in rows if r["cell"] == cell)): c for cell, c in cells.items()}

    def key(name: str, figure: str) -> float:
        value = names[name][f"{figure}_mean"]
        return float(value) if value else math.inf

    by_energy = sorted(names, key=lambda n: key(n, "energy_to_target_j"))
    by_time = sorted(names, key=lambda n: key(n, "clock_to_target_s"))
    print("| rule | energy to target (J) | rank | seconds to target | rank | reached | final accuracy | "
          "J in all | J a second | busy cores' share |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in by_energy:
        c = names[name]

        def cell(figure, spec):
            mean = c[f"{figure}_mean"]
            return "never" if not mean else f"{float(mean):{spec}} ± {float(c[f'{figure}_std']):{spec}}"

        reached = f"{c['energy_to_target_j_reached']}/{c['seeds']}"
        rank_e = by_energy.index(name) + 1 if c["energy_to_target_j_mean"] else "-"
        rank_t = by_time.index(name) + 1 if c["clock_to_target_s_mean"] else "-"
        per_s = float(c["energy_j_mean"]) / float(c["clock_s_mean"])
        busy = float(np.mean(share[name]))
        print(f"| {name} | {cell('energy_to_target_j', '.2f')} | {rank_e} | {cell('clock_to_target_s', '.3f')} | "
              f"{rank_t} | {reached} | {float(c['final_test_accuracy_mean']):.4f} | {float(c['energy_j_mean']):.2f} | "
              f"{per_s:.2f} | {busy:.1%} |")
    fig = energy(list(series.items()), "Energy and time to accuracy: rules for stragglers on a simulated Pi 4B cluster")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
