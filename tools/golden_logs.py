#!/usr/bin/env python3
"""Golden run logs: record a fixed set of runs through the command line, and compare two recordings.

A change that must not move a bit (a refactor, a faster kernel with the same sums) is checked by recording
before and after and comparing every dataset that is not a measurement:

    python tools/golden_logs.py record /tmp/before --mnist DIR     # on the old commit
    python tools/golden_logs.py record /tmp/after --mnist DIR --replay /tmp/before/deadline.source.h5
    python tools/golden_logs.py compare /tmp/before /tmp/after

Every config runs in the simulator and under `mpiexec -n 3` (skipped without mpiexec). A deadline run is
timed, so it cannot be recorded twice alike: `record` makes one (`deadline.source.h5`) unless `--replay`
names an earlier one, and the golden logs replay it as a trace. DIR holds MNIST IDX files (the t10k pair is
enough): small real-image sets are cut from it for the 2NN and the CNN; without it those two are skipped.
Only the command line is used, so the script runs unchanged on any commit.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import h5py
import numpy as np

from edgefed.runtime.mpi.comm import local_mpiexec, outside_world_env

# Datasets that hold wall time, load or compilation: the only ones two runs of one config may differ in;
# where a log's clock is measured (attribute clock = "measured"), also the time it kept.
MEASURED = {"participation/elapsed_s", "participation/cpu_percent", "participation/cpu_freq_mhz",
            "participation/temperature_c", "participation/compiled", "metrics/round_elapsed_s"}
MEASURED_CLOCK = {"metrics/clock_s", "participation/comm_s", "participation/deadline_s", "participation/core"}
TIMED_ATTRS = {"created", "finished", "warmup_s", "warmup_compiled", "rank_memory_estimate_mb",
               "rank_board_memory_mb", "rank_peak_rss_mb"}  # (runlog.MEASURED_ATTRS, written out: the
# script records commits older than it)

SMALL = """seed = 3
rounds = 12
[data]
clients = 12
samples = "pareto"
[train]
clients_per_round = 5
local_steps = 10
"""

DYNAMICS = """[dynamics]
fast_reboot = true
[[dynamics.arrive]]
device = 5
round = 4
[[dynamics.depart]]
device = 2
round = 6
policy = "exclude"
[[dynamics.depart]]
device = 7
round = 8
policy = "include"
"""


def configs(source_deadline: Path, images: Path | None) -> dict[str, str | None]:
    """name -> config text (None: the built-in default)."""
    scaffold = SMALL.replace("[train]\n", '[train]\nalgorithm = "scaffold"\n')
    trace = '[participation]\nmode = "trace"\ntrace = "builtin"\nscheme = "{}"\n'
    out: dict[str, str | None] = {
        "default": None,
        "scaffold-I": scaffold + '[scaffold]\noption = "I"\ninit = "gradient"\n[log]\nclient_controls = true\n',
        "scaffold-I-full": scaffold + '[scaffold]\noption = "I"\ncontrol_gradient = "full"\n',
        "scaffold-II-f64": scaffold + '[model]\ndtype = "float64"\n[log]\nclient_controls = true\nevery = 4\n',
        "epochs-full-batch": SMALL.replace("local_steps = 10", 'local_epochs = 1\nbatch_size = "full"\n'
                                           'weighting = "uniform"\nlr_global = 0.7'),
        "dynamics-fedavg": SMALL.replace("[train]\n", '[train]\nweighting = "count_global"\nlr_schedule = '
                                         '"staircase"\nlr_local = 0.5\n') + DYNAMICS,
        "dynamics-scaffold": scaffold + '[scaffold]\ninit = "gradient"\n[log]\nclient_controls = true\n' + DYNAMICS
        + trace.format("C"),
        "trace-names": SMALL + '[participation]\nmode = "trace"\ntrace = ["cpu90", "bw-low", "cpu30"]\nscheme = "A"\n',
        "quadratic": "seed = 2\nrounds = 10\n[data]\nkind = \"quadratic\"\nclients = 8\ndim = 6\nnoise_std = 0.2\n"
                     '[train]\nclients_per_round = 3\nalgorithm = "scaffold"\n[scaffold]\noption = "I"\n',
    }
    for scheme in "ABC":
        out[f"scheme-{scheme}"] = SMALL + trace.format(scheme)
        out[f"deadline-replay-{scheme}"] = (SMALL.replace("local_steps = 10", "local_steps = 400") +
                                             f'[participation]\nmode = "trace"\ntrace = "{source_deadline}"\n'
                                             f'scheme = "{scheme}"\n')
    out["deadline-replay-scaffold"] = out["deadline-replay-C"].replace(
        "[train]\n", '[train]\nalgorithm = "scaffold"\n')
    examples = Path(__file__).resolve().parents[1] / "examples"
    for name in ("fedsgd-quadratic", "synthetic-paper"):
        out[f"example-{name}"] = (examples / f"{name}.toml").read_text(encoding="utf-8")
    if images is not None:
        for model, n_clients, steps in (("mlp", 6, 4), ("cnn", 4, 2)):
            out[f"mnist-{model}"] = (f'rounds = 2\n[data]\nkind = "mnist"\npath = "{images / model}"\n'
                                     f'clients = {n_clients}\nholdout = 100\npartition = "shards"\n'
                                     f'[model]\nkind = "{model}"\n[train]\nclients_per_round = 3\n'
                                     f'local_steps = {steps}\nbatch_size = 10\nlr_local = 0.05\n')
    return out


DEADLINE_SOURCE = SMALL.replace("local_steps = 10", "local_steps = 400") + (
    '[participation]\nmode = "deadline"\ndeadline_s = 0.004\ngrace_s = 0.5\ncontention = [0.0, 0.5, 0.9]\n')


def cut_mnist(source: Path, out: Path) -> Path:
    """Small t10k-format sets from the real files: 700 images for the 2NN, 300 for the CNN."""
    images = gzip.open(source / "t10k-images-idx3-ubyte.gz").read()
    labels = gzip.open(source / "t10k-labels-idx1-ubyte.gz").read()
    for model, n in (("mlp", 700), ("cnn", 300)):
        folder = out / model
        folder.mkdir(parents=True, exist_ok=True)
        header = np.array([2051, n, 28, 28], ">i4").tobytes()
        with gzip.open(folder / "t10k-images-idx3-ubyte.gz", "wb") as f:
            f.write(header + images[16:16 + n * 784])
        with gzip.open(folder / "t10k-labels-idx1-ubyte.gz", "wb") as f:
            f.write(np.array([2049, n], ">i4").tobytes() + labels[8:8 + n])
    return out


def edgefed(args: list[str], ranks: int | None) -> None:
    cmd = [sys.executable, "-m", "edgefed", *args]
    if ranks:
        cmd = [local_mpiexec(), "-n", str(ranks), *cmd]
    env = outside_world_env()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr}")


def record(out: Path, mnist: Path | None, replay: Path | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    source = out / "deadline.source.h5"
    if replay is not None:
        shutil.copyfile(replay, source)
    elif not source.exists():
        cfg = out / "deadline.source.toml"
        cfg.write_text(DEADLINE_SOURCE, encoding="utf-8")
        edgefed(["run", str(cfg), "--out", str(source), "--quiet"], None)
    images = cut_mnist(mnist, out / "images") if mnist is not None else None
    mpi = local_mpiexec() is not None
    for name, text in configs(source, images).items():
        args = ["run"]
        if text is not None:
            cfg = out / f"{name}.toml"
            cfg.write_text(text, encoding="utf-8")
            args.append(str(cfg))
        for ranks, suffix in ((None, "sim"), (3, "mpi3")):
            if ranks and not mpi:
                continue
            log = out / f"{name}.{suffix}.h5"
            log.unlink(missing_ok=True)
            edgefed(args + ["--out", str(log), "--quiet"], ranks)
            print(f"recorded {log.name}", flush=True)


def datasets(path: Path) -> tuple[dict, dict]:
    data = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: data.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
        attrs = dict(f.attrs)
    skip = MEASURED | (MEASURED_CLOCK if attrs.get("clock", "measured") == "measured" else set())
    kept = {k: v for k, v in data.items() if k not in skip and not k.startswith("state/undo/")}
    return kept, attrs


def same_config(text_a: str, text_b: str) -> bool:
    """The same experiment, whatever words and whichever newer keys (at their defaults) the texts use."""
    try:
        from edgefed.config import config_from_dict
    except ImportError:  # an edgefed without that function: compare the parsed text
        return tomllib.loads(text_a) == tomllib.loads(text_b)
    return config_from_dict(tomllib.loads(text_a)) == config_from_dict(tomllib.loads(text_b))


def compare(a: Path, b: Path) -> int:
    """Every golden log of a against its namesake in b (and every MPI log against its own simulator log)."""
    failures, checked = [], 0
    names = sorted(p.name for p in a.glob("*.h5") if p.name != "deadline.source.h5")
    for name in names:
        other = b / name
        if not other.exists():
            failures.append(f"{name}: missing in {b}")
            continue
        (da, aa), (db, ab) = datasets(a / name), datasets(other)
        if da.keys() - db.keys():
            failures.append(f"{name}: datasets missing in {b}: {sorted(da.keys() - db.keys())}")
        if db.keys() - da.keys():
            print(f"note: {name}: datasets new in {b}: {sorted(db.keys() - da.keys())}")
        for key in sorted(da.keys() & db.keys()):
            if da[key].dtype != db[key].dtype or da[key].shape != db[key].shape or da[key].tobytes() != db[key].tobytes():
                failures.append(f"{name}: {key} differs")
        attr_diff = sorted(k for k in (aa.keys() & ab.keys()) - TIMED_ATTRS - {"config"}
                           if not np.array_equal(np.asarray(aa.get(k)), np.asarray(ab.get(k))))
        if aa.keys() - ab.keys() - TIMED_ATTRS:
            attr_diff += sorted(aa.keys() - ab.keys() - TIMED_ATTRS)
        # the same config may be written in other words, and names files in the other recording's folder
        if not same_config(str(aa.get("config", "")), str(ab.get("config", "")).replace(str(b), str(a))):
            attr_diff.append("config")
        if attr_diff:
            failures.append(f"{name}: root attributes differ: {attr_diff}")
        checked += 1
    for name in names:  # the MPI runs of b against b's simulator
        if name.endswith(".mpi3.h5") and (b / name.replace(".mpi3.", ".sim.")).exists():
            (dm, _), (ds, _) = datasets(b / name), datasets(b / name.replace(".mpi3.", ".sim."))
            bad = [k for k in ds if k not in dm or dm[k].tobytes() != ds[k].tobytes()]
            if bad:
                failures.append(f"{name}: MPI differs from the simulator in {bad}")
    for line in failures:
        print(f"DIFFERS: {line}")
    print(f"{checked} logs compared, {len(failures)} differences")
    return 1 if failures or not checked else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    rec = verbs.add_parser("record")
    rec.add_argument("out", type=Path)
    rec.add_argument("--mnist", type=Path, help="folder with t10k-images/labels-idx*-ubyte.gz")
    rec.add_argument("--replay", type=Path, help="the deadline run of an earlier recording to replay")
    cmp_ = verbs.add_parser("compare")
    cmp_.add_argument("a", type=Path)
    cmp_.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.verb == "record":
        record(args.out, args.mnist, args.replay)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    raise SystemExit(main())
