"""The shipped Pi profiles as a virtual cluster on this machine (launch/virtual-cluster.sh), driven by the real
launcher (launch/pi-cluster.sh), against what the simulator predicts from the same profiles. Run as root:

    python benchmarks/virtual_cluster.py [--rounds 8] [--target 0.8] [--keep FOLDER]

Eight boards: pi5, pi4b, pi3b-plus and pi-zero-2w, each at CPU contention 0 and 0.5, one device each. This
machine is measured first (its sustained logistic-regression speed sets every board's quota) and again at
the end (this VM's speed drifts). Then, in one run:

0. `pi-cluster.sh profile` on the boards: each board's measured speed against its profile's (its quota's
   ground truth), all boards measuring at once as on a real cluster.
1. Steps per round per board: a deadline run (fixed deadline, K larger than any board completes) on the
   virtual cluster, beside the simulator on a simulated clock with each device at its board's speed relative
   to pi5 times (1 - contention): its prediction is min(K, floor(deadline v_k / t)) (docs/design.md 2.11).
2. `pi-cluster.sh trace` on the boards, then Schemes B, C and FedNova as deadline runs on the virtual
   cluster beside the simulator replaying the recorded traces (each device its board's trace; simulated
   clock at the same speeds): rounds and seconds to the target test accuracy.
3. Recovery: a board's link cut for longer than the rank timeout after round 4, then (the cluster as it
   was) a board stopped after round 4: the seconds from the fault to the rank declared lost, to the launcher's
   restart, and to the first round of the world without it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgefed import hwprofile  # noqa: E402

VIRTUAL = ROOT / "launch" / "virtual-cluster.sh"
PI_CLUSTER = ROOT / "launch" / "pi-cluster.sh"
PROFILES = ("pi5", "pi4b", "pi3b-plus", "pi-zero-2w")
LOADS = (0.0, 0.5)
# a cluster of its own names, addresses and state: a user's virtual cluster may be up beside it
NET = {"EDGEFED_VIRTUAL_NAME": "efbench", "EDGEFED_VIRTUAL_SUBNET": "10.234.0",
       "EDGEFED_VIRTUAL_STATE": "/run/edgefed-virtual-bench"}


def boards() -> list[tuple[str, str, float]]:
    return [(f"v{p.replace('-', '')}-{int(load * 100)}.local", p, load) for load in LOADS for p in PROFILES]


@functools.cache
def step_s(profile: str) -> float:
    return hwprofile.load_profile(profile).step_seconds("logreg", 20, 610)


def speeds() -> list[float]:
    """Each board's device speed relative to pi5's, contention included (a competitor at load L leaves 1 - L)."""
    return [step_s("pi5") / step_s(p) * (1 - load) for _, p, load in boards()]


def machine_speed(out: Path) -> float:
    """This machine's sustained logistic-regression steps per second, measured now (edgefed profile)."""
    subprocess.run([sys.executable, "-m", "edgefed", "profile", "--models", "logreg", "--no-cold", "--out", str(out),
                    "--force"], check=True, capture_output=True)
    return 1.0 / step_s(str(out))


def streamed(command: list[str], env: dict, on_line=None) -> tuple[int, list[tuple[float, str]]]:
    """Run, keeping every output line with its time; on_line(time, line) may act on it (a fault)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in proc.stdout:
        lines.append((time.monotonic(), line.rstrip("\n")))
        if on_line is not None:
            on_line(*lines[-1])
    return proc.wait(), lines


def config_file(folder: Path, name: str, rounds: int, local_steps: int, deadline_s: float, scheme: str = "B",
                traces: list[str] | None = None) -> Path:
    """A deadline run's config; with traces, the same run replaying them (device k the k-th) instead."""
    path = folder / f"{name}.toml"
    when = (f"mode = \"trace\"\ntrace = {json.dumps(traces)}\n" if traces else
            f"mode = \"deadline\"\ndeadline_s = {deadline_s}\n")
    path.write_text(f"rounds = {rounds}\n[data]\nclients = {len(boards())}\n[train]\nclients_per_round = \"all\"\n"
                    f"local_steps = {local_steps}\nlr_local = 0.001\n[participation]\n{when}scheme = \"{scheme}\"\n")
    return path


def virtual_run(folder: Path, env: dict, config: Path, log: Path, on_line=None) -> list[tuple[float, str]]:
    code, lines = streamed(["bash", str(PI_CLUSTER), "run", str(folder / "virtual.txt"), str(config), "--out",
                            str(log), "--force"], env, on_line)
    if code != 0:
        raise SystemExit("\n".join(line for _, line in lines[-30:]) + f"\nvirtual run {config.name}: exit {code}")
    return lines


