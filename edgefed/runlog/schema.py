"""What a run log holds: its format, its columns and how their rows map to rounds, its header, the measured
datasets and attributes, the restarts' records, and the rows a log's completed rounds keep."""

from __future__ import annotations

import datetime
import numbers
from dataclasses import dataclass, field

import numpy as np

from edgefed import __version__

FORMAT = "edgefed-run"


FORMAT_VERSION = 1


# The file format of HDF5 1.10, the oldest that SWMR needs: the HDF5 tools Debian and Raspberry Pi OS ship
# (1.10.8: h5ls, h5dump, python3-h5py) and MATLAB's and HDFView's libraries read it; "latest" with the HDF5
# inside today's h5py wheels would write 2.0 formats they cannot (every boolean dataset, for one).
LIBVER = ("v110", "v110")


# Datasets holding measured wall time or load: the only ones that differ between two runs of one config.
MEASURED = frozenset({"participation/elapsed_s", "participation/cpu_percent", "participation/cpu_freq_mhz",
                      "participation/temperature_c", "participation/compiled", "metrics/round_elapsed_s",
                      "participation/secagg_s"})


# Root attributes measured (or estimated for this machine and world): they differ between runs of one config.
MEASURED_ATTRS = frozenset({"created", "finished", "warmup_s", "warmup_compiled", "rank_memory_estimate_mb",
                            "rank_board_memory_mb", "rank_peak_rss_mb"})


# ... and, where the clock is measured (root attribute clock = "measured"), the time the federation kept.
MEASURED_CLOCK = frozenset({"metrics/clock_s", "participation/comm_s", "participation/deadline_s",
                            "participation/core", "participation/energy_j"})


def measured(attrs) -> frozenset:
    """The datasets of a log (by its root attributes) that hold measurements rather than results."""
    return MEASURED | MEASURED_CLOCK if attrs.get("clock", "measured") == "measured" else MEASURED


@dataclass(frozen=True)
class Column:
    """One round-indexed dataset: path, shape of one row, dtype, row mapping, description, and the value
    rows hold that were never written (a resumed log from before the column existed)."""

    path: str
    row_shape: tuple
    dtype: object
    rows: str
    meaning: str
    fill: object = 0


@dataclass(frozen=True)
class Header:
    config_toml: str
    seed: int
    rounds: int
    n_devices: int
    dim: int
    dtype: np.dtype
    n_train: np.ndarray
    extra_columns: tuple = ()  # more Columns (algorithms and modes beyond FedAvg)
    slots: tuple = ()  # (name, shape, dtype) of small state beyond the server model x, e.g. SCAFFOLD's c
    row_states: tuple = ()  # (name, shape, dtype) of per-device state updated by rows, e.g. the c_k
    attrs: dict = field(default_factory=dict)
    restarts: tuple = ()  # the worlds `edgefed launch` started again on this log (dicts of RESTART's fields)
    label_counts: np.ndarray | None = None  # (N, C) int64: each device's training labels (classification)
    frozen: np.ndarray | None = None  # the model's frozen tensors (trainable = false), stored once

    def __post_init__(self):
        """An algorithm's names must not take the log's own: /state holds round, x and undo/, undo/ holds
        round, count and ids beside a copy of each row state."""
        taken = {"round", "x", "undo", "count", "ids"}
        names = [name for name, _, _ in self.slots + self.row_states]
        paths = [c.path for c in columns(self.n_devices, self.dim, self.dtype) + self.extra_columns]
        clash = sorted(({*names} & taken) | {n for n in names if names.count(n) > 1}
                       | {p for p in paths if paths.count(p) > 1})
        if clash:
            raise ValueError(f"run log: the names {clash} are taken twice (the log keeps state/round, state/x, "
                             "state/undo/{round,count,ids} and its base columns); rename the algorithm's vectors")


FROZEN = "model/frozen"  # a model's frozen tensors, stored once (the whole parameter vector after x)


# One row per restart of the world by `edgefed launch`: which launch, the rounds completed when the world
# died, when (UTC), why, and the ranks of the world before and after.
RESTART = np.dtype([("launch", "S32"), ("round", "<i8"), ("time", "S32"), ("cause", "S240"),
                    ("ranks_before", "<i4"), ("ranks_after", "<i4")])


def restart_records(rows) -> tuple:
    """/launch/restarts' rows as dicts of RESTART's fields (text decoded)."""
    return tuple({name: (row[name].decode("utf-8", "replace") if RESTART[name].kind == "S" else int(row[name]))
                  for name in RESTART.names} for row in rows)


EVALUATED = ("metrics/train_loss", "metrics/test_loss", "metrics/test_accuracy")  # what [log] eval_devices samples


