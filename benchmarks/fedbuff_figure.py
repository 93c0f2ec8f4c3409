"""The figure of FedBuff beside a fixed deadline: test accuracy and train loss against rounds (server
updates) and against the federation's clock, one line per cell of examples/sweeps/fedbuff.toml.

    edgefed sweep examples/sweeps/fedbuff.toml --out runs/fedbuff
    python benchmarks/fedbuff_figure.py runs/fedbuff benchmarks/figures/fedbuff-vs-deadline.png
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from edgefed.analysis.logs import Run
from edgefed.analysis.figures import curves


def label(row: dict) -> str:
    if row["participation.mode"] == "deadline":
        return f"rounds of 10, {float(row['participation.deadline_s']) * 1e3:g} ms deadline, Scheme B"
    return f"FedBuff, C = 10, M = {row['async.buffer']}"


def main() -> None:
    folder, out = Path(sys.argv[1]), Path(sys.argv[2])
    with open(folder / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    series = {}
    for row in rows:
        series.setdefault(label(row), []).append(Run.read(folder / row["log"]))
    fig = curves(list(series.items()), "FedBuff beside a fixed deadline (simulated cluster, 1,000 reports)")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
