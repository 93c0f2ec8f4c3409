"""Differential privacy for partial work: accuracy against epsilon, and what the distributed mechanism
costs a device inside a deadline.

    python benchmarks/privacy.py accuracy [--seeds 0 1] [--rounds 100] [--adaptive]
    python benchmarks/privacy.py cost     [--models logreg 2nn cnn] [--repeats 20]

- accuracy: SYNTHETIC(1,1), 300 devices, 30 a round (q = 0.1), K = 20, lr 0.05, under the 8 built-in
  participation traces (trace mode: partial and lost work), clip C = 0.5 (about a quarter of the
  contributions are cut without noise), central noise with z = 0.3 .. 3 beside no privacy, each with
  Schemes B and C and FedNova; epsilon after the rounds at delta = 1 / N^1.1. --adaptive: C follows the
  median norm (Andrew et al.) from 0.5, the count's noise sigma_b = max(1.5, z) (S / 20 = 1.5).
- cost: a device's masked input under secure aggregation with and without its share of the noise
  (privacy.mechanism = "distributed": clip a_k Delta_k, add N(0, z^2 C^2 / t)), at each model's size, on
  this machine, in milliseconds and in local steps of that model (what a deadline loses to it); then on
  the Raspberry Pi profiles, estimated: this machine's added time times how much slower the board's
  profile runs a logistic-regression step, in that board's steps of each model (the profiles are
  estimates themselves; run this on a board for its own numbers).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from edgefed import config as config_mod
from edgefed.hwprofile import load_profile
from edgefed.orchestration import run as runs
from edgefed.orchestration.profiling import steps_per_second
from edgefed.runlog import read_run
from edgefed.runtime.secure import SecureDevices

SCHEMES = ("B", "C", "fednova")
NOISE = (None, 0.3, 0.5, 1.0, 2.0, 3.0)
MODELS = {"logreg": ("logreg", 20), "2nn": ("mlp", 10), "cnn": ("cnn", 10)}
MODELS_D = {"logreg": 610}
BOARDS = ("pi-zero-2w", "pi3b-plus", "pi4b", "pi5")


def accuracy(args, folder: Path) -> None:
    print("| z | epsilon | " + " | ".join(f"{s}: final accuracy" for s in SCHEMES) + " | clipped |\n|"
          + " --- |" * (len(SCHEMES) + 3))
    for z in NOISE:
        cells, eps, clipped = [], float("nan"), []
        for scheme in SCHEMES:
            finals = []
            for seed in args.seeds:
                overrides = ["data.clients=300", "train.clients_per_round=30", f"rounds={args.rounds}",
                             'participation.mode="trace"', 'participation.trace="builtin"',
                             f'participation.scheme="{scheme}"', f"seed={seed}", "log.eval_every=10", "log.every=1000"]
                if z is not None:
                    overrides += ['privacy.mechanism="central"', "privacy.clip=0.5", f"privacy.noise_multiplier={z}"]
                    if args.adaptive:  # C from the median of the norms, the count's noise S / 20 (or 2z/3 more)
                        overrides += ["privacy.adaptive_clip=true", f"privacy.quantile_noise={max(1.5, z)}"]
                runs.run(config_mod.load_config(None, overrides), folder / "r.h5", force=True)
                log = read_run(folder / "r.h5")
                finals.append(log["metrics/test_accuracy"][-1])
                if z is not None:
                    eps = log["metrics/epsilon"][-1]
                    applied = log["participation/coeff"] != 0
                    clipped.append(log["participation/clipped"][applied].mean())
            cells.append(f"{np.mean(finals):.4f} ± {np.std(finals):.4f}")
        label = "none" if z is None else f"{z:g}"
        share = "-" if not clipped else f"{np.mean(clipped):.0%}"
        print(f"| {label} | {'∞ (no privacy)' if z is None else f'{eps:.2f}'} | " + " | ".join(cells)
              + f" | {share} |", flush=True)


def cost(args, folder: Path) -> None:
    print("| model | d | masked input ms | with its noise share ms | added ms | added, in local steps |\n"
          "| --- | --- | --- | --- | --- | --- |")
    added, here_logreg = {}, steps_per_second("logreg", MODELS["logreg"][1])[1]
    secagg = SimpleNamespace(neighbours=None, threshold=None, bits=32, clip=10.0, key_source="seeded")
    for name in args.models:
        kind, batch = MODELS[name]
        model, rate = steps_per_second(kind, batch)
        d = model.n_trainable
        times = {}
        for private in (None, SimpleNamespace(clip=1.0, noise_multiplier=1.0, noise_source="seeded")):
            best = np.inf
            for r in range(1, args.repeats + 1):
                devices = SecureDevices(secagg, 0, "C", d, np.arange(5), private)  # five devices, all hosted here
                devices.deliver(r, devices.shares(r, devices.keys(r, np.arange(5))))
                update = np.random.default_rng(r).normal(size=d).astype(np.float32)
                client = devices.client(r, 0)
                client.prepare_mask()  # before the work, as a device does: not part of what the deadline pays
                t0 = time.perf_counter()
                devices.mask(client, update, 1.0, 10, 20)
                best = min(best, time.perf_counter() - t0)
            times[private is None] = best
        plain, noised = times[True], times[False]
        added[name] = (noised - plain, d, kind, batch)
        print(f"| {name} | {d:,} | {plain * 1e3:.3f} | {noised * 1e3:.3f} | {(noised - plain) * 1e3:.3f} | "
              f"{(noised - plain) * rate:.2f} |", flush=True)
    # the boards: this machine's added time scaled by how much slower the board's profile runs a logreg
    # step (a small, cache-resident loop, like the generator's), then counted in the board's steps of each model
    print("\n| board | " + " | ".join(f"{n}: added ms (in its steps)" for n in added) + " |\n|"
          + " --- |" * (len(added) + 1))
    for board in BOARDS:
        profile = load_profile(board)
        slower = here_logreg * profile.step_seconds("logreg", MODELS["logreg"][1], MODELS_D["logreg"])
        cells = []
        for name, (seconds, d, kind, batch) in added.items():
            there = seconds * slower
            cells.append(f"{there * 1e3:.2f} ({there / profile.step_seconds(kind, batch, d):.2f})")
        print(f"| {profile.name} | " + " | ".join(cells) + " |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=["accuracy", "cost"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--adaptive", action="store_true", help="accuracy: adaptive clipping from C_0 = 0.5")
    args = parser.parse_args()
    print(f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; command: "
          f"python benchmarks/privacy.py {' '.join(sys.argv[1:])}\n")
    with tempfile.TemporaryDirectory() as tmp:
        {"accuracy": accuracy, "cost": cost}[args.experiment](args, Path(tmp))


if __name__ == "__main__":
    main()