def simulated_run(config: Path, log: Path, extra=()) -> None:
    sets = ['participation.clock="simulated"', 'device.profile="pi5"', f"device.speed={speeds()}", *extra]
    subprocess.run([sys.executable, "-m", "edgefed", "run", str(config), "--out", str(log), "--force", "--quiet",
                    *[a for s in sets for a in ("--set", s)]], check=True)


def to_target(log: Path, target: float) -> tuple[float, float]:
    with h5py.File(log) as f:
        acc, clock = f["metrics/test_accuracy"][()], f["metrics/clock_s"][()]
    hit = np.flatnonzero(acc >= target)
    return (float("nan"), float("nan")) if not hit.size else (float(hit[0]), float(clock[hit[0]]))


def profiled(folder: Path, env: dict) -> list[dict]:
    code, lines = streamed(["bash", str(PI_CLUSTER), "profile", str(folder / "virtual.txt"), "--models", "logreg",
                            "--no-cold", "--out", str(folder / "{host}.toml")], env)
    if code != 0:
        raise SystemExit("\n".join(line for _, line in lines[-30:]) + f"\nprofile: exit {code}")
    return [{"board": host, "profile": p, "measured": 1.0 / step_s(str(folder / f"{host.split('.')[0]}.toml")),
             "expected": 1.0 / step_s(p)} for host, p, load in boards() if load == 0.0]


def steps_per_board(folder: Path, env: dict, rounds: int) -> list[dict]:
    k, deadline = 100000, 0.5  # no board completes K in the deadline: its steps show its speed
    config = config_file(folder, "steps", rounds, k, deadline)
    virtual_run(folder, env, config, folder / "steps-virtual.h5")
    simulated_run(config, folder / "steps-simulated.h5")
    with h5py.File(folder / "steps-virtual.h5") as f:
        measured = f["participation/steps"][()]
    with h5py.File(folder / "steps-simulated.h5") as f:
        predicted = f["participation/steps"][()]
    return [{"board": host, "profile": p, "load": load, "measured": float(measured[:, i].mean()),
             "measured_std": float(measured[:, i].std()), "predicted": float(predicted[:, i].mean())}
            for i, (host, p, load) in enumerate(boards())]


def schemes(folder: Path, env: dict, rounds: int, target: float) -> tuple[list[dict], str]:
    k, deadline = 20000, 0.5
    traces = folder / "traces.csv"
    code, lines = streamed(["bash", str(PI_CLUSTER), "trace", str(folder / "virtual.txt"), str(traces), "--rounds",
                            str(rounds), "--local-steps", str(k), "--deadline-s", str(deadline), "--force", "--quiet"],
                           env)
    if code != 0:
        raise SystemExit("\n".join(line for _, line in lines[-30:]) + f"\ntrace record: exit {code}")
    shown = "\n".join(line for _, line in lines if not line.startswith("wrote"))
    names = [host for host, _, _ in boards()]
    rows = []
    for scheme in ("B", "C", "fednova"):
        config = config_file(folder, f"scheme-{scheme}", rounds, k, deadline, scheme)
        virtual_run(folder, env, config, folder / f"{scheme}-virtual.h5")
        replay = config_file(folder, f"replay-{scheme}", rounds, k, deadline, scheme, [f"{traces}#{n}" for n in names])
        simulated_run(replay, folder / f"{scheme}-replay.h5")
        row = {"scheme": scheme}
        for where in ("virtual", "replay"):
            r, s = to_target(folder / f"{scheme}-{where}.h5", target)
            with h5py.File(folder / f"{scheme}-{where}.h5") as f:
                final = float(f["metrics/test_accuracy"][-1])
            row |= {f"{where}_rounds": r, f"{where}_s": s, f"{where}_final": final}
        rows.append(row)
    return rows, shown


