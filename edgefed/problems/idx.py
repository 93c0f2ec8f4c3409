"""MNIST and EMNIST in their standard IDX files (gzip or raw), read without ever holding more than needed.

IDX: a big-endian header (magic 2051 for images: count, rows, cols; 2049 for labels: count) then uint8 data.
Labels are small and read whole; image rows are streamed in blocks and only the requested ones kept, so a
rank (or a Pi Zero with 512 MB) holds just its own devices' images. Files are always read to their end, where
gzip checks its CRC: a damaged file is an error, never silently wrong pixels. EMNIST stores images transposed; they are
turned upright here. EMNIST `letters` labels run 1..26 and become 0..25.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np

from edgefed.errors import ProblemFileError

IMAGES_MAGIC, LABELS_MAGIC = 2051, 2049
EMNIST_SPLITS = {"byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26, "digits": 10, "mnist": 10}
BLOCK = 4096


def _open(path: Path):
    with open(path, "rb") as raw:
        gz = raw.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gz else open(path, "rb")


def find(folder: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (folder / name).is_file():
            return folder / name
    return None


def _header(f, path: Path, magic: int, n_dims: int) -> tuple:
    head = f.read(4)
    if len(head) < 4:
        raise ProblemFileError(f"{path} is too short to be an IDX file")
    (found,) = struct.unpack(">i", head)
    if found != magic:
        raise ProblemFileError(f"{path} has IDX magic {found}, expected {magic}; is it the right file?")
    dims = f.read(4 * n_dims)
    if len(dims) < 4 * n_dims:
        raise ProblemFileError(f"{path} is too short to be an IDX file")
    return struct.unpack(f">{n_dims}i", dims)


def read_labels(path: Path) -> np.ndarray:
    try:
        with _open(path) as f:
            (count,) = _header(f, path, LABELS_MAGIC, 1)
            data = np.frombuffer(f.read(count), dtype=np.uint8)
            f.read(1)  # to the end: gzip checks its CRC there
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ProblemFileError(f"{path} cannot be read ({exc}); give the standard IDX label file") from None
    if data.size != count:
        raise ProblemFileError(f"{path} holds {data.size} labels but its header says {count}; the file is cut short")
    return data.astype(np.int64)


def image_count(path: Path) -> tuple[int, int, int]:
    try:
        with _open(path) as f:
            return _header(f, path, IMAGES_MAGIC, 3)
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ProblemFileError(f"{path} cannot be read ({exc}); give the standard IDX image file") from None


def read_image_rows(path: Path, rows: np.ndarray, transpose: bool = False) -> np.ndarray:
    """uint8 images (len(rows), height * width) of the given ascending row numbers, streamed block by block."""
    rows = np.asarray(rows, dtype=np.int64)
    try:
        with _open(path) as f:
            count, height, width = _header(f, path, IMAGES_MAGIC, 3)
            size = height * width
            out = np.empty((rows.size, size), dtype=np.uint8)
            if rows.size and rows[-1] >= count:
                raise ProblemFileError(f"{path} holds {count} images; row {rows[-1]} was asked for")
            done = 0
            for start in range(0, count, BLOCK):  # to the end even when done: a gzip file's CRC is checked there
                stop = min(start + BLOCK, count)
                block = f.read((stop - start) * size)
                if len(block) < (stop - start) * size:
                    raise ProblemFileError(f"{path} is cut short: {count} images in the header, fewer in the file")
                take = rows[done:np.searchsorted(rows, stop)]
                if take.size:
                    images = np.frombuffer(block, dtype=np.uint8).reshape(stop - start, size)
                    out[done:done + take.size] = images[take - start]
                    done += take.size
            if f.read(1):
                raise ProblemFileError(f"{path} has data past its {count} images; is it the right file?")
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ProblemFileError(f"{path} cannot be read ({exc}); give the standard IDX image file") from None
    if transpose:
        out = out.reshape(-1, height, width).transpose(0, 2, 1).reshape(-1, size)
    return out


def dataset_files(kind: str, folder: str | Path, split: str) -> dict:
    """{"train": (images, labels) or None, "test": (images, labels) or None} present in the folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ProblemFileError(f"data folder {folder} not found; data.path must name a folder of IDX files")
    prefix = "" if kind == "mnist" else f"emnist-{split}-"
    stems = {"train": (f"{prefix}train-images-idx3-ubyte", f"{prefix}train-labels-idx1-ubyte"),
             "test": (f"{prefix}{'t10k' if kind == 'mnist' else 'test'}-images-idx3-ubyte",
                      f"{prefix}{'t10k' if kind == 'mnist' else 'test'}-labels-idx1-ubyte")}
    found = {}
    for part, (images, labels) in stems.items():
        pair = (find(folder, images), find(folder, labels))
        if pair[0] is None and pair[1] is None:
            found[part] = None
        elif None in pair:
            missing = images if pair[0] is None else labels
            raise ProblemFileError(f"data folder {folder} has one file of a pair but not {missing}[.gz]")
        else:
            found[part] = pair
    if not any(found.values()):
        names = ", ".join(f"{a}[.gz], {b}[.gz]" for a, b in stems.values())
        raise ProblemFileError(f"data folder {folder} holds no {kind} files; expected {names}")
    return found