def columns(n: int, d: int, dtype) -> tuple[Column, ...]:
    return (
        Column("trajectory/round", (), np.int64, "stored", "rounds whose server model is stored"),
        Column("trajectory/x", (d,), dtype, "stored", "server model after those rounds (round 0: x_0)"),
        Column("participation/selected", (n,), np.bool_, "round", "device was selected (k in S_r)"),
        Column("participation/active", (n,), np.bool_, "round", "device was in the federation (k in C_r)", True),
        Column("participation/budget", (n,), np.int32, "round", "local steps asked (0 if not selected)"),
        Column("participation/steps", (n,), np.int32, "round", "local steps completed s_k"),
        Column("participation/coeff", (n,), np.float64, "round", "aggregation coefficient p_k applied to Delta_k"),
        Column("participation/nonfinite", (n,), np.bool_, "round", "update had NaN/inf and was dropped"),
        Column("participation/elapsed_s", (n,), np.float32, "round", "wall time of the local work, s"),
        Column("participation/cpu_percent", (n,), np.float32, "round", "CPU share the device's work got, %", np.nan),
        Column("participation/cpu_freq_mhz", (n,), np.float32, "round", "CPU frequency after the work (NaN: unknown)",
               np.nan),
        Column("participation/temperature_c", (n,), np.float32, "round", "board temperature after the work (NaN: unknown)",
               np.nan),
        Column("participation/late", (n,), np.bool_, "round", "answered after deadline + grace; its work was dropped"),
        Column("participation/compiled", (n,), np.bool_, "round",
               "the device's work included Numba compilation (a cold kernel cache; see edgefed warmup)"),
        Column("participation/deadline_s", (n,), np.float64, "round",
               "the deadline policy's deadline for the device's report, s (NaN: none, or not selected)", np.nan),
        Column("participation/comm_s", (n,), np.float32, "round",
               "model out to report in, less the local work: links and waiting, s (NaN: unknown)", np.nan),
        Column("participation/core", (n,), np.int16, "round",
               "the core a device's deadline-bound work ran on (-1: not pinned, or not a measured deadline)", -1),
        Column("participation/bytes_up", (n,), np.int64, "round",
               "payload of the device's report as it travelled ([compress] uplink; 0: no work sent)"),
        Column("participation/bytes_down", (n,), np.int64, "round",
               "payload of the round's model broadcast to the device ([compress] downlink; 0: not selected)"),
        Column("metrics/lr", (), np.float64, "round", "local learning rate used in the round"),
        Column("metrics/n_applied", (), np.int32, "round",
               "devices whose update was applied (0: the model did not change, e.g. Scheme A with K_r = 0)"),
        Column("metrics/round_elapsed_s", (), np.float64, "round", "wall time of the whole round, s"),
        Column("metrics/clock_s", (), np.float64, "round+1",
               "the federation's time at the end of the round, s (attribute clock: measured, simulated, replayed)",
               np.nan),
        Column("metrics/train_loss", (), np.float64, "round+1", "global objective at x_r (NaN: not evaluated)"),
        Column("metrics/test_loss", (), np.float64, "round+1", "mean loss on held-out data (NaN: none)"),
        Column("metrics/test_accuracy", (), np.float64, "round+1", "accuracy on held-out data (NaN: none)"),
    )


COMPRESS_FROM = 10_000  # devices from which the (R, N) datasets are stored deflated
SPARSE_FROM = 65_537  # devices from which a round's (N,) row is chunked in pieces and only its values other
# than the column's fill are written: HDF5 never allocates a chunk no value was written to (it reads as the
# fill), so a round of S devices writes about S chunks, not N values
SPARSE_CHUNK = 1024  # devices a chunk of such a row holds


def sparse_rows(row_shape: tuple) -> bool:
    return len(row_shape) == 1 and row_shape[0] >= SPARSE_FROM


def _chunk(row_shape: tuple) -> tuple:
    """Several small rows per chunk; a large row is chunked along its last axis only (a federation's (N,) row
    in pieces: sparse_rows)."""
    per_row = int(np.prod(row_shape, dtype=np.int64)) if row_shape else 1
    if sparse_rows(tuple(row_shape)):
        return (1, SPARSE_CHUNK)
    if per_row > 65536 and len(row_shape) > 1:
        return (1,) * len(row_shape) + (row_shape[-1],)
    return (max(1, min(256, 65536 // max(per_row, 1))),) + tuple(row_shape)


ATTR_TYPES = {"rounds": numbers.Integral, "n_devices": numbers.Integral, "dim": numbers.Integral,
              "seed": numbers.Integral, "config": str, "status": str}  # root attributes every reader relies on


SCHEMA_DATASETS = tuple(c.path for c in columns(1, 1, np.float32)) + (
    "devices/n_train", "devices/label_counts", "state/round", "state/x", "state/undo/round", "state/undo/count",
    "state/undo/ids")  # every log's (an older one may lack some)


def _root_attrs(config_toml: str, status: str) -> dict:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "edgefed_version": __version__,
            "config": config_toml, "status": status,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}



def row_limits(done: int, stored: np.ndarray) -> dict:
    """Rows kept per row mapping once round `done` is complete (stored: the rounds /trajectory/round holds)."""
    return {"round": done, "round+1": done + 1, "stored": int(np.searchsorted(stored, done, side="right"))}
