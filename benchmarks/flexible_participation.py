"""The shape of the flexible-participation paper's experiments (Ruan et al.), on SYNTHETIC with logistic regression.

    python benchmarks/flexible_participation.py schemes    [--seeds 0 1]   # (1) A/B/C vs number of traces
    python benchmarks/flexible_participation.py reboot     [--seeds 0 1 2] # (2) fast-reboot after an arrival
    python benchmarks/flexible_participation.py departure  [--seeds 0 1 2] # (3) include vs exclude
    python benchmarks/flexible_participation.py rules      [--seeds 0 1 2] # (4) A/B/C, FedNova, drop, FedProx
    python benchmarks/flexible_participation.py inconsistency              # (5) where each rule's rounds stop

Common setting (the paper's): staircase learning rate eta_0 / r with eta_0 = 1, batch 20, count weights
p_k = n_k / n, every device of the federation works every round, K = 20 local steps, and each device's
completed steps drawn every round from one of edgefed's built-in measured traces (edgefed trace show builtin).
"""

from __future__ import annotations

import argparse
import platform
import tempfile
from pathlib import Path

import numpy as np

from edgefed import config as config_mod
from edgefed.orchestration import run as runs
from edgefed.runlog import read_run

COMMON = ['train.clients_per_round="all"', "train.local_steps=20", "train.batch_size=20", "train.lr_local=1.0",
          'train.lr_schedule="staircase"', 'train.weighting="count_global"', 'participation.mode="trace"']
DATASETS = {"SYNTHETIC(1,1)": ["data.alpha=1.0", "data.beta=1.0"], "SYNTHETIC(0,0)": ["data.alpha=0.0", "data.beta=0.0"]}


def run(overrides, folder: Path, name: str) -> dict:
    cfg = config_mod.load_config(None, COMMON + overrides)
    path = folder / f"{name}.h5"
    runs.run(cfg, path, force=True)
    return read_run(path)


def schemes(args, folder):
    print("(1) Final test accuracy (mean of the last 5 evaluations, every 10 rounds) of Schemes A, B, C as the")
    print(f"    number of built-in traces grows; 50 devices, Pareto sample counts, {args.rounds} rounds, seeds {args.seeds}.")
    print("    Traces in order: cpu0, cpu30, cpu50, cpu70, cpu90 (CPU competitors), bw-high, bw-medium, bw-low (lost uploads).")
    for dataset, data in DATASETS.items():
        print(f"\n{dataset}\n\n| traces | A | B | C | best |\n| --- | --- | --- | --- | --- |")
        for k in range(1, 9):
            accs = {}
            for scheme in "ABC":
                finals = []
                for seed in args.seeds:
                    log = run(data + [f"seed={seed}", "data.clients=50", 'data.samples="pareto"', f"rounds={args.rounds}",
                                      f'participation.trace="builtin:{k}"', f'participation.scheme="{scheme}"',
                                      "log.eval_every=10", "log.every=1000"], folder, f"s{k}{scheme}{seed}")
                    acc = log["metrics/test_accuracy"]
                    finals.append(np.nanmean(acc[np.isfinite(acc)][-5:]))
                accs[scheme] = float(np.mean(finals))
            best = max(accs, key=accs.get)
            print(f"| {k} | {accs['A']:.4f} | {accs['B']:.4f} | {accs['C']:.4f} | {best} |", flush=True)


def rounds_to_recover(acc: np.ndarray, arrival: int):
    """Rounds after the arrival until test accuracy is back at its level just before it (None: never)."""
    before = acc[arrival - 1]
    later = np.flatnonzero(acc[arrival:] >= before)
    return int(later[0]) if later.size else None


