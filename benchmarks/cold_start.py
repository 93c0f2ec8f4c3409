"""Cold and warm starts of whole runs, two checkouts side by side, alternating, on one machine in one run.

    git worktree add /tmp/before <commit>
    python benchmarks/cold_start.py /tmp/before . [--rounds 3]

Each measurement is a fresh `python -m edgefed run` process with that checkout first on sys.path: cold with an
empty Numba cache (NUMBA_CACHE_DIR a new folder), then warm with the cache the cold run filled. A then B then A
..., medians over the rounds, so a slow phase of the machine hits both alike. The runs: the README's default
experiment (logistic regression on SYNTHETIC(1,1), 100 rounds) and, on random data of each model's shape (the
data's values do not change the kernels a model compiles), McMahan et al.'s 2NN and CNN on 28 x 28 images, the
CIFAR-10 CNN of examples/cifar10-cnn.toml, and a 1-D convolution over 4 x 128 sequences, each 2 rounds of 4
devices. Last, what the shipped board profiles predict for B's compilation (cold minus warm): its seconds here scaled by the
board's latency-bound logistic-regression step against this machine's (as benchmarks/layer_speed.py does).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["rounds=2", "data.clients=4", "train.clients_per_round=2", "train.local_steps=5"]


def datasets(folder: Path) -> dict[str, Path]:
    g = np.random.default_rng(0)

    def images(name, shape, n=800):
        path = folder / name
        np.savez(path, x_train=g.integers(0, 256, (n, *shape)).astype(np.uint8), y_train=g.integers(0, 10, n),
                 x_test=g.integers(0, 256, (100, *shape)).astype(np.uint8), y_test=g.integers(0, 10, 100))
        return path

    return {"mnist": images("mnist.npz", (1, 28, 28)), "cifar": images("cifar.npz", (3, 32, 32)),
            "seq": images("seq.npz", (4, 128))}


def runs(data: dict[str, Path]) -> dict[str, list[str]]:
    """name -> edgefed run's arguments (after `run`)."""
    arrays = lambda key: ["--set", 'data.kind="arrays"', "--set", f'data.path="{data[key]}"', "--set",  # noqa: E731
                          'data.normalize="unit"', *[a for o in SHORT for a in ("--set", o)]]
    conv1d = ('model.layers=[{type = "conv1d", out = 16, kernel = 5}, {type = "relu"}, {type = "maxpool1d", size = 2}, '
              '{type = "conv1d", out = 16, kernel = 5}, {type = "relu"}, {type = "global_avgpool"}, '
              '{type = "dense", out = 10}]')
    return {
        "default experiment (logreg, 100 rounds)": [],
        "2NN (MNIST shape)": [*arrays("mnist"), "--set", 'model.kind="mlp"'],
        "CNN (MNIST shape)": [*arrays("mnist"), "--set", 'model.kind="cnn"'],
        "CIFAR-10 CNN (examples/cifar10-cnn.toml)": [str(ROOT / "examples" / "cifar10-cnn.toml"), *arrays("cifar")],
        "1-D conv (4 x 128)": [*arrays("seq"), "--set", 'model.kind="sequential"', "--set", conv1d],
    }


def timed(repo: Path, args: list[str], cache: str, out: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(repo), "NUMBA_CACHE_DIR": cache}
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "edgefed", "run", *args, "--quiet", "--force", "--out", out], cwd=repo,
                   env=env, check=True, capture_output=True)
    return time.perf_counter() - t


def board_table(cold_s: dict[str, float]) -> None:
    sys.path.insert(0, str(ROOT))
    from edgefed import hwprofile

    here = hwprofile.load_profile("x86-64-laptop").step_seconds("logreg", 20, 610)
    names = list(cold_s)
    print("| board profile | " + " | ".join(f"{n}: compiling, s" for n in names) + " |")
    print("| --- |" + " --- |" * len(names))
    for name in hwprofile.shipped_names():
        prof = hwprofile.load_profile(name)
        ratio = prof.step_seconds("logreg", 20, 610) / here
        estimated = "" if prof.measured else " (estimated speeds)"
        print(f"| {prof.name}{estimated} | " + " | ".join(f"{cold_s[n] * ratio:.0f}" for n in names) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    repos = {"A": args.a.resolve(), "B": args.b.resolve()}
    times = {}  # (repo, run, "cold" | "warm") -> [seconds]
    with tempfile.TemporaryDirectory() as tmp:
        data = datasets(Path(tmp))
        todo = runs(data)
        for _ in range(args.rounds):
            for run, run_args in todo.items():
                for name, repo in repos.items():
                    with tempfile.TemporaryDirectory() as cache:
                        for kind in ("cold", "warm"):
                            times.setdefault((name, run, kind), []).append(
                                timed(repo, run_args, cache, f"{tmp}/{name}.h5"))
    med = {key: statistics.median(v) for key, v in times.items()}
    print(f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; medians of "
          f"{args.rounds} rounds\nA = {repos['A']}\nB = {repos['B']}\n")
    print("| run | A cold, s | A warm, s | A cold / warm | B cold, s | B warm, s | B cold / warm | cold A / B |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in todo:
        a_c, a_w, b_c, b_w = (med[(n, run, k)] for n in ("A", "B") for k in ("cold", "warm"))
        print(f"| {run} | {a_c:.1f} | {a_w:.1f} | {a_c / a_w:.1f}x | {b_c:.1f} | {b_w:.1f} | {b_c / b_w:.1f}x | "
              f"{a_c / b_c:.1f}x |")
    print()
    board_table({run: med[("B", run, "cold")] - med[("B", run, "warm")] for run in todo
                 if run.startswith(("default", "CIFAR"))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
