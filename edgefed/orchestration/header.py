"""The run log's header as a run starts: the columns and resume state its algorithm, wire and policies add
(log_layout), how often it stores the model (trajectory_every), and the attributes that say what was run."""

from __future__ import annotations

import numpy as np

from edgefed import compression
from edgefed.algorithms import Algorithm
from edgefed.config import Config
from edgefed.errors import ConfigError
from edgefed.memory import size_text
from edgefed.participation import privacy
from edgefed.participation.selection import POLICY_CLASSES
from edgefed.runlog import Column, Header
from edgefed.runtime.local import LocalTransport


def log_layout(algorithm: Algorithm, cfg: Config, n: int, d: int, dtype) -> dict:
    """The run-log columns and resume state an algorithm's vectors (and the wire's: error-feedback residuals,
    the devices' copy of a compressed downlink) add to FedAvg's (Header fields)."""
    columns = [Column(v.column, (d,), dtype, "stored", v.meaning) for v in algorithm.server_vectors]
    if cfg.log.client_controls:
        columns += [Column(v.column, (n, d), dtype, "stored", v.meaning) for v in algorithm.device_vectors]
    slots = [v.name for v in algorithm.server_vectors]
    if cfg.compress.downlink != "none":
        slots += [compression.replica_name(name) for name in ("x", *slots)]
    if cfg.participation.mode == "async":
        columns.append(Column("participation/staleness", (n,), np.int32, "round",
                              "async: tau = t - 1 - v of the device's report in server update t (-1: none)", -1))
    if cfg.secagg.enabled:
        columns += [
            Column("participation/secagg_s", (n,), np.float32, "round",
                   "secure aggregation: the device's time on keys, shares, masks and reveals, s (NaN: not selected)",
                   np.nan),
            Column("participation/secagg_bytes", (n,), np.int64, "round",
                   "secure aggregation: the protocol's messages the device sent (keys, sealed shares, reveals), "
                   "bytes; its masked input is bytes_up"),
            Column("metrics/secagg_clipped", (), np.int64, "round",
                   "secure aggregation: coordinates the clip cut, summed over the applied devices (masked like "
                   "their updates: no one device's count is seen)"),
            Column("metrics/secagg_aborted", (), np.bool_, "round",
                   "secure aggregation could not unmask the round (too few survivors): nothing was applied")]
    if cfg.privacy.mechanism == "central":  # (distributed: the devices clip, unseen)
        columns.append(Column("participation/clipped", (n,), np.bool_, "round",
                              "differential privacy: the device's contribution a_k Delta_k was longer than "
                              "privacy.clip and was scaled to it"))
    if cfg.privacy.adapts:
        columns.append(Column("metrics/privacy_clip", (), np.float64, "round",
                              "adaptive clipping: the clip C the round used (Andrew et al.'s quantile estimate)"))
    if cfg.privacy.mechanism != "none":
        columns += [
            Column("metrics/epsilon", (), np.float64, "round+1",
                   "differential privacy: the epsilon spent after the round, at the log's privacy_delta (RDP "
                   "accountant, Poisson-sampled Gaussian)", np.nan)]
    if cfg.selection.policy != "uniform":
        columns += [
            Column("participation/candidate", (n,), np.bool_, "round",
                   f"the selection policy ({cfg.selection.policy}) considered the device for the round"),
            Column("participation/utility", (n,), np.float64, "round",
                   "the policy's score of a considered device when it selected (fedcs: predicted seconds; oort: "
                   "utility; power_of_choice: local loss; NaN: not considered)", np.nan)]
    if cfg.submodel.enabled:
        columns.append(Column("participation/width", (n,), np.float64, "round",
                              f"[submodel] {cfg.submodel.method}: the width the device trained (FjORD: the widest its "
                              "steps drew from), a fraction of every hidden layer's units; its slice alone travelled "
                              "(bytes_down, bytes_up); NaN: not selected", np.nan))
    rows = [v.name for v in algorithm.device_vectors]
    if cfg.compress.error_feedback:
        rows += [compression.residual_name(r) for r in algorithm.reports]
    schedule = privacy.clip_slots(cfg.privacy)
    if cfg.participation.mode == "async" and cfg.selection.policy != "uniform":  # the tasks in flight, for --resume
        schedule += (("async_flight", (cfg.asynchronous.concurrency, 5), np.float64),
                     ("async_counters", (2,), np.int64))
    policy = POLICY_CLASSES[cfg.selection.policy].slots(n, cfg.rounds)
    return {"extra_columns": tuple(columns),
            "slots": tuple((name, (d,), dtype) for name in slots) + policy + schedule,
            "row_states": tuple((name, (n, d), dtype) for name in rows)}


def energy_column(n: int) -> Column:
    """A run whose boards' power is known logs each device-round's energy (docs/design.md 2.21)."""
    return Column("participation/energy_j", (n,), np.float64, "round",
                  "the device's energy in the round, J: its busy CPU seconds at a busy core's watts plus its share of "
                  "its board's idle watts over the round (modelled from the profile's [power]; NaN: not selected, "
                  "or no [power])", np.nan)


def energy_read_column(n: int) -> Column:
    """Beside the modelled energy, where boards read their own (docs/design.md 2.21)."""
    return Column("participation/energy_read_j", (n,), np.float64, "round",
                  "the device's share of its board's energy in the round as the board's own meter read it, J (RAPL, "
                  "or a Pi 5's PMIC sampled; measured, beside the modelled energy_j; NaN: no meter, not selected)",
                  np.nan)


