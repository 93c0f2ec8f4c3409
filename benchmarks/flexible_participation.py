"""The shape of the flexible-participation paper's experiments (Ruan et al.), on SYNTHETIC with logistic regression.

The grids themselves are shipped sweeps (examples/sweeps/); this script runs them when their folder is not
there yet (`edgefed sweep` skips what is done) and computes what a sweep table does not hold:

    python benchmarks/flexible_participation.py schemes    [--sweep runs/schemes-mnist-2nn]  # (1) as Table 3
    python benchmarks/flexible_participation.py reboot     [--sweep runs/fast-reboot]  # (2) rounds to recover
    python benchmarks/flexible_participation.py departure  [--sweep runs/departure]    # (3) include vs exclude
    python benchmarks/flexible_participation.py rules      [--seeds 0 1 2] # (4) A/B/C, FedNova, drop, FedProx
    python benchmarks/flexible_participation.py inconsistency              # (5) where each rule's rounds stop

(1), Schemes A/B/C as the traces grow, is the sweep alone (examples/sweeps/schemes-synthetic.toml and
schemes-mnist-2nn.toml); `schemes` only lays its cells.csv out as the paper's table. (4) stays a script: FedProx's mu is a key only FedProx
takes, so its rows are not one grid with the schemes'.

Common setting (the paper's): staircase learning rate eta_0 / r with eta_0 = 1, batch 20, count weights
p_k = n_k / n, every device of the federation works every round, K = 20 local steps, and each device's
completed steps drawn every round from one of edgefed's built-in measured traces (edgefed trace show builtin).
"""

from __future__ import annotations

import argparse
import csv
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

from edgefed import config as config_mod
from edgefed.analysis.logs import Run
from edgefed.orchestration import run as runs
from edgefed.orchestration.sweep import run_sweep
from edgefed.runlog import read_run

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "sweeps"

COMMON = ['train.clients_per_round="all"', "train.local_steps=20", "train.batch_size=20", "train.lr_local=1.0",
          'train.lr_schedule="staircase"', 'train.weighting="count_global"', 'participation.mode="trace"']
DATASETS = {"SYNTHETIC(1,1)": ["data.alpha=1.0", "data.beta=1.0"], "SYNTHETIC(0,0)": ["data.alpha=0.0", "data.beta=0.0"]}


def run(overrides, folder: Path, name: str) -> dict:
    cfg = config_mod.load_config(None, COMMON + overrides)
    path = folder / f"{name}.h5"
    runs.run(cfg, path, force=True)
    return read_run(path)


def rounds_to_recover(acc: np.ndarray, arrival: int):
    """Rounds after the arrival until test accuracy is back at its level just before it (None: never)."""
    before = acc[arrival - 1]
    later = np.flatnonzero(acc[arrival:] >= before)
    return int(later[0]) if later.size else None


def swept(name: str, folder: Path | None) -> list[tuple[Run, dict]]:
    """The runs of a shipped sweep (run first where its folder lacks them) with their configs."""
    folder = folder or Path("runs") / name
    if run_sweep(EXAMPLES / f"{name}.toml", folder, on_line=lambda line: print(f"    {line}", flush=True)):
        raise SystemExit(f"some runs of {name} failed; see {folder / 'summary.csv'}")
    out = []
    with open(folder / "summary.csv", newline="") as f:
        for row in csv.DictReader(f):
            run = Run.read(folder / row["log"])
            out.append((run, run.config_dict()))
    return out


def schemes(args):
    """(1) as the paper's Table 3: a table per data set, a row per number of traces, a column per rule."""
    name = args.sweep.name if args.sweep else "schemes-synthetic"
    print("(1) Final test accuracy (mean ± std over seeds) per rule as the built-in traces grow, from the sweep")
    print(f"    examples/sweeps/{name}.toml; in brackets, the mean round the test accuracy first reached the")
    print("    sweep's target (seeds that never did left out; '-': none did).")
    swept(name, args.sweep)
    with open((args.sweep or Path("runs") / name) / "cells.csv", newline="") as f:
        cells = list(csv.DictReader(f))
    rules = list(dict.fromkeys(c["participation.scheme"] for c in cells))
    for data in dict.fromkeys((c.get("data.alpha"), c.get("data.beta")) for c in cells):
        title = f"SYNTHETIC({float(data[0]):g},{float(data[1]):g})" if data[0] else name
        print(f"\n{title}\n\n| traces | " + " | ".join(rules) + " | best |\n|" + " --- |" * (len(rules) + 2))
        for trace in dict.fromkeys(c["participation.trace"] for c in cells):
            row = {c["participation.scheme"]: c for c in cells
                   if c["participation.trace"] == trace and (c.get("data.alpha"), c.get("data.beta")) == data}
            means = {r: float(row[r]["final_test_accuracy_mean"]) for r in rules}
            text = [f"{means[r]:.4f} ± {float(row[r]['final_test_accuracy_std']):.4f} ({_rounds(row[r])})"
                    for r in rules]
            print(f"| {trace.removeprefix('builtin:')} | " + " | ".join(text) + f" | {max(means, key=means.get)} |")


