"""Who takes part: uniform selection beside FedCS, Oort and power of choice, under deadlines.

    python benchmarks/selection.py simulated [--seeds 0 1 2] [--target 0.75]
    python benchmarks/selection.py measured  [--seeds 0 1]   [--target 0.7]     # needs mpiexec
    python benchmarks/selection.py inconsistency [--rounds 1500]

- simulated: SYNTHETIC(1,1), 30 devices, 10 a round, K = 100 local steps, lr 0.01, 100 rounds, on the
  Raspberry Pi 4 profile at relative speeds 1, 0.7, 0.5, 0.3, 0.1 (cycled: the share of a core the built-in
  traces' 0/30/50/70/90 % competitors leave), a deadline of 1.5x each device's profiled time (the two fast
  fifths finish, the rest do part), on the simulated clock: deterministic.
- measured: `mpiexec -n 3` on this machine, two device ranks under real CPU competitors of 0 % and 70 %,
  10 devices, 4 a round, K = 2000 steps at lr 0.003, a fixed 20 ms deadline (`--deadline` to change it: a
  free core does the 2000 logistic-regression steps in about 7 ms, the loaded rank needs about 20), 60
  rounds, on the measured clock. Every Scheme C run is replayed in the simulator from its log, and the
  replay's selections, steps and models must equal the run's.
- inconsistency: where each policy x rule stops on a quadratic (docs/design.md 2.18): N = 8, d = 4, exact
  gradients, K = 20, S = 4, uniform weights, relative speeds 1 .. 0.1 on a hand-written profile, a
  deadline of 1.5x the profiled time; the distance to the optimum of (1/N) sum f_k and to that of
  sum pi_k f_k, pi_k each device's share of the selections the run made.

Each cell of the first two: the clock_s of the first evaluated round at the target and that round (mean +-
std over the seeds that reached it; in brackets how many did), the final accuracy, Jain's index of the devices'
participation counts (1: all equal), and the 10th percentile of the devices' own test accuracies at the
final model.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

from edgefed import config as config_mod
from edgefed.analysis.logs import jain_index
from edgefed.orchestration import run as runs
from edgefed.runlog import read_run
from time_to_accuracy import MPIEXEC, run, time_to  # the same runs and the same time to a target

POLICIES = {"uniform": [], "fedcs": ['selection.policy="fedcs"'], "oort": ['selection.policy="oort"'],
            "power of choice": ['selection.policy="power_of_choice"']}
SCHEMES = ("B", "C", "fednova")
SETTINGS = {
    "simulated": {"ranks": None, "overrides": [
        "rounds=100", "data.clients=30", "train.clients_per_round=10", "train.local_steps=100",
        "train.lr_local=0.01", 'participation.mode="deadline"', 'participation.deadline_s="1.5x"',
        'participation.clock="simulated"', 'device.profile="pi4b"', "device.speed=[1.0, 0.7, 0.5, 0.3, 0.1]",
        "log.eval_every=2", "log.every=1000"]},
    "measured": {"ranks": 3, "overrides": [
        "rounds=60", "data.clients=10", "train.clients_per_round=4", "train.local_steps=2000", "train.lr_local=0.003",
        'participation.mode="deadline"', "participation.deadline_s=0.02", "participation.grace_s=0.5",
        'participation.clock="measured"', 'device.boards=["x86-64-laptop", "x86-64-laptop"]',
        "device.contention=[0.0, 0.7]", "log.eval_every=2", "log.every=1000"]},
}


def device_accuracies(log: dict) -> np.ndarray:
    """Each device's own test accuracy at the run's final model, as edgefed builds its data and model."""
    cfg = config_mod.config_from_dict(config_mod.parse_toml(log["attrs"]["config"]))
    problem, model = runs.problem_and_model(cfg)
    x = log["trajectory/x"][-1]
    out = []
    for k in range(problem.n_devices):
        data = problem.device(k)
        _, correct = model.loss_correct(x, data.X_test, data.y_test)
        out.append(correct / max(data.y_test.shape[0], 1))
    return np.array(out)


def rounds_to(log: dict, target: float) -> float:
    reached = np.flatnonzero(np.nan_to_num(log["metrics/test_accuracy"], nan=-1.0) >= target)
    return float(reached[0]) if reached.size else float("nan")


def cells(values: list[tuple]) -> list[str]:
    """(seconds to the target, rounds to it) over the seeds that reached it, then the means of the rest."""
    out = []
    for i, digits in ((0, 3), (1, 0)):
        got = np.array([v[i] for v in values])
        hit = got[np.isfinite(got)]
        reached = "" if hit.size == got.size else f" ({hit.size}/{got.size})"
        out.append("never" if not hit.size else f"{hit.mean():.{digits}f} ± {hit.std():.{digits}f}{reached}")
    return out + [f"{np.mean([v[i] for v in values]):.3f}" for i in (2, 3, 4)]


def replayed_exactly(log: dict, path: Path, folder: Path) -> bool:
    """A measured run replayed in the simulator from its own log (participation.trace = the log, without its
    deadline and boards): the same selections, steps and models, bit for bit."""
    raw = config_mod.parse_toml(log["attrs"]["config"])
    raw["participation"].update(mode="trace", trace=str(path))
    for key in ("deadline_s", "clock", "grace_s"):
        raw["participation"].pop(key, None)
    raw.pop("device", None)
    runs.run(config_mod.config_from_dict(raw), folder / "replay.h5", force=True)
    again = read_run(folder / "replay.h5")
    return all(again[k].tobytes() == log[k].tobytes()
               for k in ("participation/selected", "participation/steps", "trajectory/x"))


def experiment(args, folder: Path) -> None:
    setting = SETTINGS[args.experiment]
    if args.deadline is not None:
        setting = {**setting, "overrides": [o for o in setting["overrides"] if not o.startswith("participation.deadline_s")]
                   + [f"participation.deadline_s={args.deadline}"]}
    print(f"| policy | scheme | seconds to {args.target:g} | rounds to it | final accuracy | Jain's index | 10th pct "
          "device accuracy |\n| --- | --- | --- | --- | --- | --- | --- |")
    replays = []
    for policy, extra in POLICIES.items():
        for scheme in args.schemes:
            values = []
            for seed in args.seeds:
                out = folder / f"{policy}-{scheme}-{seed}.h5".replace(" ", "_")
                log = run(setting["overrides"] + extra + [f"seed={seed}", f'participation.scheme="{scheme}"'],
                          setting["ranks"], out)
                seconds, final = time_to(log, args.target)
                values.append((seconds, rounds_to(log, args.target), final,
                               jain_index(log["participation/selected"].sum(axis=0)),
                               float(np.percentile(device_accuracies(log), 10))))
                if setting["ranks"] and scheme == "C":
                    replays.append(replayed_exactly(log, out, folder))
            print(f"| {policy} | {scheme} | " + " | ".join(cells(values)) + " |", flush=True)
    if replays:
        print(f"\nreplayed in the simulator from their logs, bit for bit: {sum(replays)} of {len(replays)} runs")


def inconsistency(args, folder: Path) -> None:
    from edgefed import hwprofile

    g = np.random.default_rng(3)
    n, d, K, lr = 8, 4, 20, 0.005
    A, b = g.uniform(0.5, 2.0, (n, d)), g.normal(0, 3, (n, d))
    np.savez(folder / "quad.npz", A=A, b=b, x0=np.zeros(d))
    optimum = (A * b).sum(axis=0) / A.sum(axis=0)
    spread = np.linalg.norm(b - optimum, axis=1).max()
    (folder / "board.toml").write_text(hwprofile.profile_toml({
        "format": 1, "name": "quadratic board", "measured": True,
        "machine": {"arch": "aarch64", "cores": 4, "memory_mb": 1024},
        "speed": [{"model": "quadratic", "params": d, "batch": 20, "steps_per_s": 1000.0}]}))
    print(f"Distance of the server model to the optimum of (1/N) sum f_k, relative to the devices' spread "
          f"max_k |b_k - x*| = {spread:.3f}, and (after /) to the optimum of sum pi_k f_k with pi_k the devices' "
          f"share of the selections: mean over the last 200 of {args.rounds} rounds.\n")
    print("| policy | " + " | ".join(SCHEMES) + " |\n|" + " --- |" * (len(SCHEMES) + 1))
    for policy, extra in POLICIES.items():
        row = []
        for scheme in SCHEMES:
            cfg = config_mod.load_config(None, [
                'data.kind="quadratic"', f'data.path="{folder / "quad.npz"}"', 'model.dtype="float64"',
                "train.clients_per_round=4", f"train.local_steps={K}", f"train.lr_local={lr}",
                'train.weighting="uniform"', f"rounds={args.rounds}", 'participation.mode="deadline"',
                'participation.deadline_s="1.5x"', f'device.profile="{folder / "board.toml"}"',
                "device.speed=[1.0, 0.7, 0.5, 0.3, 0.1]", f'participation.scheme="{scheme}"',
                "log.eval_every=100000", *extra])
            runs.run(cfg, folder / "q.h5", force=True)
            log = read_run(folder / "q.h5")
            xs = log["trajectory/x"][-200:]
            pi = log["participation/selected"].sum(axis=0) / log["participation/selected"].sum()
            biased = (pi[:, None] * A * b).sum(axis=0) / (pi[:, None] * A).sum(axis=0)
            row.append(f"{np.linalg.norm(xs - optimum, axis=1).mean() / spread:.4f} / "
                       f"{np.linalg.norm(xs - biased, axis=1).mean() / spread:.4f}")
        print(f"| {policy} | " + " | ".join(row) + " |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=["simulated", "measured", "inconsistency"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--target", type=float, default=0.75)
    parser.add_argument("--rounds", type=int, default=1500)
    parser.add_argument("--deadline", type=float, help="measured: the deadline in seconds (default 0.02)")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    args = parser.parse_args()
    if args.experiment == "measured" and MPIEXEC is None:
        raise SystemExit("the measured setting needs mpiexec: pip install 'edgefed[mpi]'")
    print(f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; command: "
          f"python benchmarks/selection.py {' '.join(sys.argv[1:])}\n")
    with tempfile.TemporaryDirectory() as tmp:
        (inconsistency if args.experiment == "inconsistency" else experiment)(args, Path(tmp))


if __name__ == "__main__":
    main()