def stored_rounds(rounds: int, every: int) -> int:
    """Rounds whose model the log stores: 0, every k-th, and the last."""
    return rounds // every + 1 + (1 if rounds % every else 0)


def trajectory_every(cfg: Config, header_layout: dict, d: int, dtype) -> tuple[int, str]:
    """([log] every as run, what the log stores, in words). Unset, every round is stored unless that would
    exceed [log] trajectory_mb: then every k-th, k the smallest that fits (round 0 and R always). An async
    run stores every round: its --resume starts tasks from any of them."""
    row = np.dtype(dtype).itemsize * d + sum(np.dtype(c.dtype).itemsize * int(np.prod(c.row_shape))
                                             for c in header_layout["extra_columns"] if c.rows == "stored")
    budget = cfg.log.trajectory_mb * 1e6
    every, why = cfg.log.every, ""
    if every is None:
        every = 1
        if cfg.participation.mode == "async":
            why = " (async: --resume needs them all)"
        elif stored_rounds(cfg.rounds, 1) * row > budget:
            cap = max(int(budget // row), 2)
            every = max(1, -(-cfg.rounds // max(cap - 1, 1)))
            while every < cfg.rounds and stored_rounds(cfg.rounds, every) > cap:
                every += 1
            over = "" if stored_rounds(cfg.rounds, every) * row <= budget else ", over budget: set trajectory_mb"
            why = f" to keep within [log] trajectory_mb = {cfg.log.trajectory_mb:g}{over}"
    n = stored_rounds(cfg.rounds, every)
    what = "every round" if every == 1 else f"every {every} rounds"
    return every, f"log: the model {what}{why}, {n} of {cfg.rounds + 1} ({size_text(n * row)})"


def log_header(cfg: Config, algorithm: Algorithm, problem, model, layout: dict, config_toml: str,
               restarts: tuple) -> Header:
    """The log's header as the run starts: the config as run, the federation, the model and what its devices'
    samples are, and the columns and state the run's algorithm and policies add (layout)."""
    attrs = {"problem": problem.describe(), "model": model.kind,
             "train_objective": "(1/N_r) sum_k f_k" if cfg.train.weighting == "uniform" else "sum_k n_k/n F_k",
             "rank_memory_estimate_mb": np.array([np.nan])}  # (the run's estimate, once made: budget.py)
    header = Header(
        config_toml=config_toml, restarts=restarts,
        seed=cfg.seed, rounds=cfg.rounds, n_devices=problem.n_devices, dim=model.n_trainable, dtype=model.dtype,
        n_train=problem.n_train, label_counts=_label_counts(problem), frozen=model.frozen_values,
        **layout,
        attrs=attrs,
    )
    if hasattr(problem, "sample_shape"):  # what rebuilds the model's layers from the config (edgefed export)
        attrs["sample_shape"] = np.asarray(problem.sample_shape, np.int64)
        attrs["model_outputs"] = int(problem.n_outputs)
    if getattr(problem, "partition_draws", None) is not None:  # the dirichlet partition: its draws (1: the first)
        attrs["partition_draws"] = int(problem.partition_draws)
    normalization = problem.input_normalization() if hasattr(problem, "input_normalization") else None
    if normalization is not None:  # what the model's inputs were: the exported model wants the same
        attrs["input_shift"], attrs["input_scale"] = (np.asarray(v, np.float64) for v in normalization)
    attrs.update(model.log_attrs())  # (what its samples are; what its bits repeat on)
    if cfg.secagg.enabled:  # which keys a run used: the test mode's are reproducible from the config
        attrs["secagg_key_source"] = cfg.secagg.key_source
    if cfg.log.eval_devices is not None:
        if cfg.log.eval_devices > problem.n_devices:
            raise ConfigError(f"config: log.eval_devices = {cfg.log.eval_devices} exceeds the {problem.n_devices} "
                              "devices; lower it, or leave it out to evaluate every device")
        attrs["eval_devices"] = cfg.log.eval_devices
    return header


def frozen_text(model) -> str:
    """What of the model trains, when some of it is frozen, and whether its frozen prefix's outputs are cached."""
    frozen = model.frozen_values.size
    if not frozen:
        return ""
    cached = (f" (the frozen layers' outputs computed once per device: {model.n_features} features a sample)"
              if model.prefix_end else "")
    return f" trained, {frozen:,} frozen{cached}"


def _label_counts(problem) -> np.ndarray | None:
    """/devices/label_counts as the log starts: every device's, or (a large generated federation) -1 rows
    the run fills as it builds each device's data."""
    if not hasattr(problem, "label_counts"):
        return None
    if getattr(problem, "labels_later", False):  # (a view of one -1: no memory, and no bytes written for it)
        return np.broadcast_to(np.int64(-1), (problem.n_devices, problem.n_classes))
    return problem.label_counts()


def label_counter(problem, transport):
    """ids -> their label counts, for a log that fills them as devices are built (None: counted at the start);
    in one process from the transport's built data, under MPI rank 0 builds the selected devices' itself."""
    if not getattr(problem, "labels_later", False):
        return None
    if isinstance(transport, LocalTransport):
        return lambda ids: transport.label_counts(ids) if len(ids) else None
    return lambda ids: np.stack([problem.labels_of(problem.device(int(k))) for k in ids]) if len(ids) else None
