"""What update compression buys in seconds: time to a target test accuracy per kind, with and without error
feedback, for the 2NN and the CNN on MNIST (t10k in data/mnist).

    python benchmarks/compression.py slow-link [--models 2nn cnn] [--seeds 0 1]
    python benchmarks/compression.py measured  [--models 2nn cnn] [--seeds 0 1]    # needs mpiexec

- slow-link: the simulator on the simulated clock of Raspberry Pi 4 boards (hw_profiles/pi4b) behind a
  20 Mbit/s link each ([device] link_mbps, both ways), deadlines that cover the round
  (deadline_covers = "round": the link's time comes out of the computing time). Deterministic.
- measured: each run under `mpiexec -n 3` on this machine (two device ranks, the real wire over shared
  memory), no deadline, the measured clock: what encoding costs where the link is fast.

Each cell is one `edgefed sweep` cell (the grid is written to OUT/<setting>-<model>/sweep.toml, the runs
and cells.csv next to it): the bytes of a report and of a broadcast to one device, the bytes of a round
over all devices, the clock when the target was first reached (mean +- std over the seeds that reached it; in brackets how many did when not all), the steps a
device completed per round, and the final accuracy.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
from edgefed import config as config_mod
from edgefed.orchestration.sweep import read_sweep, row_of
from edgefed.runlog import read_run
from edgefed.runtime.mpi.comm import local_mpiexec, outside_world_env

ROOT = Path(__file__).resolve().parents[1]
MODELS = {  # (model table, train table, rounds, target accuracy, slow-link deadline in seconds)
    "2nn": ('kind = "mlp"\nhidden = [200, 200]', "local_epochs = 1", 20, 0.93, 0.7),
    "cnn": ('kind = "cnn"', "local_steps = 20", 10, 0.9, 6.0),
}
KINDS = [["none", False, "none"], ["fp16", False, "none"], ["fp16", True, "none"], ["int8", False, "none"],
         ["int8", True, "none"], ["topk", False, "none"], ["topk", True, "none"], ["int8", True, "int8"],
         ["topk", True, "int8"]]  # (uplink, error feedback, downlink)
SETTINGS = {
    "slow-link": '[device]\nprofile = "pi4b"\nlink_mbps = [20.0]\n[participation]\nmode = "deadline"\n'
                 'deadline_s = {deadline}\ndeadline_covers = "round"\n',
    "measured": "",
}


def sweep_text(model: str, setting: str, seeds) -> str:
    model_table, steps, rounds, target, deadline = MODELS[model]
    kinds = ", ".join(f'["{k}", {str(f).lower()}, "{d}"]' for k, f, d in KINDS)
    base = (f'rounds = {rounds}\n[data]\nkind = "mnist"\npath = "{ROOT / "data" / "mnist"}"\nclients = 10\n'
            f'partition = "iid"\n[model]\n{model_table}\n[train]\nclients_per_round = 5\n{steps}\nbatch_size = 10\n'
            f'lr_local = {0.1 if model == "2nn" else 0.05}\nweighting = "count_global"\n'
            + SETTINGS[setting].format(deadline=deadline) + '[compress]\ntopk_fraction = 0.01\n')
    return (f'base = "base.toml"\nseeds = {list(seeds)}\n[axes]\n"compress.uplink,compress.error_feedback,compress.downlink" = [{kinds}]\n'
            f'[target]\ntest_accuracy = {target}\n'), base


def run(model: str, setting: str, seeds, out: Path) -> list[dict]:
    folder = out / f"{setting}-{model}"
    folder.mkdir(parents=True, exist_ok=True)
    sweep, base = sweep_text(model, setting, seeds)
    (folder / "sweep.toml").write_text(sweep)
    (folder / "base.toml").write_text(base)
    if setting == "measured":
        rows = run_on_ranks(folder)
    else:
        cmd = [sys.executable, "-m", "edgefed", "sweep", str(folder / "sweep.toml"), "--out", str(folder / "out")]
        subprocess.run(cmd, check=True, env=outside_world_env(), cwd=ROOT)
        with open(folder / "out" / "summary.csv") as f:
            rows = list(csv.DictReader(f))
    for row in rows:  # per device, from its log: the steps a selected one completed, what one sent and got
        log = read_run(folder / "out" / row["log"])
        row["steps"] = float(log["participation/steps"][log["participation/selected"]].mean())
        for way in ("up", "down"):
            sent = log[f"participation/bytes_{way}"]
            row[way] = float(sent[sent > 0].mean())
    return rows


def run_on_ranks(folder: Path) -> list[dict]:
    """The sweep's runs one after another, each under `mpiexec -n 3` (two device ranks: the real wire), into
    the sweep's own log names; their summary rows as `edgefed sweep` writes them."""
    mpiexec = local_mpiexec()
    if mpiexec is None:
        sys.exit("measured needs mpiexec: pip install 'edgefed[mpi]'")
    plan = read_sweep(folder / "sweep.toml")
    out = folder / "out"
    rows = []
    for job in plan.jobs:
        log = out / job.log
        if not log.exists():
            log.parent.mkdir(parents=True, exist_ok=True)
            config = log.with_suffix(".toml")
            config.write_text(config_mod.to_toml(config_mod.config_from_dict(job.raw)))
            subprocess.run([mpiexec, "-n", "3", sys.executable, "-m", "edgefed", "run", str(config), "--out", str(log),
                            "--quiet"], check=True, env=outside_world_env(), cwd=ROOT)
        rows.append(row_of(out, job, plan.target, None))
        print(f"{job.cell}, seed {job.seed}: clock to target {rows[-1]['clock_to_target_s']}", flush=True)
    return rows


