"""Soak: the 2NN on MNIST under `edgefed launch -n 8` for 500 rounds with random SIGKILLs of random ranks.

    python benchmarks/soak.py [--ranks 8] [--rounds 500] [--kills 3] [--seed 0] [--data data/mnist]

Three measurements, side by side on one machine:
1. killed: the launch with `--kills` SIGKILLs of random ranks (the coordinator included) at random rounds;
   its final log must equal the simulator's (every dataset but the measured ones and /launch);
2. per kill, the time it cost: from the kill until the log passes the round it had reached (detection,
   the world torn down, a new world started, data built, kernels loaded, the rounds redone);
3. undisturbed: the same launch without kills, every rank's resident memory at round 50 and at the end.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import psutil

from edgefed import config as config_mod
from edgefed.orchestration import run as runs
from edgefed.runlog import last_completed_round, measured, read_run
from edgefed.runtime.mpi.comm import outside_world_env


def overrides(args) -> list[str]:
    return [f"rounds={args.rounds}", 'data.kind="mnist"', f'data.path="{args.data}"', "data.clients=20",
            'data.partition="iid"', 'model.kind="mlp"', "train.clients_per_round=10", "train.local_steps=20",
            "train.batch_size=10", "train.lr_local=0.05", "log.every=50", "log.eval_every=25", f"seed={args.seed}"]


def ranks_of(tag: str) -> dict[int, psutil.Process]:
    out = {}
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("EDGEFED_SOAK") == tag and "PMI_RANK" in env:
            out[int(env["PMI_RANK"])] = proc
    return out


def launch(args, log: Path, tag: str) -> subprocess.Popen:
    env = outside_world_env()
    env["EDGEFED_SOAK"] = tag
    sets = [a for o in overrides(args) for a in ("--set", o)]
    return subprocess.Popen([sys.executable, "-m", "edgefed", "launch", "-n", str(args.ranks), "--restarts",
                             str(args.kills + 1), "--out", str(log), "--quiet", *sets], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def killed(args, folder: Path) -> tuple[Path, list[tuple[int, int, float]], float, str]:
    """The launch with kills: (log, [(rank, round at the kill, seconds it cost)], wall s, launcher's lines)."""
    rng = random.Random(args.seed)
    at = sorted(rng.sample(range(30, args.rounds - 30), args.kills))
    log, tag = folder / "killed.h5", uuid.uuid4().hex
    started = time.monotonic()
    proc = launch(args, log, tag)
    costs = []
    for target in at:
        while last_completed_round(log) < target and proc.poll() is None:
            time.sleep(0.01)
        ranks = ranks_of(tag)
        if not ranks:
            break
        rank = rng.choice(sorted(ranks))
        reached = last_completed_round(log)
        t0 = time.monotonic()
        ranks[rank].kill()
        while last_completed_round(log) <= reached and proc.poll() is None:
            time.sleep(0.01)
        costs.append((rank, reached, time.monotonic() - t0))
    out, _ = proc.communicate()
    return log, costs, time.monotonic() - started, out


def undisturbed(args, folder: Path) -> tuple[dict[int, tuple[float, float]], float]:
    """{rank: (RSS MB at round 50, RSS MB at the last round seen)} of a launch without kills, and its wall s."""
    log, tag = folder / "quiet.h5", uuid.uuid4().hex
    started = time.monotonic()
    proc = launch(args, log, tag)
    first, last = {}, {}
    while proc.poll() is None:
        done = last_completed_round(log)
        if done >= 50:
            for rank, p in ranks_of(tag).items():
                try:
                    rss = p.memory_info().rss / 2**20
                except psutil.Error:
                    continue
                first.setdefault(rank, rss)
                if done >= args.rounds - 10:
                    last[rank] = rss
        time.sleep(0.2)
    proc.communicate()
    return {r: (first[r], last[r]) for r in sorted(first) if r in last}, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default="data/mnist")
    args = parser.parse_args()
    if not Path(args.data).is_dir():
        sys.exit(f"soak: {args.data} holds no MNIST files; put the t10k IDX files there (see docs/reproduce.md)")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        sim = folder / "sim.h5"
        t0 = time.monotonic()
        runs.run(config_mod.load_config(None, overrides(args)), sim)
        sim_s = time.monotonic() - t0
        log, costs, killed_s, lines = killed(args, folder)
        memory, quiet_s = undisturbed(args, folder)
        a, b = read_run(sim), read_run(log)
        skip = measured(a["attrs"]) | measured(b["attrs"])
        differ = [k for k in sorted(set(a) | set(b)) if k != "attrs" and k not in skip
                  and not k.startswith(("launch/", "state/undo/"))
                  and not (k in a and k in b and np.array_equal(a[k], b[k], equal_nan=True))]
        restarts = b.get("launch/restarts", [])
    print(f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{args.ranks} ranks x {args.rounds} rounds of the 2NN (20 devices, 10 a round, K = 20, batch 10)")
    print(f"simulator {sim_s:.1f} s; launch with {len(costs)} kills {killed_s:.1f} s; without kills {quiet_s:.1f} s")
    print(f"final log equals the simulator's: {'yes' if not differ else 'NO, differs in ' + ', '.join(differ)}")
    print("| kill | rank | at round | seconds lost |\n| --- | --- | --- | --- |")
    for i, (rank, reached, cost) in enumerate(costs, 1):
        print(f"| {i} | {rank} | {reached} | {cost:.1f} |")
    print(f"restarts in the log: {len(restarts)}: " + "; ".join(
        f"round {r['round']}, {r['cause'].decode()}, ranks {r['ranks_before']} -> {r['ranks_after']}" for r in restarts))
    print("| rank | RSS at round 50 (MB) | at the end (MB) | growth |\n| --- | --- | --- | --- |")
    for rank, (start, end) in memory.items():
        print(f"| {rank} | {start:.1f} | {end:.1f} | {100 * (end - start) / start:+.1f} % |")
    for line in lines.splitlines():
        if line.startswith("launch:"):
            print("    " + line)


if __name__ == "__main__":
    main()
