"""Fine-tuning with frozen convolutions beside training every layer: per-step time as logged, bytes up a
round, steps inside one deadline on a simulated Pi 4 cluster, and time to an accuracy on the federation clock.

    python benchmarks/finetune.py [--rounds 30] [--target 0.8] [--quick]

Digits (examples/data/digits.npz, 8 x 8): the CNN of examples/digits-cnn.toml is trained as one device on
the digits 0-4 (the "pretrained" model, exported with `edgefed export --weights`), then fine-tuned by 20
devices (Dirichlet(0.5) label skew, 10 a round, 20 local steps of 16) on the digits 5-9, four ways: its two
convolutions frozen with their outputs cached (the default), the same without the cache, every layer trained
from the pretrained weights, and every layer trained from scratch. The samples are scaled by 1/16 in both
files (one normalization for both halves). Then the same four under a deadline on the simulated clock of a
Pi 4 cluster: each model's steps per second measured here (`edgefed profile`'s measurement, one thread)
times the ratio of the shipped pi4b profile's CNN speed to the x86-64-laptop profile's (an estimate, as
those profiles are), a deadline of 5 full-network steps for everyone, Scheme B.

CIFAR-10 shapes: the CNN of examples/cifar10-cnn.toml (conv 5x5 32, pool, conv 5x5 64, pool, dense 512,
dense 10) on random 3 x 32 x 32 samples (the step's cost does not depend on the pixels), 4 devices x 2
rounds x 25 steps of 20: its convolutions frozen with cached features against every layer trained. Target:
>= 5x per step as logged.

Runtime: about 15 s with the kernels cached (--quick: 10 rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[var] = "1"

import numpy as np  # noqa: E402

from edgefed import hwprofile  # noqa: E402
from edgefed.cli import main as edgefed  # noqa: E402
from edgefed.config import load_config  # noqa: E402
from edgefed.orchestration import run as runs  # noqa: E402
from edgefed.orchestration.profiling import CONFIG, speed_entry, steps_per_second  # noqa: E402
from edgefed.runlog import read_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DIGITS_CNN = ('{type = "conv2d", out = 16, kernel = 3%s}, {type = "relu"}, {type = "maxpool2d", size = 2}, '
              '{type = "conv2d", out = 32, kernel = 3%s}, {type = "relu"}, {type = "global_avgpool"}, '
              '{type = "dropout", rate = 0.1}, {type = "dense", out = 10}')
CIFAR_CNN = ('{type = "conv2d", out = 32, kernel = 5%s}, {type = "relu"}, {type = "maxpool2d", size = 2}, '
             '{type = "conv2d", out = 64, kernel = 5%s}, {type = "relu"}, {type = "maxpool2d", size = 2}, '
             '{type = "flatten"}, {type = "dense", out = 512}, {type = "relu"}, {type = "dense", out = 10}')
FROZEN = ", trainable = false"
ARMS = {  # name -> (convolutions frozen, from the pretrained weights, cache_features)
    "frozen convs, cached features": (True, True, True),
    "frozen convs, no cache": (True, True, False),
    "every layer, from pretrained": (False, True, True),
    "every layer, from scratch": (False, False, True),
}


def halves(folder: Path) -> tuple[Path, Path]:
    """The digits 0-4 and 5-9 as two arrays files, each sample scaled by 1/16 (digits' pixels are 0..16)."""
    d = np.load(ROOT / "examples" / "data" / "digits.npz")
    paths = []
    for name, keep in (("pre", lambda y: y < 5), ("fine", lambda y: y >= 5)):
        tr, te = keep(d["y_train"]), keep(d["y_test"])
        path = folder / f"{name}.npz"
        np.savez(path, x_train=d["x_train"][tr] / np.float32(16), y_train=d["y_train"][tr],
                 x_test=d["x_test"][te] / np.float32(16), y_test=d["y_test"][te])
        paths.append(path)
    return paths[0], paths[1]


def config(folder: Path, name: str, data: Path, layers: str, frozen: bool, weights: Path | None, cache: bool,
           body: str, clients: int = 20, partition: str = "dirichlet") -> Path:
    net = layers % ((FROZEN, FROZEN) if frozen else ("", ""))
    model = f'kind = "sequential"\nlayers = [{net}]\ncache_features = {str(cache).lower()}\n'
    model += f'weights = "{weights}"\n' if weights else ""
    path = folder / f"{name}.toml"
    path.write_text(f'seed = 0\n{body}\n[data]\nkind = "arrays"\npath = "{data}"\nclasses = 10\n'
                    f'clients = {clients}\npartition = "{partition}"\n[model]\n{model}')
    return path


def per_step_ms(log) -> float:
    """Median over the device-rounds of elapsed_s / steps, as the log has them."""
    steps, elapsed = log["participation/steps"], log["participation/elapsed_s"]
    done = steps > 0
    return float(np.median(elapsed[done] / steps[done]) * 1e3)


def first_at(log, target: float) -> tuple[str, str]:
    acc = log["metrics/test_accuracy"]
    hits = np.flatnonzero(acc >= target)
    if not hits.size:
        return "not reached", ""
    return str(int(hits[0])), f"{log['metrics/clock_s'][hits[0]] * 1e3:.1f}"


def pi4_ratio() -> float:
    """The pi4b profile's CNN speed over the x86-64-laptop profile's (batch 10)."""
    speed = {}
    for name in ("pi4b", "x86-64-laptop"):
        p = hwprofile.load_profile(name)
        speed[name] = next(s.steps_per_s for s in p.speeds if s.model == "cnn" and s.batch == 10)
    return speed["pi4b"] / speed["x86-64-laptop"]


def digits(folder: Path, rounds: int, target: float) -> None:
    pre, fine = halves(folder)
    body = "rounds = 40\n[train]\nclients_per_round = 1\nlocal_steps = 20\nbatch_size = 16\nlr_local = 0.2\n"
    path = config(folder, "pretrain", pre, DIGITS_CNN, False, None, True, body, clients=1, partition="iid")
    runs.run(load_config(path), folder / "pretrain.h5")
    pretrained = read_run(folder / "pretrain.h5")
    with contextlib.redirect_stdout(io.StringIO()):  # (the printed module)
        assert edgefed(["export", str(folder / "pretrain.h5"), "--weights", str(folder / "pre.npz"), "--force"]) == 0
    print(f"\nPretrained as one device on the digits 0-4 (40 rounds x 20 steps of 16): test accuracy "
          f"{pretrained['metrics/test_accuracy'][-1]:.3f} on 0-4; exported to pre.npz\n")
    fed = (f"rounds = {rounds}\n[train]\nclients_per_round = 10\nlocal_steps = 20\nbatch_size = 16\n"
           "lr_local = 0.2\n")
    print(f"Fine-tuned on the digits 5-9 by 20 devices, {rounds} rounds (FedAvg, 10 a round, 20 steps of 16, "
          f"lr 0.2)\n")
    print("| arm | d (trained) | frozen | per step, as logged (ms) | bytes up a round | accuracy at round 0 | "
          f"final accuracy | round to {target:.0%} |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    paths = {}
    for name, (frozen, start, cache) in ARMS.items():
        paths[name] = config(folder, f"arm{len(paths)}", fine, DIGITS_CNN, frozen, folder / "pre.npz" if start else None,
                             cache, fed)
        runs.run(load_config(paths[name]), folder / f"{paths[name].stem}.h5")
        log = read_run(folder / f"{paths[name].stem}.h5")
        up = log["participation/bytes_up"].sum(axis=1).mean()
        frozen_n = log["model/frozen"].size if "model/frozen" in log else 0
        acc = log["metrics/test_accuracy"]
        print(f"| {name} | {log['trajectory/x'].shape[1]:,} | {frozen_n:,} | {per_step_ms(log):.3f} | {up:,.0f} | "
              f"{acc[0]:.3f} | {acc[-1]:.3f} | {first_at(log, target)[0]} |")

    # the same under a deadline on a simulated Pi 4 cluster
    ratio = pi4_ratio()
    # (the uncached arm has the cached one's layer list, so one profile entry, which times the cached steps)
    paths = {name: path for name, path in paths.items() if name != "frozen convs, no cache"}
    speeds = {}
    for name, path in paths.items():
        model, sps = steps_per_second(CONFIG + str(path), 16)
        speeds[name] = speed_entry(model, 16, sps * ratio)
    entries = {(e["model"], e.get("layers")): e for e in speeds.values()}
    profile = {"format": 1, "name": "Pi 4 (this machine's speeds x the pi4b/laptop ratio)", "measured": False,
               "machine": {"arch": "aarch64", "cores": 4, "memory_mb": 4096}, "speed": list(entries.values())}
    board = folder / "pi4-estimate.toml"
    board.write_text(hwprofile.profile_toml(profile))
    full_step = 1.0 / speeds["every layer, from pretrained"]["steps_per_s"]
    deadline = 5 * full_step
    print(f"\nUnder a deadline on a simulated Pi 4 cluster: each model's speed measured here x {ratio:.3f} (the pi4b "
          f"profile's CNN speed over the laptop profile's); deadline {deadline * 1e3:.1f} ms = 5 full-network steps, "
          "20 asked for, Scheme B; the clock counts the steps' time only\n")
    print(f"| arm | Pi 4 steps/s (estimated) | steps done a round (mean of the selected) | final accuracy | "
          f"round to {target:.0%} | clock there (ms) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, path in paths.items():
        text = path.read_text().replace("[model]", '[participation]\nmode = "deadline"\nclock = "simulated"\n'
                                         f'deadline_s = {deadline:.6f}\nscheme = "B"\n[device]\nprofile = "{board}"\n'
                                         "[model]")
        dpath = folder / f"{path.stem}-deadline.toml"
        dpath.write_text(text)
        runs.run(load_config(dpath), folder / f"{dpath.stem}.h5")
        log = read_run(folder / f"{dpath.stem}.h5")
        steps = log["participation/steps"][log["participation/selected"]]
        at, clock = first_at(log, target)
        print(f"| {name} | {speeds[name]['steps_per_s']:.1f} | {steps.mean():.1f} | "
              f"{log['metrics/test_accuracy'][-1]:.3f} | {at} | {clock} |")


def cifar(folder: Path) -> None:
    g = np.random.default_rng(0)
    data = folder / "cifar-shaped.npz"
    np.savez(data, x_train=g.random((800, 3, 32, 32), dtype=np.float32), y_train=g.integers(0, 10, 800))
    body = "rounds = 2\n[train]\nclients_per_round = 4\nlocal_steps = 25\nbatch_size = 20\nlr_local = 0.01\n"
    print("\nCIFAR-10 shapes (random 3 x 32 x 32 samples), the CNN of examples/cifar10-cnn.toml, 4 devices x 2 rounds "
          "x 25 steps of 20\n")
    print("| arm | d (trained) | per step, as logged (ms) | vs every layer |")
    print("| --- | ---: | ---: | ---: |")
    results = {}
    for name, frozen, cache in (("every layer", False, True), ("frozen convs, no cache", True, False),
                                ("frozen convs, cached features", True, True)):
        path = config(folder, f"cifar{len(results)}", data, CIFAR_CNN, frozen, None, cache, body, 4, "iid")
        runs.run(load_config(path), folder / f"{path.stem}.h5")
        log = read_run(folder / f"{path.stem}.h5")
        results[name] = per_step_ms(log)
        print(f"| {name} | {log['trajectory/x'].shape[1]:,} | {results[name]:.2f} | "
              f"{results['every layer'] / results[name]:.1f}x |")
    print(f"\nTarget: frozen convolutions with cached features >= 5x faster per step: "
          f"{results['every layer'] / results['frozen convs, cached features']:.1f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--target", type=float, default=0.8, help="the test accuracy timed to (default 0.8)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    t0 = time.perf_counter()
    print(f"command: {shlex.join([sys.executable] + sys.argv)}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, one thread")
    with tempfile.TemporaryDirectory() as tmp:
        digits(Path(tmp), 10 if args.quick else args.rounds, args.target)
        cifar(Path(tmp))
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
