"""McMahan et al.'s Shakespeare experiment on the plays, scaled to one machine: rounds to a test accuracy for
FedSGD and FedAvg with one device per speaking role, then FedAvg under a deadline on a simulated Pi cluster
with Schemes B and C.

    python tools/leaf_shakespeare.py PLAYS/ /tmp/leaf-shakespeare
    python benchmarks/shakespeare.py /tmp/leaf-shakespeare [--roles 100] [--every 20] [--target 0.3]

The paper (McMahan et al. 2017, Table 2): 1,146 roles, C = 0.1, the character LSTM (charlstm), non-IID by
role; FedSGD (E = 1, B = infinity) needs 3,906 rounds to 54 % test accuracy, FedAvg (E = 5, B = 10) 41. The
same on 3.5 million training windows is out of reach of two cores (FedAvg's round alone is about 170,000
local steps), so the run here is the paper's protocol on a slice of the corpus, said plainly in the output:
`--roles` roles drawn at random (seed 0) among those with a test sample, and of each role's 80-character
windows (LEAF slides them one character at a time) every `--every`-th kept, for training and test alike. The
LEAF folder is converted once to an arrays file of token ids (natural partition, one device per role).

Cells: FedSGD (batch_size = "full", one step a round), FedAvg (local_epochs = 5, batch 10), both C = 0.1 and
the paper's learning rate 1.47; then FedAvg with deadlines on the simulated clock of hw_profiles/pi4b (its
character-LSTM speed), three board speeds (1, 0.5, 0.25), the deadline the time of `--deadline-steps`
steps on the fastest, with Schemes B and C. Each: the first evaluated round at or above the target, the
federation clock there (the deadline cells), and the best accuracy.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PAPER = {"FedSGD": 3906, "FedAvg": 41}


def arrays_file(folder: Path, out: Path, roles: int, every: int) -> dict:
    """The slice of a LEAF Shakespeare folder as an arrays file of token ids; what it holds."""
    from edgefed.problems.text import letter_ids

    parts = {p: json.loads(next((folder / p).glob("*.json")).read_text()) for p in ("train", "test")}
    users = [u for u in parts["train"]["users"] if parts["test"]["user_data"].get(u, {}).get("x")]
    chosen = sorted(np.random.default_rng(0).choice(len(users), min(roles, len(users)), replace=False))
    arrays = {"x_train": [], "y_train": [], "device_train": [], "x_test": [], "y_test": []}
    for k, i in enumerate(chosen):
        for part in ("train", "test"):
            record = parts[part]["user_data"][users[i]]
            x, y = record["x"][::every], record["y"][::every]
            if not x:
                continue
            arrays[f"x_{part}"].append(letter_ids(x)[0])
            arrays[f"y_{part}"].append(letter_ids(y)[0][:, 0])
            if part == "train":
                arrays["device_train"].append(np.full(len(x), k))
    arrays = {key: np.concatenate(v) for key, v in arrays.items()}
    np.savez(out, **arrays)
    total = sum(len(parts["train"]["user_data"][u]["x"]) for u in users)
    return {"roles": len(chosen), "of": len(parts["train"]["users"]), "train": len(arrays["y_train"]),
            "test": len(arrays["y_test"]), "corpus_train": total}


def run(path: Path, sets: list[str], out: Path) -> tuple[dict, float]:
    from edgefed.runlog import read_run

    cmd = [sys.executable, "-m", "edgefed", "run", "--set", 'data.kind="arrays"', "--set", f'data.path="{path}"',
           "--set", 'data.partition="natural"', "--set", 'model.kind="charlstm"', *sum((["--set", s] for s in sets), []),
           "--out", str(out), "--force", "--quiet"]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return read_run(out), time.perf_counter() - start


def reached(log: dict, target: float) -> tuple[str, str, float]:
    acc = np.nan_to_num(log["metrics/test_accuracy"], nan=-1.0)
    hits = np.flatnonzero(acc >= target)
    if not hits.size:
        return "not reached", "", float(acc.max())
    return str(int(hits[0])), f"{float(log['metrics/clock_s'][hits[0]]):.0f} s", float(acc.max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("leaf", type=Path, help="a LEAF Shakespeare folder (tools/leaf_shakespeare.py)")
    parser.add_argument("--roles", type=int, default=100)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--target", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=60, help="FedAvg's rounds (FedSGD runs 10 times as many)")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--deadline-steps", type=int, default=25)
    parser.add_argument("--work", type=Path, default=Path("/tmp/edgefed-shakespeare"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / "shakespeare.npz"
    held = arrays_file(args.leaf, data, args.roles, args.every)
    print(f"{platform.node()} {platform.machine()} {platform.processor() or ''}; python {' '.join(sys.argv)}")
    print(f"corpus: {held['roles']} of {held['of']} roles, every {args.every}th window: {held['train']:,} training and "
          f"{held['test']:,} test windows (the paper: 1,146 roles, 3,564,579 training characters; the whole "
          f"folder: {held['corpus_train']:,} training windows of roles with a test sample)")
    common = ["train.clients_per_round=0.1", "train.lr_local=1.47", f"log.eval_every={args.eval_every}",
              "log.every=1000000"]
    from edgefed import hwprofile
    fast = hwprofile.load_profile("pi4b").step_seconds("charlstm", 10, 819920)
    cells = {
        "FedSGD": [f"rounds={10 * args.rounds}", 'train.batch_size="full"', "train.local_steps=1"],
        "FedAvg": [f"rounds={args.rounds}", "train.local_epochs=5", "train.batch_size=10"],
    }
    for scheme in ("B", "C"):
        cells[f"FedAvg, deadline, Scheme {scheme}"] = cells["FedAvg"] + [
            'participation.mode="deadline"', 'participation.clock="simulated"', 'device.profile="pi4b"',
            "device.speed=[1.0, 0.5, 0.25]", f"participation.deadline_s={args.deadline_steps * fast:.4f}",
            f'participation.scheme="{scheme}"']
    print(f"\n| run | rounds to {args.target:.0%} | clock there | best accuracy | wall | the paper (to 54 %) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, sets in cells.items():
        log, wall = run(data, common + sets, args.work / f"{name.replace(' ', '_').replace(',', '')}.h5")
        rounds, clock, best = reached(log, args.target)
        paper = PAPER.get(name.split(",")[0]) if "deadline" not in name else None
        print(f"| {name} | {rounds} | {clock} | {best:.3f} | {wall / 60:.1f} min | {paper or ''} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
