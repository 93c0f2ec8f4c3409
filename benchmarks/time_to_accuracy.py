"""Which deadline policy reaches a target test accuracy first, in seconds of the federation's clock.

    python benchmarks/time_to_accuracy.py simulated [--seeds 0 1 2] [--target 0.75]
    python benchmarks/time_to_accuracy.py measured  [--seeds 0 1]   [--target 0.7]    # needs mpiexec

The default experiment (SYNTHETIC(1,1), logistic regression, batch 20, lr 0.01), K = 500 local steps, under
each policy: a fixed deadline, "auto" (1.1 x the profiled time of K steps), adaptive with q = 0.5, 0.8 and
0.95, and over-selection with o = 0.3 (no deadline), each with Schemes B and C and FedNova; and FedBuff
(buffered asynchronous aggregation, buffers of M = 2, 5 and 10 reports, polynomial staleness weights) on
the same cluster, with as many devices training at once as a round selects and as many reports in all as
the rounds take (simulated: C = 10, 1,000 reports; measured: C = 4, 240).

- simulated: 30 devices, 10 per round, 100 rounds, on this machine's profile (hw_profiles/x86-64-laptop)
  with relative speeds 1, 0.7, 0.5, 0.3, 0.1 (cycled: the share of a core a 0/30/50/70/90 % competitor
  leaves), on the simulated clock: deterministic, a laptop standing in for a heterogeneous cluster.
- measured: `mpiexec -n 3` on this machine, two device ranks under real CPU competitors of 0 % and 70 %,
  10 devices, 4 per round, 60 rounds, on the measured clock.

Each cell: the clock_s of the first evaluated round whose test accuracy reaches the target, mean +- std over
the seeds that reached it (in brackets how many did, when not all), and the final accuracy.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from edgefed.runtime.mpi.comm import local_mpiexec, outside_world_env

HERE = Path(__file__).resolve().parent
MPIEXEC = local_mpiexec()
POLICIES = {
    "fixed": ['participation.mode="deadline"', "participation.deadline_s={fixed}"],
    "auto": ['participation.mode="deadline"', 'participation.deadline_s="auto"'],
    "adaptive 0.5": ['participation.mode="deadline"', 'participation.deadline_s="adaptive"',
                     "participation.deadline_quantile=0.5"],
    "adaptive 0.8": ['participation.mode="deadline"', 'participation.deadline_s="adaptive"',
                     "participation.deadline_quantile=0.8"],
    "adaptive 0.95": ['participation.mode="deadline"', 'participation.deadline_s="adaptive"',
                      "participation.deadline_quantile=0.95"],
    "over-select 0.3": ["participation.overselect=0.3"],
}
SCHEMES = ("B", "C", "fednova")
FEDBUFF = ['participation.mode="async"', 'async.staleness="polynomial"', 'train.clients_per_round="all"']
FEDBUFF_BUFFERS = (2, 5, 10)
COMMON = ["train.local_steps=500", "train.lr_local=0.01", "participation.grace_s=0.5", "log.every=1000"]
SETTINGS = {
    "simulated": {"ranks": None, "fixed": 0.004, "rounds": 100, "reports": 1000, "concurrency": 10, "overrides": [
        "rounds=100", "data.clients=30", "train.clients_per_round=10", 'participation.clock="simulated"',
        'device.profile="x86-64-laptop"', "device.speed=[1.0, 0.7, 0.5, 0.3, 0.1]", "log.eval_every=2"]},
    "measured": {"ranks": 3, "fixed": 0.01, "rounds": 60, "reports": 240, "concurrency": 4, "overrides": [
        "rounds=60", "data.clients=10", "train.clients_per_round=4", 'participation.clock="measured"',
        'device.boards=["x86-64-laptop", "x86-64-laptop"]', "device.contention=[0.0, 0.7]", "log.eval_every=2"]},
}


def run(args: list[str], ranks: int | None, out: Path) -> dict:
    from edgefed.runlog import read_run

    cmd = [sys.executable, "-m", "edgefed", "run", *sum((["--set", a] for a in args), []), "--out", str(out),
           "--force", "--quiet"]
    if ranks:
        cmd = [MPIEXEC, "-n", str(ranks), *cmd]
    env = outside_world_env()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return read_run(out)


def time_to(log: dict, target: float) -> tuple[float, float]:
    acc, clock = log["metrics/test_accuracy"], log["metrics/clock_s"]
    reached = np.flatnonzero(np.nan_to_num(acc, nan=-1.0) >= target)
    final = acc[np.isfinite(acc)][-1]
    return (float(clock[reached[0]]) if reached.size else float("nan")), float(final)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("setting", choices=sorted(SETTINGS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--target", type=float, default=0.75)
    args = parser.parse_args()
    setting = SETTINGS[args.setting]
    if setting["ranks"] and MPIEXEC is None:
        raise SystemExit("the measured setting needs mpiexec: pip install 'edgefed[mpi]'")
    print(f"# {platform.machine()}, {os.cpu_count()} cores; command: python benchmarks/time_to_accuracy.py "
          f"{args.setting} --seeds {' '.join(map(str, args.seeds))} --target {args.target}\n")
    print("| policy | " + " | ".join(f"{s}: seconds to {args.target:g} | {s}: final" for s in SCHEMES)
          + " |\n|" + " --- |" * (1 + 2 * len(SCHEMES)))
    with tempfile.TemporaryDirectory() as tmp:
        for policy, extra in POLICIES.items():
            cells = []
            for scheme in SCHEMES:
                times, finals = [], []
                for seed in args.seeds:
                    overrides = (COMMON + setting["overrides"] + [e.format(fixed=setting["fixed"]) for e in extra]
                                 + [f"seed={seed}", f'participation.scheme="{scheme}"'])
                    t, final = time_to(run(overrides, setting["ranks"], Path(tmp) / "r.h5"), args.target)
                    times.append(t)
                    finals.append(final)
                hit = np.array([t for t in times if np.isfinite(t)])
                reached = "" if hit.size == len(times) else f" ({hit.size}/{len(times)})"
                cells.append("never" if not hit.size else f"{hit.mean():.3f} ± {hit.std():.3f}{reached}")
                cells.append(f"{np.mean(finals):.4f}")
            print(f"| {policy} | " + " | ".join(cells) + " |", flush=True)
        # FedBuff on the same cluster, as many reports in all as the rounds take (evaluated as often)
        reports, concurrency = setting["reports"], setting["concurrency"]
        print(f"\n| FedBuff, C = {concurrency} | seconds to {args.target:g} | final | server updates |\n"
              "| --- | --- | --- | --- |")
        for buffer in FEDBUFF_BUFFERS:
            updates = reports // buffer
            times, finals = [], []
            for seed in args.seeds:
                overrides = (COMMON + setting["overrides"] + FEDBUFF
                             + [f"async.concurrency={concurrency}", f"async.buffer={buffer}", f"rounds={updates}",
                                f"log.eval_every={max(1, 2 * reports // setting['rounds'] // buffer)}", f"seed={seed}"])
                t, final = time_to(run(overrides, setting["ranks"], Path(tmp) / "r.h5"), args.target)
                times.append(t)
                finals.append(final)
            hit = np.array([t for t in times if np.isfinite(t)])
            reached = "" if hit.size == len(times) else f" ({hit.size}/{len(times)})"
            cell = "never" if not hit.size else f"{hit.mean():.3f} ± {hit.std():.3f}{reached}"
            print(f"| M = {buffer} | {cell} | {np.mean(finals):.4f} | {updates} |", flush=True)


if __name__ == "__main__":
    main()
