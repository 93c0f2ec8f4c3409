"""FedAvg vs SCAFFOLD (options I and II) on SYNTHETIC(1,1): rounds to reach a target training loss.

Same data, same device samples and minibatch streams for every algorithm (one seed keys them all), uniform
weighting (SCAFFOLD's) for all three so the objective is the same, several local learning rates and seeds.

    python benchmarks/scaffold_vs_fedavg.py [--rounds 200] [--seeds 0 1 2] [--target 0.5]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from edgefed import config as config_mod
from edgefed.orchestration import run as runs
from edgefed.runlog import read_run

VARIANTS = {"FedAvg": ["train.algorithm=\"fedavg\""],
            "SCAFFOLD-I": ["train.algorithm=\"scaffold\"", "scaffold.option=\"I\""],
            "SCAFFOLD-I-full": ["train.algorithm=\"scaffold\"", "scaffold.option=\"I\"",
                                "scaffold.control_gradient=\"full\""],
            "SCAFFOLD-II": ["train.algorithm=\"scaffold\"", "scaffold.option=\"II\""]}


def one_run(variant: str, lr: float, seed: int, rounds: int, folder: Path):
    cfg = config_mod.load_config(None, VARIANTS[variant] + [
        f"seed={seed}", f"rounds={rounds}", f"train.lr_local={lr}", "train.weighting=\"uniform\"",
        "log.every=1000"])
    path = folder / f"{variant}-{lr}-{seed}.h5"
    wall = time.perf_counter()
    runs.run(cfg, path)
    wall = time.perf_counter() - wall
    log = read_run(path)
    return log["metrics/train_loss"], log["metrics/test_accuracy"], wall


def first_round_below(loss: np.ndarray, target: float):
    hits = np.flatnonzero(loss <= target)
    return int(hits[0]) if hits.size else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.01, 0.03, 0.1])
    parser.add_argument("--target", type=float, default=0.6, help="training loss (uniform objective) to reach")
    args = parser.parse_args(argv)
    print(f"# machine: {platform.machine()} {platform.processor() or ''}, Python {platform.python_version()}")
    print(f"# SYNTHETIC(1,1), 30 devices, 10 per round, K = 20, B = 20, {args.rounds} rounds, seeds {args.seeds}")
    print(f"| algorithm | lr | rounds to train loss <= {args.target} (per seed) | final train loss | "
          "final test acc | s per run |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for lr in args.lrs:
            for variant in VARIANTS:
                hits, finals, accs, walls = [], [], [], []
                for seed in args.seeds:
                    loss, acc, wall = one_run(variant, lr, seed, args.rounds, Path(tmp))
                    hit = first_round_below(loss, args.target)
                    hits.append("-" if hit is None else str(hit))
                    finals.append(loss[-1])
                    accs.append(acc[-1])
                    walls.append(wall)
                print(f"| {variant} | {lr} | {', '.join(hits)} | {np.mean(finals):.4f} | {np.mean(accs):.4f} | "
                      f"{np.mean(walls):.1f} |", flush=True)


if __name__ == "__main__":
    main()
