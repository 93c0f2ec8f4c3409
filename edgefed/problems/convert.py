"""`edgefed data convert`: any dataset edgefed reads, written as a compact arrays file (compact.py).

The source's kind is told by what it is: an arrays file (`.npz`, `.h5`), a LEAF folder (`train/*.json`), CIFAR's
python folder (`data_batch_1`, or CIFAR-100's `train` and `test`), or a folder of MNIST or EMNIST IDX files.
A run on the converted file (`[data] kind = "arrays"`, `path` = the file) writes the bits a run on the source
writes: the same samples, labels, devices and vocabulary in the same order, and the source kind's defaults
(its natural model, partition, normalization and classes) stored as the file's own. (MNIST's and EMNIST's
own problem describes itself in other words, and only it sizes devices by `samples = "pareto"`.) Nothing is read whole:
LEAF's JSON is streamed a user at a time, an arrays file and IDX images a block of rows at a time, CIFAR a
batch (30 MB) at a time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgefed.errors import ConfigError, ProblemFileError
from edgefed.problems import cifar, idx
from edgefed.problems.compact import CompactWriter, smallest_int
from edgefed.problems.leaf import convert_leaf

BLOCK_BYTES = 32 << 20  # an arrays file or IDX images are copied this much at a time


def source_kind(source: Path) -> str:
    """What a source is: "arrays", "leaf", "cifar10", "cifar100", "mnist" or "emnist"; a ConfigError saying
    what each looks like otherwise."""
    if source.is_file():
        if source.suffix in (".npz", ".h5", ".hdf5"):
            return "arrays"
        raise ConfigError(f"{source} is a file but not an arrays file (.npz, .h5); give an arrays file or a dataset's "
                          "folder")
    if not source.is_dir():
        raise ConfigError(f"{source} does not exist; give a dataset's file or folder")
    if any((source / "train").glob("*.json")):
        return "leaf"
    if (source / "data_batch_1").is_file():
        return "cifar10"
    if (source / "train").is_file() and (source / "test").is_file():
        return "cifar100"
    names = [p.name for p in source.iterdir()]
    if any(n.startswith("emnist-") and "-images-idx3-ubyte" in n for n in names):
        return "emnist"
    if any(n.startswith(("train-images-idx3-ubyte", "t10k-images-idx3-ubyte")) for n in names):
        return "mnist"
    raise ConfigError(f"{source} is not a dataset folder edgefed reads: a LEAF folder (train/*.json), CIFAR's python "
                      "folder (data_batch_1 .. or train and test), or MNIST/EMNIST IDX files")


def emnist_split(source: Path, split: str | None) -> str:
    found = sorted({p.name.split("-")[1] for p in source.glob("emnist-*-images-idx3-ubyte*")})
    if split is not None:
        if split not in found:
            raise ConfigError(f"--split {split}: {source} has the EMNIST splits {', '.join(found)}; pick one of them")
        return split
    if len(found) > 1:
        raise ConfigError(f"{source} holds the EMNIST splits {', '.join(found)}; pick one with --split")
    return found[0]


def convert(source, out, *, split: str | None = None, holdout: int = 2000, vocab_size: int = 10_000,
            vocab: str | None = None) -> str:
    """Write source as the compact arrays file out (swapped in whole); returns what it holds, in a line."""
    source, out = Path(source), Path(out)
    kind = source_kind(source)
    if split is not None and kind not in ("emnist", "cifar100"):
        raise ConfigError(f"--split applies to EMNIST and CIFAR-100, not to {source} ({kind}); remove it")
    if kind == "leaf":
        return convert_leaf(source, out, vocab_size, vocab)
    if vocab is not None or vocab_size != 10_000:
        raise ConfigError(f"--vocab and --vocab-size apply to a LEAF Sent140 folder, not to {source} ({kind})")
    if kind == "arrays":
        return _arrays(source, out)
    if kind.startswith("cifar"):
        return _cifar(source, out, kind, split or ("fine" if kind == "cifar100" else None))
    return _idx(source, out, kind, emnist_split(source, split) if kind == "emnist" else None, holdout)


def _arrays(source: Path, out: Path) -> str:
    from edgefed.problems.arrays import ArraysSource

    src = ArraysSource(source)
    shape = src.sample_shape
    parts = ("train", "test") if src.y_test is not None else ("train",)
    integer = src.integer
    ids_dtype = None
    if integer:  # ids or integer pixels: the smallest type of their range (a pass over them first)
        low, high = 0, 0
        for part in parts:
            for _, block in src.blocks(part):
                if block.size:
                    low, high = min(low, int(block.min())), max(high, int(block.max()))
        ids_dtype = smallest_int(low, high)
    writer = CompactWriter(out, shape, ids_dtype)
    try:
        for part in parts:
            n = src.y_train.shape[0] if part == "train" else src.y_test.shape[0]
            y = src.y_train if part == "train" else src.y_test
            step = max(1, BLOCK_BYTES // max(1, 8 * int(np.prod(shape))))
            for first in range(0, n, step):
                rows = np.arange(first, min(first + step, n))
                block = src.read(part, rows)
                if not integer:
                    block = block.astype(np.float64)
                    bad = ~np.isfinite(block.reshape(rows.size, -1)).all(axis=1)
                    if bad.any():
                        raise ProblemFileError(f"{source}: x_{part} row {first + int(np.argmax(bad))} holds NaN or "
                                               "infinity; clean the data")
                writer.add(part, block, y[rows])
        devices = {part: d for part, d in (("train", src.device_train), ("test", src.device_test)) if d is not None}
        writer.finish({"source": f"the arrays file {source}", "title": source.name}, devices=devices,
                      has_test=src.y_test is not None)
    except BaseException:
        writer.discard()
        raise
    return f"{source.name}: {src.y_train.shape[0]} training samples of {'x'.join(map(str, shape))}"


def _cifar(source: Path, out: Path, kind: str, split: str | None) -> str:
    src = cifar.CifarSource(source, kind, split)
    writer = CompactWriter(out, cifar.SHAPE, np.uint8)
    try:
        for part in ("train", "test"):
            paths, starts = src.paths[part]
            y = src.y_train if part == "train" else src.y_test
            for i in range(len(paths)):
                rows = np.arange(starts[i], starts[i + 1])
                writer.add(part, src.read(part, rows), y[rows])
        title = "CIFAR-10" if kind == "cifar10" else f"CIFAR-100 ({split})"
        writer.finish({"source": f"the {title} folder {source}", "title": title, "note": title, "x_numbers": True,
                       "normalize": "unit", "classes": src.n_classes, "model": "cnn"}, has_test=True)
    except BaseException:
        writer.discard()
        raise
    return f"{title}: {src.y_train.size} training and {src.y_test.size} test images of 3x32x32"


def _idx(source: Path, out: Path, kind: str, split: str | None, holdout: int) -> str:
    """MNIST or EMNIST as its own problem reads them (images.py): upright, EMNIST letters' labels from 0, and
    with only the test files the last `holdout` of them held out for testing."""
    files = idx.dataset_files(kind, source, split)
    shift = 1 if kind == "emnist" and split == "letters" else 0
    classes = 10 if kind == "mnist" else idx.EMNIST_SPLITS[split]
    name = "MNIST" if kind == "mnist" else f"EMNIST-{split}"
    train = files["train"] or files["test"]
    labels = idx.read_labels(train[1]) - shift
    if files["train"] is not None and files["test"] is not None:
        test = idx.read_labels(files["test"][1]) - shift
        pieces = [("train", train[0], labels, 0, labels.size), ("test", files["test"][0], test, 0, test.size)]
    else:  # the last `holdout` images held out, as images.py does
        if not 0 < holdout < labels.size:
            raise ConfigError(f"--holdout {holdout} must leave training images out of the {labels.size} in {source}")
        cut = labels.size - holdout
        pieces = [("train", train[0], labels, 0, cut), ("test", train[0], labels, cut, labels.size)]
    for _, _, y, lo, hi in pieces:
        if hi > lo and (y[lo:hi].min() < 0 or y[lo:hi].max() >= classes):
            raise ConfigError(f"the labels in {source} run {y[lo:hi].min()}..{y[lo:hi].max()}, not {name}'s {classes} "
                              "classes; pick the split of the files")
    _, height, width = idx.image_count(pieces[0][1])
    writer = CompactWriter(out, (1, height, width), np.uint8)
    try:
        for part, images, y, lo, hi in pieces:
            rows = np.arange(lo, hi)
            step = max(1, BLOCK_BYTES // (height * width))
            for first in range(0, rows.size, step):  # (each read streams the file once)
                chunk = rows[first:first + step]
                pixels = idx.read_image_rows(images, chunk, kind == "emnist")
                writer.add(part, pixels.reshape(-1, 1, height, width), y[chunk])
        writer.finish({"source": f"the {name} IDX files in {source}", "title": name, "note": name, "x_numbers": True,
                       "normalize": "unit", "classes": classes, "model": "mlp" if kind == "mnist" else "cnn"},
                      has_test=True)
    except BaseException:
        writer.discard()
        raise
    return f"{name}: {pieces[0][4] - pieces[0][3]} training and {pieces[1][4] - pieces[1][3]} test images"
