"""A large simulated federation on one machine: wall time per round, start-up, peak memory and log bytes
per round as N grows from 10^3 to 10^6 devices (S = 100 a round, logistic regression on SYNTHETIC(1,1),
the metrics on a fixed sample of 1,000 devices where N is larger).

    python benchmarks/scale.py [--devices 1000 10000 100000 1000000] [--rounds 20] [--set KEY=VALUE ...]

(--set passes more settings to every run, e.g. `--set train.algorithm=\"scaffold\"` for SCAFFOLD's
per-device controls, held sparse.)

Each run is its own process (`edgefed run`), so its peak resident memory is its own (getrusage of the
child); start-up is its wall time less its rounds' (the problem's sizes, the log, the kernels, evaluation
of round 0).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one(n: int, rounds: int, folder: Path, extra: list[str]) -> dict:
    out = folder / f"n{n}.h5"
    args = [sys.executable, "-m", "edgefed", "run", "--out", str(out), "--force", "--quiet",
            "--set", f"data.clients={n}", "--set", "train.clients_per_round=100", "--set", f"rounds={rounds}"]
    if n > 1000:
        args += ["--set", "log.eval_devices=1000"]
    for setting in extra:
        args += ["--set", setting]
    t0 = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # MB: the largest child so far
    rounds_s = float(re.search(r"done: \d+ rounds in ([\d.]+) s", done.stdout + done.stderr).group(1))
    return {"n": n, "wall": wall, "rounds_s": rounds_s, "peak_mb": peak, "log_mb": out.stat().st_size / 2 ** 20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1000, 10_000, 100_000, 1_000_000])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    print(f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; command: "
          f"python benchmarks/scale.py {' '.join(sys.argv[1:])}\n")
    print("| devices N | wall s | start-up s | ms a round | peak RSS MB | log MB | log KB a round |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for n in sorted(args.devices):  # ascending: the children's peak is then this run's
            r = one(n, args.rounds, Path(tmp), args.set)
            print(f"| {n:,} | {r['wall']:.1f} | {r['wall'] - r['rounds_s']:.1f} | {1e3 * r['rounds_s'] / args.rounds:.0f} | "
                  f"{r['peak_mb']:.0f} | {r['log_mb']:.1f} | {1024 * r['log_mb'] / args.rounds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