def table(model: str, setting: str, rows: list[dict]) -> list[str]:
    _, _, rounds, target, _ = MODELS[model]
    lines = [f"{model}, {setting}: clock to test accuracy {target} (s), {rounds} rounds, 5 of 10 devices a round",
             "", "| uplink | error feedback | downlink | KB per report | KB per broadcast | MB per round, all devices "
             "| clock to target (s) | steps / round | final accuracy |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for kind, feedback, downlink in KINDS:
        mine = [r for r in rows if (r["compress.uplink"], r["compress.error_feedback"], r["compress.downlink"])
                == (kind, str(feedback).lower(), downlink)]
        reached = np.array([float(r["clock_to_target_s"]) for r in mine if r["clock_to_target_s"] != ""])
        reached = reached[np.isfinite(reached)]
        clock = (f"{reached.mean():.1f} ± {reached.std():.1f}" if reached.size else "never") + (
            f" [{reached.size}/{len(mine)}]" if 0 < reached.size < len(mine) else "")
        up, down = np.mean([r["up"] for r in mine]) / 1024, np.mean([r["down"] for r in mine]) / 1024
        total = np.mean([float(r["bytes_up_per_round"]) + float(r["bytes_down_per_round"]) for r in mine]) / 2**20
        steps = np.mean([r["steps"] for r in mine])
        acc = np.array([float(r["final_test_accuracy"]) for r in mine])
        lines.append(f"| {kind} | {'yes' if feedback else 'no'} | {downlink} | {up:.1f} | {down:.1f} | {total:.2f} | {clock} | {steps:.1f} "
                     f"| {acc.mean():.4f} ± {acc.std():.4f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("setting", choices=sorted(SETTINGS))
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-compression")
    args = parser.parse_args()
    if not (ROOT / "data" / "mnist" / "t10k-images-idx3-ubyte.gz").exists():
        sys.exit("put t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz in data/mnist/")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    for model in args.models:
        rows = run(model, args.setting, args.seeds, args.out)
        print("\n".join(table(model, args.setting, rows)) + "\n", flush=True)


if __name__ == "__main__":
    main()