def _rounds(cell: dict) -> str:
    value = cell["rounds_to_target_mean"]
    return f"{float(value):.0f}" if value else "-"


def reboot(args):
    print("(2) Rounds to recover the pre-arrival test accuracy after device 29 arrives, with and without")
    print("    fast-reboot (b = 3); SYNTHETIC(1,1), 30 devices of 200 samples, traces builtin:5, Scheme C,")
    print("    200 rounds, seeds 0, 1, 2 (examples/sweeps/fast-reboot.toml). Test accuracy over the federation,")
    print("    every round.")
    got: dict[tuple[int, bool], list] = {}
    for run, cfg in swept("fast-reboot", args.sweep):
        arrival = cfg["dynamics"]["arrive"][0]["round"]
        got.setdefault((arrival, cfg["dynamics"]["fast_reboot"]), []).append(
            rounds_to_recover(run["metrics/test_accuracy"], arrival))
    print("\n| arrival round | without fast-reboot | with fast-reboot |\n| --- | --- | --- |")
    for arrival in sorted({a for a, _ in got}):
        cells = [", ".join("never" if g is None else str(g) for g in got[(arrival, fast)]) for fast in (False, True)]
        print(f"| {arrival} | {cells[0]} | {cells[1]} |", flush=True)


def departure(args):
    print("(3) Test loss on the remaining 29 devices after device 29 departs, include vs exclude; the first")
    print("    round from which exclude stays below include. 30 devices of 200 samples, traces builtin:5,")
    print("    Scheme C, 200 rounds, seeds 0, 1, 2 (examples/sweeps/departure.toml).")
    losses: dict[tuple, list] = {}
    for run, cfg in swept("departure", args.sweep):
        (leave,) = cfg["dynamics"]["depart"]
        key = (cfg["data"]["alpha"], leave["round"], leave["policy"])
        losses.setdefault(key, []).append(remaining_test_loss(cfg, run["trajectory/x"], range(29)))
    print("\n| data | departure round | test loss at departure | include at end | exclude at end | curves cross at |")
    print("| --- | --- | --- | --- | --- | --- |")
    for alpha, leave in sorted({(a, r) for a, r, _ in losses}):
        inc, exc = (np.mean(losses[(alpha, leave, policy)], axis=0) for policy in ("include", "exclude"))
        below = exc[leave:] < inc[leave:]
        cross = next((leave + i for i in range(below.size) if below[i:].all()), None)
        print(f"| SYNTHETIC({alpha:g},{alpha:g}) | {leave} | {inc[leave - 1]:.4f} | {inc[-1]:.4f} | {exc[-1]:.4f} | "
              f"{'never' if cross is None else cross} |", flush=True)


def remaining_test_loss(raw: dict, trajectory, devices) -> np.ndarray:
    """Held-out loss of every stored model on the given devices' test data."""
    problem, model = runs.problem_and_model(config_mod.config_from_dict(raw))
    data = [problem.device(k) for k in devices]
    n = sum(d.y_test.size for d in data)
    return np.array([sum(model.loss_correct(x, d.X_test, d.y_test)[0] for d in data) / n for x in trajectory])


RULES = {"A": ['participation.scheme="A"'], "B": ['participation.scheme="B"'], "C": ['participation.scheme="C"'],
         "fednova": ['participation.scheme="fednova"'], "drop": ['participation.scheme="drop"'],
         "FedProx 0.01": ['train.algorithm="fedprox"', "fedprox.mu=0.01"],
         "FedProx 0.1": ['train.algorithm="fedprox"', "fedprox.mu=0.1"]}


