"""Kernel speed of two checkouts of edgefed side by side, alternating, on one machine in one run.

    git worktree add /tmp/before <commit>
    python benchmarks/compare_commits.py /tmp/before .

Each measurement runs in a fresh subprocess with that checkout first on sys.path, A then B then A ...
(three rounds, medians), so a slow phase of the machine hits both alike: local SGD steps of logistic
regression, the 2NN and the CNN (one thread, float32, the models' own local_steps as a round calls them),
CNN evaluation of 10,000 images, and the cold start of the default experiment (an empty kernel cache).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MEASURE = r"""
import json, sys, time
import numpy as np
from edgefed.problems import ClassificationData
try:  # the layer library (issue 26 on)
    from edgefed.models import Sequential
    LogReg = lambda f, c, dt: Sequential.builtin("logreg", (f,), c, dt)
    MLP = lambda sizes, dt, seed: Sequential.builtin("mlp", (sizes[0],), sizes[-1], dt, seed, sizes[1:-1])
    CNN = lambda f, c, dt, seed: Sequential.builtin("cnn", (1, 28, 28), c, dt, seed)
except ImportError:  # the hand-written models before it
    from edgefed.models import CNN, MLP, LogReg
from edgefed.rng import Purpose, kernel_state

def best(fn, n):
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return float(np.median(ts))

g = np.random.default_rng(0)
out = {}
for name, model, features, batch, k, n in (("logreg b20", LogReg(60, 10, np.float32), 60, 20, 20, 200),
                                            ("2NN b10", MLP((784, 200, 200, 10), np.float32, 0), 784, 10, 20, 60),
                                            ("2NN b64", MLP((784, 200, 200, 10), np.float32, 0), 784, 64, 20, 20),
                                            ("CNN b10", CNN(784, 10, np.float32, 0), 784, 10, 1, 15)):
    X = g.random((2000, features), dtype=np.float32)
    y = g.integers(0, 10, 2000)
    data = ClassificationData(X, y, X[:10], y[:10])
    x = model.initial_params()
    run = model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0))
    out[name + " step (us)"] = best(lambda: model.local_steps(x, data, run, k, batch, 0.01), n) / k * 1e6
    if name.startswith("CNN"):
        Xe, ye = g.random((10000, 784), dtype=np.float32), g.integers(0, 10, 10000)
        model.loss_correct(x, Xe[:64], ye[:64])
        t = time.perf_counter(); model.loss_correct(x, Xe, ye)
        out["CNN evaluation of 10,000 (s)"] = time.perf_counter() - t
print(json.dumps(out))
"""


def measure(repo: Path, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE], cwd=repo, env={**env, "PYTHONPATH": str(repo)},
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def cold_start(repo: Path, env: dict) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "edgefed", "run", "--quiet", "--out", f"{tmp}/r.h5"], cwd=repo,
                       env={**env, "PYTHONPATH": str(repo), "NUMBA_CACHE_DIR": tmp}, check=True, capture_output=True)
        return time.perf_counter() - t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    env = {**os.environ, **{v: "1" for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}}
    repos = {"A": args.a.resolve(), "B": args.b.resolve()}
    for repo in repos.values():  # fill each checkout's own kernel cache first
        measure(repo, env)
    results = {name: [] for name in repos}
    for _ in range(args.rounds):
        for name, repo in repos.items():
            row = measure(repo, env)
            row["cold start of the default experiment (s)"] = cold_start(repo, env)
            results[name].append(row)
    keys = list(results["A"][0])
    print(f"A = {repos['A']}\nB = {repos['B']}\n\n| measure | A | B | A / B |\n| --- | --- | --- | --- |")
    for key in keys:
        a, b = (statistics.median(r[key] for r in results[n]) for n in ("A", "B"))
        print(f"| {key} | {a:.4g} | {b:.4g} | {a / b:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
