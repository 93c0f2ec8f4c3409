"""End-to-end speed and footprint: edgefed's simulator and `mpirun` beside Flower's simulation, in one run.

    python benchmarks/end_to_end.py [--rounds 100] [--flower-python /path/to/flower-venv/bin/python]
    python benchmarks/end_to_end.py --against OTHER_CHECKOUT [--repeats 5]   # round overhead, side by side

Workload (the one the Flower reference numbers were measured on): SYNTHETIC(1,1) with 10 devices, every device
every round, 5 local steps of logistic regression at batch 20, no evaluation until the last round (Flower's
baseline evaluates nothing). Each run is a fresh process, timed from its start:
- start to first round: until the progress line of round 1 appears (imports, data, warm kernel cache, round 1);
- per round: the mean time between progress lines of rounds 2..R, i.e. everything a round costs (local work,
  aggregation, HDF5 log, progress line), not only the round's own measured work.
Then: the resident memory of a device rank with the 2NN (`mpiexec -n 2`, MNIST-sized images), and the
simulator at 100, 300 and 1,000 devices (every device every round) for time per round and peak memory.
Flower (optional, `--flower-python`: a separate venv with `flwr[simulation]`) runs benchmarks/flower_baseline.py
on the same devices' data. `--against` instead times the round overhead of this checkout and another one (an
older commit, say) in alternation, so a change that must not slow the round is measured on the same machine
state: the median over the repeats of each one's per-round time, in the simulator and under `mpiexec -n 3`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
from edgefed.runtime.mpi.comm import local_mpiexec, outside_world_env

HERE = Path(__file__).resolve().parent
MPIEXEC = local_mpiexec()
WORKLOAD = ["data.clients=10", 'train.clients_per_round="all"', "train.local_steps=5", "train.batch_size=20"]


def clean_env() -> dict:
    return outside_world_env()


def anon_mb(pid: int) -> float:
    """Private (anonymous) resident memory: RSS without the mapped, shared and reclaimable library code."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class PeakMemory:
    """Polls the resident memory of a process tree every 20 ms; peak (RSS, private) per process (by MPI rank)."""

    def __init__(self, pid: int):
        self.root, self.peak, self._stop = psutil.Process(pid), {}, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self):
        while not self._stop.is_set():
            try:
                procs = [self.root] + self.root.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for p in procs:
                try:
                    if "python" not in p.name():
                        continue
                    env = p.environ()
                    rank = env.get("PMI_RANK", env.get("OMPI_COMM_WORLD_RANK"))
                    key = "process" if rank is None else f"rank {rank}"
                    rss, private = self.peak.get(key, (0.0, 0.0))
                    self.peak[key] = (max(rss, p.memory_info().rss / 2**20), max(private, anon_mb(p.pid)))
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            time.sleep(0.02)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return self.peak


def timed_run(args: list[str], ranks: int | None = None, tree: Path | None = None) -> dict:
    """Run `edgefed run` fresh (of the checkout `tree`, default this one); timestamps of its round lines, peak
    memory per process."""
    cmd = [sys.executable, "-m", "edgefed", "run", *args]
    if ranks:
        cmd = [MPIEXEC, "-n", str(ranks), *cmd]
    env = clean_env()
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    with tempfile.TemporaryFile("w+") as errors:  # a file, not a pipe: a chatty stderr cannot block the run
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True, env=env)
        memory = PeakMemory(proc.pid)
        stamps = {}
        for line in proc.stdout:
            if line.startswith("round "):
                stamps[int(line.split()[1].split("/")[0])] = time.perf_counter() - t0
        proc.wait()
        peak = memory.stop()
        if proc.returncode:
            errors.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} failed: {errors.read()[-2000:]}")
    rounds = sorted(stamps)
    gaps = np.diff([stamps[r] for r in rounds if r >= 1])
    return {"first_round_s": stamps[1], "per_round_ms": float(np.mean(gaps[1:] if gaps.size > 1 else gaps)) * 1e3,
            "median_round_ms": float(np.median(gaps)) * 1e3, "peak_mb": peak}


