"""`[data] kind = "cifar10"` / `"cifar100"`: the CIFAR "python version" folder as distributed (Krizhevsky, 2009).

CIFAR-10 (`cifar-10-batches-py`): `data_batch_1` .. `data_batch_5` and `test_batch`; CIFAR-100
(`cifar-100-python`): `train` and `test`, with `split = "fine"` (100 classes, the default) or `"coarse"` (20).
Each file is a pickled dict whose `data` is (n, 3072) uint8, a row a 3 x 32 x 32 image in (C, H, W) order.
The files are unpickled by an unpickler that builds NumPy arrays and nothing else, so a data file cannot run
code. A batch is read whole (30 MB) and only the hosted devices' rows kept.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np

from edgefed.errors import ConfigError, ProblemFileError
from edgefed.problems.pool import PoolProblem, Source

FILES = {"cifar10": (tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",)), "cifar100": (("train",), ("test",))}
LABELS = {"cifar10": b"labels", "fine": b"fine_labels", "coarse": b"coarse_labels"}
CIFAR100_SPLITS = ("fine", "coarse")
SHAPE = (3, 32, 32)
_ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
            ("numpy._core.multiarray", "scalar"), ("_codecs", "encode")}


class _ArraysOnly(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a CIFAR batch")
        return super().find_class(module, name)


def read_batch(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            batch = _ArraysOnly(io.BytesIO(f.read()), encoding="bytes").load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError) as exc:
        raise ProblemFileError(f"{path} cannot be read as a CIFAR python batch ({exc}); give the files of the "
                               "python version as distributed") from None
    if not isinstance(batch, dict) or b"data" not in batch:
        raise ProblemFileError(f"{path} is not a CIFAR batch: it has no data")
    return batch


class CifarSource(Source):
    def __init__(self, folder: Path, kind: str, split: str | None):
        self.key = LABELS["cifar10" if kind == "cifar10" else split]
        self.paths, self._last = {}, None
        labels = {}
        for part, names in zip(("train", "test"), FILES[kind]):
            paths = [folder / name for name in names]
            missing = [p.name for p in paths if not p.is_file()]
            if missing:
                raise ConfigError(f"config: data.path = {str(folder)!r} has no {missing[0]}; give the folder of "
                                  f"the {kind.upper()} python version ({', '.join(names)})")
            parts = []
            for path in paths:
                batch = read_batch(path)
                if self.key not in batch:
                    raise ProblemFileError(f"{path} has no {self.key.decode()}; is it the right data set?")
                data = np.asarray(batch[b"data"])
                y = np.asarray(batch[self.key])
                if data.ndim != 2 or data.shape[1] != int(np.prod(SHAPE)) or y.shape != (data.shape[0],):
                    raise ProblemFileError(f"{path}: data is {data.shape} with {y.size} labels; expected (n, 3072) "
                                           "and one label per row")
                parts.append(y)
            self.paths[part] = (paths, np.cumsum([0] + [p.size for p in parts]))
            labels[part] = np.concatenate(parts)
        super().__init__(str(folder), SHAPE, labels["train"], labels["test"])
        self.finite_checked = True  # bytes
        self.n_classes = {b"labels": 10, b"fine_labels": 100, b"coarse_labels": 20}[self.key]

    def read(self, part: str, rows: np.ndarray) -> np.ndarray:
        paths, starts = self.paths[part]
        out = np.empty((rows.size, *SHAPE), np.uint8)
        for i, path in enumerate(paths):
            lo, hi = starts[i], starts[i + 1]
            mine = (rows >= lo) & (rows < hi)
            if mine.any():
                out[mine] = self._batch(path)[rows[mine] - lo].reshape(-1, *SHAPE)
        return out

    def _batch(self, path: Path) -> np.ndarray:
        """A batch's data, the last one read kept (a scan in blocks reads each batch once, not per block)."""
        if self._last is None or self._last[0] != path:
            self._last = (path, np.asarray(read_batch(path)[b"data"]))
        return self._last[1]


def cifar_problem(cfg, seed: int, dtype, loss: str, spatial: int = 0, tokens: int | None = None,
                  builtin: str | None = None) -> PoolProblem:
    folder = Path(cfg.path)
    if not folder.is_dir():
        raise ConfigError(f"config: data.path = {cfg.path!r} is not a folder; give the CIFAR python version's "
                          "folder (cifar-10-batches-py or cifar-100-python)")
    source = CifarSource(folder, cfg.kind, cfg.split)
    title = "CIFAR-10" if cfg.kind == "cifar10" else f"CIFAR-100 ({cfg.split})"
    return PoolProblem(cfg, seed, dtype, source, loss, title, spatial, tokens, builtin)