def rules(args, folder):
    print("(4) Final test accuracy (mean of the last 5 evaluations, every 10 rounds; mean +- std over seeds) of")
    print("    Schemes A, B, C, FedNova, drop-stragglers and FedProx (Scheme B) as the number of built-in traces")
    print(f"    grows; SYNTHETIC(1,1), 50 devices, Pareto sample counts, {args.rounds} rounds, seeds {args.seeds}.")
    print("    Traces in order: cpu0, cpu30, cpu50, cpu70, cpu90 (CPU competitors), bw-high, bw-medium, bw-low (lost uploads).")
    print("\n| traces | " + " | ".join(RULES) + " | best |\n|" + " --- |" * (len(RULES) + 2))
    for k in range(1, 9):
        cells, means = [], {}
        for name, overrides in RULES.items():
            finals = []
            for seed in args.seeds:
                log = run(DATASETS["SYNTHETIC(1,1)"] + overrides + [
                    f"seed={seed}", "data.clients=50", 'data.samples="pareto"', f"rounds={args.rounds}",
                    f'participation.trace="builtin:{k}"', "log.eval_every=10", "log.every=1000"],
                    folder, f"r{k}{seed}")
                acc = log["metrics/test_accuracy"]
                finals.append(np.nanmean(acc[np.isfinite(acc)][-5:]))
            means[name] = float(np.mean(finals))
            cells.append(f"{means[name]:.4f} ± {np.std(finals):.4f}")
        print(f"| {k} | " + " | ".join(cells) + f" | {max(means, key=means.get)} |", flush=True)


def inconsistency(args, folder):
    """Where each rule's rounds stop on a quadratic whose devices complete different shares of K."""
    g = np.random.default_rng(3)
    n, d, K, lr = 8, 4, 20, 0.005
    A, b = g.uniform(0.5, 2.0, (n, d)), g.normal(0, 3, (n, d))
    quad = folder / "quad.npz"
    np.savez(quad, A=A, b=b, x0=np.zeros(d))
    optimum = (A * b).sum(axis=0) / A.sum(axis=0)  # of the uniform objective (1/N) sum f_k
    spread = np.linalg.norm(b - optimum, axis=1).max()
    from edgefed.tracefiles import write_trace_file

    fractions = [1.0, 0.75, 0.5, 0.4, 0.25, 0.15, 0.1, 0.05]
    write_trace_file(folder / "constant.csv", [f"t{i}" for i in range(n)], np.array([fractions]), {})
    settings = {"constant shares 1.0 .. 0.05": [f"{folder / 'constant.csv'}#t{i}" for i in range(n)],
                "built-in cpu0..cpu90 (no inactive rounds)": ["cpu0", "cpu30", "cpu50", "cpu70", "cpu90"],
                "with lost uploads: cpu0, cpu50, cpu90, bw-high, bw-medium, bw-low": ["cpu0", "cpu50", "cpu90",
                                                                                     "bw-high", "bw-medium", "bw-low"]}
    print("(5) Distance of the server model to the optimum of the uniform objective, relative to the devices'")
    print(f"    spread max_k |b_k - x*| = {spread:.3f}: mean over the last 200 of {args.rounds} rounds; a quadratic")
    print(f"    with N = {n}, d = {d}, exact gradients, K = {K}, lr = {lr}, every device every round, uniform weights.")
    print("\n| completed shares | " + " | ".join(RULES) + " |\n|" + " --- |" * (len(RULES) + 1))
    for label, traces in settings.items():
        cells = []
        for name, overrides in RULES.items():
            cfg = config_mod.load_config(None, [
                'data.kind="quadratic"', f'data.path="{quad}"', 'model.dtype="float64"', 'train.clients_per_round="all"',
                f"train.local_steps={K}", f"train.lr_local={lr}", 'train.weighting="uniform"', f"rounds={args.rounds}",
                'participation.mode="trace"', f"participation.trace={traces!r}".replace("'", '"'), "log.eval_every=100000",
                *overrides])
            runs.run(cfg, folder / "q.h5", force=True)
            xs = read_run(folder / "q.h5")["trajectory/x"][-200:]
            cells.append(f"{np.linalg.norm(xs - optimum, axis=1).mean() / spread:.4f}")
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=["schemes", "reboot", "departure", "rules", "inconsistency"])
    parser.add_argument("--sweep", type=Path, help="schemes, reboot, departure: the sweep's folder, named as its "
                                                   "sweep file (default runs/schemes-synthetic, fast-reboot, departure)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    print(f"# {platform.machine()}, Python {platform.python_version()}; command: "
          f"python benchmarks/flexible_participation.py {' '.join(sys.argv[1:])}\n")
    if args.experiment in ("schemes", "reboot", "departure"):
        {"schemes": schemes, "reboot": reboot, "departure": departure}[args.experiment](args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        {"rules": rules, "inconsistency": inconsistency}[args.experiment](args, Path(tmp))


if __name__ == "__main__":
    main()
