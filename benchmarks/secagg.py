"""What secure aggregation costs a device and the coordinator, and what it takes from a deadline.

    python benchmarks/secagg.py cost     [--devices 17] [--neighbours 2 4 8 16] [--models logreg 2nn cnn]
    python benchmarks/secagg.py deadline [--model 2nn] [--deadline 0.3] [--rounds 3] [--repeats 3]  # MNIST t10k

- cost: one round of the protocol (edgefed/secagg/protocol.py, the code a run uses) for `devices` selected
  devices at each model size and neighbourhood k, in this process: per device the time to draw and publish
  its keys and seal its shares (setup), to expand its mask (before the work), to mask its update (after it)
  and to reveal shares; per round the coordinator's unmasking with no dropout and with one (t = the default
  ceil(2k/3) + 1, at most k, so that one is recoverable); the bytes each
  device sends. Beside it the same times on the Raspberry Pi profiles, scaled by the ratio of this machine's
  measured local-SGD speed for the model to the profile's (hw_profiles/: itself an estimate), and what the
  device's protocol time is in local steps of that model: the steps a deadline loses to it.
- deadline: the 2NN (or CNN) on MNIST with a fixed measured deadline that ends every device's work, 10
  devices, in the simulator, plain and with [secagg] (all linked, and k = 4): the steps each device
  completed per round and its protocol time (keys, shares and masks come out of the deadline).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from edgefed import config as config_mod
from edgefed.hwprofile import load_profile
from edgefed.orchestration import run as runs
from edgefed.orchestration.profiling import steps_per_second
from edgefed.runlog import read_run
from edgefed.secagg import protocol

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"logreg": ("logreg", 20), "2nn": ("mlp", 10), "cnn": ("cnn", 10)}  # name -> (profile kind, batch)
PROFILES = ("pi4b", "pi5", "pi-zero-2w")


def one_round(n: int, k: int, dim: int, dropped: int) -> dict:
    """Seconds of each phase (per device: mean over the devices; the server: the round) and bytes per device."""
    k = min(k, n - 1)  # t tolerates at least the one dropout measured: min(ceil(2k/3) + 1, k) of the k + 1 shares
    setup = protocol.round_setup(0, 1, np.arange(n), k, min(protocol.default_threshold(k), k), 32, 10.0, dim)
    t = {name: 0.0 for name in ("keys", "shares", "mask", "masking", "reveal")}
    clients = {}
    for dev in range(n):
        t0 = time.perf_counter()
        clients[dev] = protocol.Client(setup, dev, protocol.Randomness("os", 0, 1, dev))
        t["keys"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    keys = np.concatenate([c.advertise() for c in clients.values()])
    t["keys"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    shares = np.concatenate([c.share(keys) for c in clients.values()])
    t["shares"] += time.perf_counter() - t0
    for c in clients.values():
        c.receive(shares)
    update = np.random.default_rng(0).uniform(-1, 1, dim)
    survivors = list(range(dropped, n))
    total = np.zeros(setup.words, setup.word)
    for dev in survivors:
        c = clients[dev]
        t0 = time.perf_counter()
        c.prepare_mask()
        t1 = time.perf_counter()
        total += c.masked_input(update)
        t2 = time.perf_counter()
        t["mask"] += t1 - t0
        t["masking"] += t2 - t1
    t0 = time.perf_counter()
    reveals = np.concatenate([clients[dev].reveal(survivors) for dev in survivors])
    t["reveal"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    protocol.unmask(setup, keys, total, survivors, reveals)
    server = time.perf_counter() - t0
    per_device = {"keys": t["keys"] / n, "shares": t["shares"] / n, "mask": t["mask"] / len(survivors),
                  "masking": t["masking"] / len(survivors), "reveal": t["reveal"] / len(survivors)}
    sent = protocol.KEYS.itemsize + (len(setup.holders(0)) - 1) * protocol.SHARE.itemsize
    sent += len(setup.holders(0)) * protocol.REVEAL.itemsize
    return {**per_device, "server": server, "bytes": sent, "masked_bytes": setup.words * 4, "k": setup.neighbours[0].size,
            "t": setup.threshold}


def cost(args) -> None:
    print(f"## Secure aggregation: cost of one round, {args.devices} devices, 32-bit words\n")
    print(f"Machine: {platform.machine()}, {platform.processor() or platform.platform()}, {os.cpu_count()} cores; "
          f"`python benchmarks/secagg.py cost --devices {args.devices} --neighbours "
          f"{' '.join(map(str, args.neighbours))} --models {' '.join(args.models)}`\n")
    one_round(3, 2, 64, 0)  # the first calls into the library load it: not part of any row
    here = {}
    for name in args.models:
        kind, batch = MODELS[name]
        here[name] = steps_per_second(kind, batch)
    profiles = {p: load_profile(p) for p in PROFILES}
    print("| model | d | k | t | setup ms | mask ms | masking ms | reveal ms | device ms | steps lost "
          "| server ms (0 / 1 dropout) | protocol bytes | masked input bytes | " +
          " | ".join(f"{p} device ms" for p in PROFILES) + " |")
    print("| --- " * (13 + len(PROFILES)) + "|")
    for name in args.models:
        kind, batch = MODELS[name]
        dim, speed = here[name]
        for k in args.neighbours:
            a = one_round(args.devices, k, dim, 0)
            b = one_round(args.devices, k, dim, 1)
            device = a["keys"] + a["shares"] + a["mask"] + a["masking"] + a["reveal"]
            pis = []
            for p in profiles.values():
                theirs = next((s.steps_per_s for s in p.speeds if s.model == kind and s.batch == batch), None)
                pis.append("-" if theirs is None else f"{device * speed / theirs * 1e3:.1f}")
            print(f"| {name} | {dim} | {a['k']} | {a['t']} | {(a['keys'] + a['shares']) * 1e3:.2f} | "
                  f"{a['mask'] * 1e3:.2f} | {a['masking'] * 1e3:.2f} | {a['reveal'] * 1e3:.2f} | {device * 1e3:.2f} | "
                  f"{device * speed:.1f} | {a['server'] * 1e3:.1f} / {b['server'] * 1e3:.1f} | {a['bytes']} | "
                  f"{a['masked_bytes']} | " + " | ".join(pis) + " |")
    print("\nThis machine's local SGD: " + ", ".join(f"{n} {s:.0f} steps/s" for n, (_, s) in here.items()) +
          ". Steps lost: the device's protocol time in steps of its model (the same on every board if "
          "crypto and kernels scale alike).")


DEADLINE = """seed = 0
rounds = {rounds}
[data]
kind = "mnist"
path = "{mnist}"
clients = 10
[model]
{model}
[train]
clients_per_round = "all"
local_steps = {budget}
batch_size = 10
[participation]
mode = "deadline"
deadline_s = {deadline}
grace_s = 0.5
"""


def deadline(args) -> None:
    mnist = ROOT / "data" / "mnist"
    if not (mnist / "t10k-images-idx3-ubyte.gz").exists():
        sys.exit("put t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz in data/mnist/")
    model = 'kind = "mlp"\nhidden = [200, 200]' if args.model == "2nn" else 'kind = "cnn"'
    base = DEADLINE.format(rounds=args.rounds, mnist=mnist, deadline=args.deadline, model=model,
                           budget=100000)  # the deadline, never the budget, ends the work
    print(f"## Secure aggregation under a fixed deadline: {args.model} on MNIST, 10 devices, "
          f"deadline {args.deadline} s\n")
    print(f"`python benchmarks/secagg.py deadline --model {args.model} --deadline {args.deadline} --rounds "
          f"{args.rounds} --repeats {args.repeats}` ({platform.machine()}, {os.cpu_count()} cores, the simulator, measured clock)\n")
    print(f"Each setting run {args.repeats} times, interleaved (plain, all linked, k = 4, plain, ...), so a slow "
          "spell of the machine hits them alike; mean +- std over the repeats of the mean per device-round.\n")
    print("| run | steps per device-round | protocol s per device-round | steps its time is worth | test accuracy |")
    print("| --- | --- | --- | --- | --- |")
    settings = (("plain", ""), ("secagg, all linked", "[secagg]\nenabled = true\n"),
                ("secagg, k = 4", "[secagg]\nenabled = true\nneighbours = 4\n"))
    got = {label: [] for label, _ in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for label, extra in settings:
                path = Path(tmp) / "c.toml"
                path.write_text(base + extra)
                out = Path(tmp) / f"{rep}-{len(label)}.h5"
                runs.run(config_mod.load_config(str(path), []), out)
                log = read_run(out)
                sel = log["participation/selected"]
                steps = log["participation/steps"][sel]
                spent = log["participation/secagg_s"][sel].mean() if "participation/secagg_s" in log else 0.0
                rate = (steps / log["participation/elapsed_s"][sel]).mean()  # steps per second of work
                got[label].append((steps.mean(), spent, spent * rate, log["metrics/test_accuracy"][-1]))
    for label, rows in got.items():
        rows = np.array(rows)
        mean, std = rows.mean(axis=0), rows.std(axis=0)
        print(f"| {label} | {mean[0]:.1f} +- {std[0]:.1f} | {mean[1]:.4f} | {mean[2]:.1f} | {mean[3]:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--devices", type=int, default=17)
    c.add_argument("--neighbours", type=int, nargs="+", default=[2, 4, 8, 16])
    c.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    d = sub.add_parser("deadline")
    d.add_argument("--model", choices=("2nn", "cnn"), default="2nn")
    d.add_argument("--deadline", type=float, default=0.3)
    d.add_argument("--rounds", type=int, default=3)
    d.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cost(args) if args.what == "cost" else deadline(args)


if __name__ == "__main__":
    main()
