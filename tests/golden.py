"""Short float32 runs of every model whose trajectories must hash alike on every CPU.

    python tests/golden.py --write tests/golden_hashes.json   # record (under launch/check-aarch64.sh)
    python tests/golden.py --check tests/golden_hashes.json   # compare; exit 1 on a difference

The committed hashes are made on 64-bit ARM (aarch64, under emulation by launch/check-aarch64.sh), and
tests/test_golden.py checks them on whatever CPU runs the suite: a kernel change that makes x86-64 and ARM
disagree fails CI. When a change is meant to change the bits, regenerate them under emulation and say so
in the commit. The image runs read a small set of generated 28 x 28 images (integer pixels from a fixed
seed, so the same bytes everywhere), written as the IDX files MNIST comes in; the character LSTM's, a small
LEAF Shakespeare folder of text drawn alike.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import platform
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np

COMMON = {"rounds": 2, "seed": 7, "model.dtype": "float32", "data.clients": 4, "train.clients_per_round": 2,
          "train.local_steps": 3, "train.batch_size": 5}
IMAGES = {"data.kind": "mnist", "data.partition": "iid", "data.holdout": 40}
CASES = {
    "logreg-fedavg": {},
    "logreg-scaffold": {"train.algorithm": "scaffold"},
    "2nn-fedavg": {**IMAGES, "model.kind": "mlp", "model.hidden": [200, 200]},
    "2nn-scaffold": {**IMAGES, "model.kind": "mlp", "model.hidden": [200, 200], "train.algorithm": "scaffold"},
    "cnn-fedavg": {**IMAGES, "model.kind": "cnn", "train.local_steps": 2},
    "cnn-scaffold": {**IMAGES, "model.kind": "cnn", "train.local_steps": 2, "train.algorithm": "scaffold"},
    "charlstm-fedavg": {"data.kind": "leaf", "data.path": "shakespeare", "model.kind": "charlstm",
                        "train.lr_local": 0.5},
}
HASHED = ("trajectory/x", "state/x")


def write_images(folder: Path, n: int = 120) -> None:
    """t10k-style IDX files of n random 28 x 28 images and labels (NumPy's PCG64: the same bytes on every CPU)."""
    g = np.random.Generator(np.random.PCG64(20261201))
    images = g.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = g.integers(0, 10, n, dtype=np.uint8)
    with gzip.open(folder / "t10k-images-idx3-ubyte.gz", "wb") as f:
        f.write(struct.pack(">4i", 2051, n, 28, 28) + images.tobytes())
    with gzip.open(folder / "t10k-labels-idx1-ubyte.gz", "wb") as f:
        f.write(struct.pack(">2i", 2049, n) + labels.tobytes())


def write_shakespeare(folder: Path, users: int = 4, samples: int = 6) -> None:
    """A LEAF Shakespeare folder (train/ and test/) of users whose text is drawn from LEAF's letters."""
    g = np.random.Generator(np.random.PCG64(20261203))
    letters = np.array(list("\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"))
    for part, n in (("train", samples), ("test", 2)):
        data = {"users": [], "num_samples": [], "user_data": {}}
        for k in range(users):
            line = "".join(g.choice(letters, 80 + n))
            data["users"].append(f"PLAY_ROLE_{k}")
            data["num_samples"].append(n)
            data["user_data"][f"PLAY_ROLE_{k}"] = {"x": [line[i:i + 80] for i in range(n)],
                                                    "y": [line[i + 80] for i in range(n)]}
        (folder / part).mkdir(parents=True, exist_ok=True)
        (folder / part / f"all_data_{part}.json").write_text(json.dumps(data))


def run_case(name: str, folder: Path) -> str:
    """The sha256 of the case's trajectory and final state (bytes in HASHED order)."""
    from conftest import config_with
    from edgefed.orchestration import run as runs
    from edgefed.runlog import read_run

    overrides = {**COMMON, **CASES[name]}
    if "data.kind" in overrides:
        overrides["data.path"] = str(folder / overrides.get("data.path", ""))
    path = folder / f"{name}.h5"
    runs.run(config_with(overrides), path)
    log = read_run(path)
    digest = hashlib.sha256()
    for key in HASHED:
        digest.update(np.ascontiguousarray(log[key]).tobytes())
    return digest.hexdigest()


def all_hashes(names=CASES) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_images(folder)
        write_shakespeare(folder / "shakespeare")
        return {name: run_case(name, folder) for name in names}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path)
    group.add_argument("--check", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    hashes = all_hashes()
    if args.write:
        import llvmlite.binding as llvm

        record = {"machine": platform.machine(), "cpu": llvm.get_host_cpu_name(), "python": platform.python_version(),
                  "hashes": hashes}
        args.write.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {len(hashes)} hashes ({platform.machine()}) to {args.write}")
        return 0
    expected = json.loads(args.check.read_text())
    bad = [name for name, h in hashes.items() if expected["hashes"].get(name) != h]
    for name in hashes:
        print(f"{name:16s} {'same' if name not in bad else 'DIFFERENT'} as on {expected['machine']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
