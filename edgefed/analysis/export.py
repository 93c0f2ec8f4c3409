"""`edgefed export`: a run log as tidy CSV, for pandas and R (`--csv`: one row per round in metrics.csv and one
per round and device in participation.csv; rounds are 1-based, round 0 in metrics.csv is the start), and a
stored server model as the equivalent torch.nn.Sequential's state_dict (`--weights OUT.npz`)."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np

from edgefed import config as config_mod
from edgefed import layers as layer_lib
from edgefed.analysis.logs import Run
from edgefed.errors import EdgefedError, RunLogError
from edgefed.runlog import FROZEN, reading

CSV_FILES = ("metrics.csv", "participation.csv")  # what --csv writes into its folder
PER_ROUND = ("lr", "n_applied", "round_elapsed_s")  # round rows only (no round 0)
PER_EVAL = ("train_loss", "test_loss", "test_accuracy", "clock_s")  # round 0 too
PER_DEVICE = ("selected", "active", "budget", "steps", "coeff", "late", "nonfinite", "elapsed_s", "cpu_percent",
              "cpu_freq_mhz", "temperature_c", "deadline_s", "comm_s", "core", "compiled", "energy_j",
              "energy_read_j")


def _cell(value) -> str:
    if isinstance(value, (bool, np.bool_)):
        return "1" if value else "0"
    if isinstance(value, (float, np.floating)):
        return "" if np.isnan(value) else repr(float(value))
    return str(value)


def export_csv(run: Run, folder: Path) -> list[Path]:
    """Write metrics.csv and participation.csv into folder; returns their paths."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunLogError(f"cannot write CSV into {folder} ({exc}); choose another --csv folder") from None
    metrics = [name for name in PER_EVAL if f"metrics/{name}" in run.data]
    per_round = [name for name in PER_ROUND if f"metrics/{name}" in run.data]
    device_cols = [name for name in PER_DEVICE if f"participation/{name}" in run.data]
    paths = [folder / name for name in CSV_FILES]
    with open(paths[0], "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["round", *metrics, *per_round])
        for r in range(run.rounds + 1):
            w.writerow([r, *(_cell(run[f"metrics/{m}"][r]) for m in metrics),
                        *(_cell(run[f"metrics/{m}"][r - 1]) if r else "" for m in per_round)])
    with open(paths[1], "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["round", "device", *device_cols])
        columns = [run[f"participation/{name}"] for name in device_cols]
        for r in range(run.rounds):
            for k in range(columns[0].shape[1]):
                w.writerow([r + 1, k, *(_cell(c[r, k]) for c in columns)])
    return paths


def network_of(run: Run):
    """The run's model as a planned layer list (or, for kind = "torch", the module itself), from its config
    and the data's shape the log keeps."""
    cfg = config_mod.config_from_dict(config_mod.parse_toml(run.config_toml, f"the config stored in {run.path}"))
    kind = cfg.model.kind
    if kind == "quadratic":
        raise EdgefedError(f"{run.path}: the quadratic model is the vector x itself, with no PyTorch equivalent; "
                           "read /trajectory/x")
    if "sample_shape" not in run.attrs:
        raise EdgefedError(f"{run.path} was written before logs kept the data's shape, which the weights' layout "
                           "needs; run it again to export its weights")
    shape = tuple(int(v) for v in run.attrs["sample_shape"])
    outputs = int(run.attrs["model_outputs"])
    if kind == "torch":
        from edgefed.rng import Purpose, generator
        from edgefed.torchmodel import TorchModel

        return TorchModel(cfg.model.module, cfg.model.factory, shape, outputs, cfg.model.dtype,
                          generator(cfg.seed, Purpose.INIT), cfg.model.loss)
    layers = (cfg.model.layers if kind == "sequential"
              else layer_lib.builtin_layers(kind, shape, outputs, cfg.model.hidden))
    return layer_lib.build(layers, shape, outputs, cfg.model.dtype)


def inputs_text(run: Run, network) -> str:
    """What the exported model takes: samples in the layers' input shape, normalized as the run's were."""
    shape = "(N, " + ", ".join(map(str, network.input_shape)) + ")"
    if isinstance(network, layer_lib.Network) and network.layers[0]["type"] == "embedding":
        return (f"its inputs: token ids {shape}, integers in [0, {network.layers[0]['num']}) (torch.long), as the "
                "run read them")
    if "input_shift" not in run.attrs:
        return f"its inputs: {shape}, as the data file holds them"
    shift, scale = (np.asarray(run.attrs[k], np.float64) for k in ("input_shift", "input_scale"))
    per = "" if shift.size == 1 else f" per channel of {shift.size}"
    numbers = lambda v: ", ".join(f"{x:.6g}" for x in v[:8]) + (", ..." if v.size > 8 else "")  # noqa: E731
    return (f"its inputs: {shape}, normalized as the run's: (x - shift) / scale{per}, shift [{numbers(shift)}], "
            f"scale [{numbers(scale)}] (the log's attributes input_shift, input_scale)")


def stored_weights(run: Run, round_idx: int | None = None, flag: str = "--round ") -> tuple[int, dict, object]:
    """(round, state_dict, network or torch model) of the server model of a stored round (default: the last),
    the frozen tensors included: named and shaped as the equivalent torch module's. flag: how the round was
    asked for, as an error names it."""
    network = network_of(run)
    stored = run["trajectory/round"]
    if round_idx is None:
        row = len(stored) - 1
    else:
        hits = np.flatnonzero(stored == round_idx)
        if not hits.size:
            shown = ", ".join(map(str, stored[:8])) + (", ..." if len(stored) > 8 else "")
            raise EdgefedError(f"{flag}{round_idx}: {run.path} stores the model of rounds {shown} (the last "
                               f"{int(stored[-1])}); pick one of them")
        row = int(hits[0])
    with reading(run.path) as f:  # the one row, not the trajectory (a weights file read by every rank)
        params = np.ascontiguousarray(f["trajectory/x"][row])
        frozen = f[FROZEN][()] if FROZEN in f else params[:0]
    if not isinstance(network, layer_lib.Network):  # a torch module: its own state_dict
        network.set_frozen(frozen)
        return int(stored[row]), network.state_dict(params), network
    if frozen.size != network.frozen or params.size != network.trainable:
        raise RunLogError(f"{run.path} stores {params.size:,} trainable and {frozen.size:,} frozen parameters, but "
                          f"its config's layers have {network.trainable:,} and {network.frozen:,}; it is damaged")
    return int(stored[row]), layer_lib.state_dict(network, np.concatenate([params, frozen.astype(params.dtype)])), network


def export_weights(run: Run, out: Path, round_idx: int | None = None) -> tuple[int, str]:
    """Write the server model of a stored round (default: the last) as one array per parameter, named and
    shaped as the equivalent torch.nn.Sequential's state_dict (frozen tensors included); returns (round, that
    Sequential as Python and what its inputs are)."""
    round_idx, weights, network = stored_weights(run, round_idx)
    if not isinstance(network, layer_lib.Network):
        text = (f"the module {network.factory}(input_shape={network.sample_shape}, n_classes={network.n_outputs}) "
                f"of {network.path}\n{inputs_text(run, network)}")
    else:
        text = f"{layer_lib.torch_text(network)}\n{inputs_text(run, network)}"
    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp.npz")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        np.savez(tmp, **weights)
        tmp.replace(out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise EdgefedError(f"cannot write {out} ({exc}); choose another --weights file") from None
    return round_idx, text