def recovery(folder: Path, env: dict, fault: str, host: str) -> dict:
    """One run of 12 rounds; after round 4 the fault on host; times from the fault."""
    config = config_file(folder, f"fault-{fault}", 12, 20000, 0.5)
    marks = {}

    def on_line(t, line):
        if line.startswith("round  4/") and "fault" not in marks:
            marks["fault"] = time.monotonic()
            if fault == "cut":  # in the background: the run goes on while the link is down
                subprocess.Popen(["bash", str(VIRTUAL), "cut", str(folder / "virtual.txt"), host, "15"], env=env)
            else:
                subprocess.run(["bash", str(VIRTUAL), "stop", str(folder / "virtual.txt"), host], env=env, check=True)
        elif "stopped answering" in line and "lost" not in marks:
            marks["lost"] = t
        elif line.startswith("launch: restart") and "restart" not in marks:
            marks["restart"] = t
        elif line.startswith("round ") and "restart" in marks and "resumed" not in marks:
            marks["resumed"] = t

    log = folder / f"fault-{fault}.h5"
    virtual_run(folder, env, config, log, on_line)
    said = subprocess.run([sys.executable, "-m", "edgefed", "summary", str(log)], capture_output=True, text=True).stdout
    return {"fault": fault, "host": host, **{f"{k}_s": marks[k] - marks["fault"] for k in ("lost", "restart", "resumed")
                                            if k in marks},
            "summary": [line for line in said.splitlines() if line.startswith(("launch restart", "/"))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--keep", type=Path, help="a folder to keep the logs and traces in")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("virtual_cluster.py: run as root (launch/virtual-cluster.sh makes namespaces and cgroups)")
    folder = args.keep or Path(tempfile.mkdtemp(prefix="edgefed-virtual-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    before = machine_speed(folder / "machine.toml")
    env = {**os.environ, **NET, "EDGEFED_MACHINE_PROFILE": str(folder / "machine.toml"),
           "VENV": str(Path(sys.executable).parents[1]), "PYTHONPATH": str(ROOT)}
    (folder / "boards.txt").write_text("head.local coordinator\n" + "".join(
        f"{host} {p} {load}\n" for host, p, load in boards()))
    started = time.monotonic()
    subprocess.run(["bash", str(VIRTUAL), "down", str(folder / "virtual.txt")], env=env, check=True)
    subprocess.run(["bash", str(VIRTUAL), "up", str(folder / "boards.txt"), str(folder / "virtual.txt")], env=env,
                   check=True)
    up_s = time.monotonic() - started
    try:
        speeds_measured = profiled(folder, env)
        steps = steps_per_board(folder, env, args.rounds)
        rows, traces = schemes(folder, env, 2 * args.rounds, args.target)
        faults = [recovery(folder, env, "cut", "vpi3bplus-0.local"), recovery(folder, env, "stop", "vpi4b-0.local")]
    finally:
        subprocess.run(["bash", str(VIRTUAL), "down", str(folder / "virtual.txt")], env=env)
    after = machine_speed(folder / "machine-after.toml")

    print(f"# {platform.machine()}, {os.cpu_count()} cores; this machine's logistic-regression step: {before:,.0f} "
          f"steps/s before, {after:,.0f} after; up took {up_s:.1f} s; logs in {folder}\n")
    print("## Each board's speed by `pi-cluster.sh profile` (logistic regression, steps/s)\n")
    print("| board | profile | measured | the profile's | gap |\n| --- | --- | --- | --- | --- |")
    for s in speeds_measured:
        print(f"| {s['board']} | {s['profile']} | {s['measured']:,.0f} | {s['expected']:,.0f} | "
              f"{s['measured'] / s['expected'] - 1:+.0%} |")
    print(f"\n## Steps per round per board (deadline 0.5 s, K = 100000; mean of {args.rounds} rounds)\n")
    print("| board | profile | contention | measured | predicted | gap |\n| --- | --- | --- | --- | --- | --- |")
    for s in steps:
        print(f"| {s['board']} | {s['profile']} | {s['load']:.1f} | {s['measured']:,.0f} ± {s['measured_std']:,.0f} | "
              f"{s['predicted']:,.0f} | {s['measured'] / s['predicted'] - 1:+.0%} |")
    print(f"\n## Recorded traces ({2 * args.rounds} rounds, K = 20000, deadline 0.5 s)\n\n```\n{traces}\n```\n")
    print(f"## Schemes to test accuracy {args.target} (virtual: deadline runs; replay: the simulator on the traces)\n")
    print("| scheme | virtual rounds | virtual s | virtual final | replay rounds | replay s (simulated) | replay final |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['scheme']} | {r['virtual_rounds']:.0f} | {r['virtual_s']:.1f} | {r['virtual_final']:.3f} | "
              f"{r['replay_rounds']:.0f} | {r['replay_s']:.1f} | {r['replay_final']:.3f} |")
    print("\n## Recovery (seconds from the fault)\n\n| fault | board | rank lost | launcher restarts | next round |\n"
          "| --- | --- | --- | --- | --- |")
    for f in faults:
        print(f"| {f['fault']} | {f['host']} | {f.get('lost_s', float('nan')):.1f} | {f.get('restart_s', float('nan')):.1f} "
              f"| {f.get('resumed_s', float('nan')):.1f} |")
    for f in faults:
        print("\n" + "\n".join(f["summary"]))
    (folder / "results.json").write_text(json.dumps({"profiled": speeds_measured, "steps": steps, "schemes": rows, "faults": faults,
                                                      "machine_before": before, "machine_after": after}, indent=1))


if __name__ == "__main__":
    main()