def reboot(args, folder):
    print("(2) Rounds to recover the pre-arrival test accuracy after device 29 arrives, with and without")
    print("    fast-reboot (b = 3); SYNTHETIC(1,1), 30 devices of 200 samples, traces builtin:5, Scheme C,")
    print(f"    {args.rounds} rounds, seeds {args.seeds}. Test accuracy over the federation, every round.")
    print("\n| arrival round | without fast-reboot | with fast-reboot |\n| --- | --- | --- |")
    for arrival in (20, 60, 120):
        cells = []
        for fast in (False, True):
            got = []
            for seed in args.seeds:
                log = run(DATASETS["SYNTHETIC(1,1)"] + [
                    f"seed={seed}", "data.clients=30", "data.samples=200", f"rounds={args.rounds}",
                    'participation.trace="builtin:5"', 'participation.scheme="C"', "log.every=1000",
                    f"dynamics.fast_reboot={'true' if fast else 'false'}",
                    f"dynamics.arrive=[{{device = 29, round = {arrival}}}]"], folder, f"r{arrival}{fast}{seed}")
                got.append(rounds_to_recover(log["metrics/test_accuracy"], arrival))
            cells.append(", ".join("never" if g is None else str(g) for g in got))
        print(f"| {arrival} | {cells[0]} | {cells[1]} |", flush=True)


def departure(args, folder):
    print("(3) Test loss on the remaining 29 devices after device 29 departs, include vs exclude; the first")
    print("    round from which exclude stays below include. 30 devices of 200 samples, traces builtin:5,")
    print(f"    Scheme C, {args.rounds} rounds, seeds {args.seeds}.")
    print("\n| data | departure round | test loss at departure | include at end | exclude at end | curves cross at |")
    print("| --- | --- | --- | --- | --- | --- |")
    for dataset, data in (("SYNTHETIC(0,0)", DATASETS["SYNTHETIC(0,0)"]),
                          ("SYNTHETIC(0.5,0.5)", ["data.alpha=0.5", "data.beta=0.5"]),
                          ("SYNTHETIC(1,1)", DATASETS["SYNTHETIC(1,1)"])):
        for leave in (50, 100):
            rows = {}
            for policy in ("include", "exclude"):
                losses = []
                for seed in args.seeds:
                    overrides = data + [
                        f"seed={seed}", "data.clients=30", "data.samples=200", f"rounds={args.rounds}",
                        'participation.trace="builtin:5"', 'participation.scheme="C"', "log.eval_every=1000",
                        f'dynamics.depart=[{{device = 29, round = {leave}, policy = "{policy}"}}]']
                    log = run(overrides, folder, f"d{leave}{policy}{seed}")
                    losses.append(remaining_test_loss(overrides, log["trajectory/x"], range(29)))
                rows[policy] = np.mean(losses, axis=0)
            inc, exc = rows["include"], rows["exclude"]
            below = exc[leave:] < inc[leave:]
            cross = next((leave + i for i in range(below.size) if below[i:].all()), None)
            print(f"| {dataset} | {leave} | {inc[leave - 1]:.4f} | {inc[-1]:.4f} | {exc[-1]:.4f} | "
                  f"{'never' if cross is None else cross} |", flush=True)


def remaining_test_loss(overrides, trajectory, devices) -> np.ndarray:
    """Held-out loss of every stored model on the given devices' test data."""
    cfg = config_mod.load_config(None, COMMON + overrides)
    problem, model = runs.problem_and_model(cfg)
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
    print(f"(5) Distance of the server model to the optimum of the uniform objective, relative to the devices'")
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
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    print(f"# {platform.machine()}, Python {platform.python_version()}; command: "
          f"python benchmarks/flexible_participation.py {args.experiment} --seeds {' '.join(map(str, args.seeds))} "
          f"--rounds {args.rounds}\n")
    with tempfile.TemporaryDirectory() as tmp:
        {"schemes": schemes, "reboot": reboot, "departure": departure, "rules": rules,
         "inconsistency": inconsistency}[args.experiment](args, Path(tmp))


if __name__ == "__main__":
    main()
