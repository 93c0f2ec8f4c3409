"""Data at the edge: the memory of every rank and the start-up of McMahan's Shakespeare on the 38 plays, two
checkouts side by side in one run, then the conversions.

    python tools/leaf_shakespeare.py PLAYS/ /tmp/plays
    git worktree add /tmp/before <commit>
    python benchmarks/data_edge.py /tmp/plays --before /tmp/before [--femnist /tmp/femnist]

The run (as issue 45 measured it): the default character LSTM, 2 rounds of FedAvg, 4 devices a round,
`log.eval_devices = 4`, given the LEAF folder itself. For each checkout, in the simulator and under
`mpiexec -n 3`: every process's peak resident memory (`/usr/bin/time -f %M` on every rank) and the seconds
from the command to its `MPI:` line (the world set up: data read, kernels warm) and to the end of round 0.
A first run of each checkout fills its caches (kernels, and after issue 45 the folder's converted copy), so
the timed runs start warm. Then, on this checkout only: `edgefed data convert` of the plays (peak, seconds),
and with --femnist a generated LEAF folder of FEMNIST-style numbers (500 users x 300 images of 784 values
k/255) converted and run under `mpiexec -n 3` (logreg, 2 rounds). Machine, commits and numbers are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parents[1]
TIMED = "/usr/bin/time"


def config(folder: Path, out: Path, extra: str = "") -> Path:
    path = out / "shakespeare.toml"
    path.write_text(f'rounds = 2\n[data]\nkind = "leaf"\npath = "{folder}"\n[train]\nclients_per_round = 4\n'
                    f"[log]\neval_devices = 4\n{extra}")
    return path


def command(checkout: Path, args: list[str], ranks: int | None) -> tuple[list[str], dict]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    python = [TIMED, "-f", "peak %M KB", sys.executable, "-m", "edgefed"]
    if ranks is None:
        return python + args, env
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    return [mpiexec, "-n", str(ranks), "-genv", "PYTHONPATH", str(checkout)] + python + args, env


def timed_run(checkout: Path, args: list[str], ranks: int | None = None) -> dict:
    """Peaks (MB, every process) and seconds to the MPI line, to round 0 and to the end."""
    cmd, env = command(checkout, args, ranks)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    marks, peaks, lines = {}, [], []
    for line in proc.stdout:
        now = time.perf_counter() - start
        lines.append(line)
        if line.startswith("MPI:"):
            marks["world_s"] = now
        if line.startswith("round 0/"):
            marks["round0_s"] = now
        found = re.match(r"peak (\d+) KB", line)
        if found:
            peaks.append(int(found.group(1)) / 1024)
    proc.wait()
    if proc.returncode != 0:
        raise SystemExit("".join(lines[-5:]))
    return {"peaks_mb": sorted(peaks), "end_s": time.perf_counter() - start, **marks,
            "last": next((ln.strip() for ln in reversed(lines) if ln.startswith("done:")), "")}


def femnist(folder: Path, users: int = 500, images: int = 300) -> float:
    """A LEAF folder of FEMNIST-style numbers (784 values k/255, labels 0..61), written a user at a time."""
    g = np.random.default_rng(0)
    start = time.perf_counter()
    for part, n in (("train", images), ("test", max(images // 10, 1))):
        (folder / part).mkdir(parents=True, exist_ok=True)
        with open(folder / part / "data.json", "w") as f:
            names = [f"f{k:04d}" for k in range(users)]
            f.write(json.dumps({"users": names, "num_samples": [n] * users})[:-1] + ', "user_data": {')
            for k, name in enumerate(names):
                x = (g.integers(0, 256, (n, 784)) / 255).tolist()
                y = g.integers(0, 62, n).tolist()
                f.write(("" if k == 0 else ", ") + json.dumps(name) + ": " + json.dumps({"x": x, "y": y}))
            f.write("}}\n")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plays", type=Path, help="the LEAF Shakespeare folder of the 38 plays")
    parser.add_argument("--before", type=Path, help="a checkout to measure beside this one")
    parser.add_argument("--femnist", type=Path, help="a folder for the generated FEMNIST-style LEAF data")
    parser.add_argument("--work", type=Path, default=Path("/tmp/edgefed-data-edge"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    commit = lambda path: subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"],  # noqa: E731
                                         capture_output=True, text=True).stdout.strip()
    print(f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"this checkout {commit(HERE)}" + (f", before {commit(args.before)}" if args.before else ""))
    cfg = config(args.plays, args.work)
    checkouts = [("before", args.before), ("after", HERE)] if args.before else [("after", HERE)]
    for name, checkout in checkouts:  # fill the caches: kernels, the folder's converted copy
        timed_run(checkout, ["run", str(cfg), "--out", str(args.work / f"warm-{name}.h5"), "--force", "--quiet"])
    for ranks in (None, 3):
        for name, checkout in checkouts:
            out = args.work / f"{name}-{ranks or 1}.h5"
            got = timed_run(checkout, ["run", str(cfg), "--out", str(out), "--force"], ranks)
            where = "simulator" if ranks is None else f"mpiexec -n {ranks}"
            print(f"{where:>13} {name:>6}: peak MB {', '.join(f'{p:.0f}' for p in got['peaks_mb'])}; "
                  f"world set up {got.get('world_s', float('nan')):.1f} s, round 0 at {got['round0_s']:.1f} s, "
                  f"end {got['end_s']:.1f} s | {got['last']}")
    out = args.work / "plays.h5"
    got = timed_run(HERE, ["data", "convert", str(args.plays), str(out), "--force"])
    print(f"data convert of the plays: peak {got['peaks_mb'][0]:.0f} MB, {got['end_s']:.1f} s, "
          f"{out.stat().st_size / 2**20:.0f} MB")
    if args.femnist:
        if not (args.femnist / "train" / "data.json").exists():
            print(f"FEMNIST-style folder written in {femnist(args.femnist):.0f} s")
        size = sum(p.stat().st_size for p in args.femnist.rglob("*.json")) / 2**20
        out = args.work / "femnist.h5"
        got = timed_run(HERE, ["data", "convert", str(args.femnist), str(out), "--force"])
        print(f"data convert of {size:.0f} MB of FEMNIST-style JSON: peak {got['peaks_mb'][0]:.0f} MB, "
              f"{got['end_s']:.1f} s, {out.stat().st_size / 2**20:.0f} MB")
        fem = args.work / "femnist.toml"
        fem.write_text(f'rounds = 2\n[data]\nkind = "arrays"\npath = "{out}"\n[model]\nkind = "logreg"\n'
                       "[train]\nclients_per_round = 10\n[log]\neval_devices = 10\n")
        got = timed_run(HERE, ["run", str(fem), "--out", str(args.work / "femnist-run.h5"), "--force"], 3)
        print(f"FEMNIST-style, mpiexec -n 3: peak MB {', '.join(f'{p:.0f}' for p in got['peaks_mb'])}; "
              f"end {got['end_s']:.1f} s | {got['last']}")


if __name__ == "__main__":
    main()