def flower_data(folder: Path) -> Path:
    """The workload's devices' training data as flower_baseline.py reads it."""
    from edgefed.config import load_config
    from edgefed.orchestration.run import problem_and_model

    problem, _ = problem_and_model(load_config(None, WORKLOAD))
    arrays = {"n_classes": np.int64(problem.n_classes), "dim": np.int64(problem.n_features)}
    for k in range(problem.n_devices):
        d = problem.device(k)
        arrays[f"x{k}"], arrays[f"y{k}"] = d.X_train.astype(np.float32), d.y_train.astype(np.int64)
    path = folder / "devices.npz"
    np.savez(path, **arrays)
    return path


def images(folder: Path) -> Path:
    """MNIST-format files: the real t10k set if this checkout has it, else random images of its shape."""
    real = HERE.parents[1] / "shared" / "data" / "mnist-t10k"
    if (real / "t10k-images-idx3-ubyte.gz").is_file():
        return real
    import gzip
    import struct

    g = np.random.default_rng(0)
    with gzip.open(folder / "t10k-images-idx3-ubyte.gz", "wb") as f:
        f.write(struct.pack(">4i", 2051, 10000, 28, 28) + g.integers(0, 256, 10000 * 784, dtype=np.uint8).tobytes())
    with gzip.open(folder / "t10k-labels-idx1-ubyte.gz", "wb") as f:
        f.write(struct.pack(">2i", 2049, 10000) + g.integers(0, 10, 10000, dtype=np.uint8).tobytes())
    return folder


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--flower-python", help="python of a venv with flwr[simulation] (optional)")
    parser.add_argument("--flower-rounds", type=int, default=30)
    parser.add_argument("--against", type=Path, help="another checkout: time both round overheads side by side")
    parser.add_argument("--repeats", type=int, default=5, help="with --against: runs of each checkout")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="edgefed-e2e-") as folder:
        if args.against:
            compare_trees(args, Path(folder))
        else:
            measure(args, Path(folder))


def compare_trees(args, tmp: Path) -> None:
    """Round overhead of this checkout and args.against, run in alternation."""
    trees = {"this checkout": HERE.parent, str(args.against): args.against.resolve()}
    print(f"# {platform.machine()}, {os.cpu_count()} cores; load average before: {os.getloadavg()[0]:.2f}")
    for tree in trees.values():
        env = {**clean_env(), "PYTHONPATH": str(tree)}
        subprocess.run([sys.executable, "-m", "edgefed", "warmup", "--models", "logreg", "--dtypes", "float32"],
                       check=True, capture_output=True, env=env)
    common = [*sum((["--set", s] for s in WORKLOAD), []), "--set", f"rounds={args.rounds}",
              "--set", f"log.eval_every={args.rounds}", "--force"]  # not --quiet: the round lines are the clock
    modes = [("simulator", None)] + ([("mpirun -n 3", 3)] if MPIEXEC else [])
    times = {(name, mode): [] for name in trees for mode, _ in modes}
    for _ in range(args.repeats):
        for mode, ranks in modes:
            for name, tree in trees.items():
                r = timed_run([*common, "--out", str(tmp / "r.h5")], ranks, tree)
                times[(name, mode)].append(r["per_round_ms"])
    print(f"\n## Round overhead, side by side: 10 devices x 5 logistic-regression steps, {args.rounds} rounds, "
          f"median of {args.repeats} alternating runs (ms per round)\n")
    names = list(trees)
    print(f"| mode | {names[0]} | {names[1]} | ratio |\n| --- | --- | --- | --- |")
    for mode, _ in modes:
        a, b = (float(np.median(times[(n, mode)])) for n in names)
        print(f"| {mode} | {a:.2f} | {b:.2f} | {a / b:.3f} |")
    print(f"\n# load average after: {os.getloadavg()[0]:.2f}")


