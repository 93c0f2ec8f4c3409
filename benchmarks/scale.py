"""A large simulated federation on one machine: wall time per round, start-up, peak memory and log bytes
per round as N grows from 10^5 to 10^7 devices (WORKLOAD: S = 100 a round, logistic regression on IID
SYNTHETIC(1,1), the metrics on a fixed sample of 1,000 devices where N is larger), with pfl-research's on the
same work beside it (--pfl).

    python benchmarks/scale.py [--devices 100000 1000000 10000000] [--set KEY=VALUE ...] [--pfl PYTHON]

(--set passes more settings to every run, e.g. `--set train.algorithm=\"scaffold\"` for SCAFFOLD's
per-device controls, held sparse.)

Each run is its own process (`edgefed run`), so its peak resident memory is its own (getrusage of the
child); its rounds are what `done: R rounds in T s` says (rounds 1..R), start-up the rest of its wall time
(the problem's sizes, the log, the kernels, the engine, evaluation of round 0).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


# the workload: IID SYNTHETIC, 100 devices a round, 5 local steps, 20 rounds, the metrics every 10
# rounds (on 1,000 devices where N is larger: evaluated_on)
WORKLOAD = ["data.iid=true", "train.clients_per_round=100", "train.local_steps=5", "rounds=20", "log.eval_every=10"]


def evaluated_on(n: int) -> list[str]:
    return ["log.eval_devices=1000"] if n > 1000 else []


def one(n: int, folder: Path, settings: list[str]) -> dict:
    out = folder / f"n{n}.h5"
    args = [sys.executable, "-m", "edgefed", "run", "--out", str(out), "--force", "--quiet", "--set", f"data.clients={n}"]
    for setting in [*settings, *evaluated_on(n)]:
        args += ["--set", setting]
    t0 = time.perf_counter()
    child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    said = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)  # this child's own peak, whatever ran before it
    wall = time.perf_counter() - t0
    if status:
        raise SystemExit(f"edgefed run failed:\n{said}")
    peak = usage.ru_maxrss / 1024  # MB
    found = re.search(r"done: (\d+) rounds in ([\d.]+) s", said)
    rounds, rounds_s = int(found.group(1)), float(found.group(2))
    return {"n": n, "wall": wall, "rounds_s": rounds_s, "ms_round": 1e3 * rounds_s / rounds, "peak_mb": peak,
            "log_mb": out.stat().st_size / 2 ** 20, "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--pfl", metavar="PYTHON", help="also run pfl-research's (benchmarks/pfl_scale.py) on the "
                        "same work with this interpreter, each N right after edgefed's")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each N, interleaved; the table has medians")
    args = parser.parse_args()
    settings = WORKLOAD + args.set
    print(f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; command: "
          f"python benchmarks/scale.py {' '.join(sys.argv[1:])}\n# workload: {' '.join(settings)}\n")
    print("| devices N | wall s | start-up s | ms a round | peak RSS MB | log MB | log KB a round |"
          + (" pfl start-up s | pfl ms a round | pfl peak RSS MB |" if args.pfl else "") + "\n"
          "| --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- | --- |" if args.pfl else ""))
    ours, theirs = {n: [] for n in args.devices}, {n: [] for n in args.devices}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):  # interleaved: a drift of the machine's speed touches every N alike
            for n in sorted(args.devices):
                ours[n].append(one(n, Path(tmp), settings))
                if args.pfl:
                    from pfl_scale import measure
                    theirs[n].append(measure(args.pfl, n, settings))
    for n in sorted(args.devices):
        r = {key: statistics.median(run[key] for run in ours[n]) for key in ours[n][0]}
        line = (f"| {n:,} | {r['wall']:.1f} | {r['wall'] - r['rounds_s']:.1f} | {r['ms_round']:.0f} | "
                f"{r['peak_mb']:.0f} | {r['log_mb']:.1f} | {1024 * r['log_mb'] / r['rounds']:.0f} |")
        if args.pfl:
            p = {key: statistics.median(run[key] for run in theirs[n]) for key in theirs[n][0]}
            line += f" {p['start']:.1f} | {p['ms_round']:.0f} | {p['peak_mb']:.0f} |"
        print(line, flush=True)

if __name__ == "__main__":
    main()
