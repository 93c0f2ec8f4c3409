"""The figure of client selection: test accuracy and train loss against rounds and against the
federation's clock, one line per policy (with the rule given, Scheme C by default), from the sweep of
examples/sweeps/selection.toml.

    edgefed sweep examples/sweeps/selection.toml --out runs/selection
    python benchmarks/selection_figure.py runs/selection benchmarks/figures/selection.png [--scheme C]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from edgefed.analysis.logs import Run
from edgefed.analysis.figures import curves

NAMES = {"uniform": "uniform", "fedcs": "FedCS", "oort": "Oort", "power_of_choice": "power of choice"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--scheme", default="C")
    args = parser.parse_args()
    with open(args.sweep / "summary.csv") as f:
        rows = [row for row in csv.DictReader(f) if row["participation.scheme"] == args.scheme]
    series = {}
    for row in rows:
        series.setdefault(NAMES[row["selection.policy"]], []).append(Run.read(args.sweep / row["log"]))
    fig = curves(list(series.items()), f"Who takes part: four selection policies, Scheme {args.scheme} "
                                       "(simulated Pi 4 cluster, 1.5x deadlines, 3 seeds)")
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