def measure(args, tmp: Path) -> None:
    print(f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    subprocess.run([sys.executable, "-m", "edgefed", "warmup", "--models", "logreg,mlp", "--dtypes", "float32"],
                   check=True, capture_output=True, env=clean_env())
    common = [*sum((["--set", s] for s in WORKLOAD), []), "--set", f"rounds={args.rounds}",
              "--set", f"log.eval_every={args.rounds}", "--force"]
    rows = []
    sim = timed_run([*common, "--out", str(tmp / "sim.h5")])
    rows.append(("edgefed simulator", sim))
    if MPIEXEC:
        mpi = timed_run([*common, "--out", str(tmp / "mpi.h5")], ranks=3)
        rows.append(("edgefed mpirun -n 3", mpi))
    flower = None
    if args.flower_python:
        data = flower_data(tmp)
        done = subprocess.run([args.flower_python, str(HERE / "flower_baseline.py"), "--data", str(data),
                               "--rounds", str(args.flower_rounds), "--steps", "5", "--batch", "20", "--lr", "0.05"],
                              capture_output=True, text=True, env=clean_env())
        if done.returncode == 0:
            flower = json.loads(done.stdout.strip().splitlines()[-1])
        else:
            print(f"# Flower failed: {done.stderr.strip().splitlines()[-1:]}")
    print(f"\n## Round overhead: 10 devices x 5 logistic-regression steps, {args.rounds} rounds\n")
    print("| runtime | start to first round (s) | per round (ms) | median round (ms) | peak RSS (private) per process, MB |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in rows:
        mem = ", ".join(f"{k} {v[0]:.0f} ({v[1]:.0f})" for k, v in sorted(r["peak_mb"].items()))
        print(f"| {name} | {r['first_round_s']:.2f} | {r['per_round_ms']:.2f} | {r['median_round_ms']:.2f} | {mem} |")
    if flower:
        print(f"| Flower {flower['flwr']} simulation (Ray {flower['ray']}), {flower['rounds']} rounds | "
              f"{flower['start_to_first_round_s']:.2f} | {flower['per_round_ms']:.1f} | "
              f"{np.median(flower['per_round_ms_list']):.1f} | - |")
        print(f"\nFlower / edgefed simulator per round: {flower['per_round_ms'] / sim['per_round_ms']:.0f}x; "
              f"Flower's clients computed {flower['client_compute_ms_per_round']:.1f} ms per round; "
              f"its loss {flower['initial_loss']:.3f} -> {flower['final_loss']:.3f}")

    if MPIEXEC:
        folder = images(tmp)
        mlp = timed_run(["--set", 'data.kind="mnist"', "--set", f'data.path="{folder}"', "--set", "data.clients=10",
                         "--set", 'model.kind="mlp"', "--set", "rounds=3", "--set", 'train.clients_per_round="all"',
                         "--out", str(tmp / "mlp.h5"), "--force"], ranks=2)
        print("\n## Resident memory with the 2NN (mpiexec -n 2: coordinator + one device rank hosting 10 devices, "
              "8,000 images; RSS and, in brackets, private memory: RSS less mapped library code)\n\n"
              + ", ".join(f"{k}: {v[0]:.0f} MB ({v[1]:.0f} MB)" for k, v in sorted(mlp["peak_mb"].items())))

    print("\n## Simulated devices: every device every round, 5 logistic-regression steps, 20 rounds\n")
    print("| devices | start to first round (s) | per round (ms) | per device per round (ms) | peak RSS (private), MB |")
    print("| --- | --- | --- | --- | --- |")
    for n in (100, 300, 1000):
        r = timed_run(["--set", f"data.clients={n}", "--set", 'train.clients_per_round="all"', "--set",
                       "train.local_steps=5", "--set", "rounds=20", "--set", "log.eval_every=20",
                       "--out", str(tmp / f"n{n}.h5"), "--force"])
        print(f"| {n} | {r['first_round_s']:.2f} | {r['per_round_ms']:.1f} | {r['per_round_ms'] / n:.3f} | "
              f"{r['peak_mb']['process'][0]:.0f} ({r['peak_mb']['process'][1]:.0f}) |")
    print(f"\n# load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
