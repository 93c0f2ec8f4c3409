"""A run continued: the config and resume point a --resume names (resolve_config), the weights and data it
started from, and the restarts its launcher reports."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgefed import config as config_mod
from edgefed.config import Config
from edgefed.errors import RunLogError
from edgefed.orchestration.weights import read_weights, resumed_weights
from edgefed.runlog import read_resume_point


@dataclass(frozen=True)
class Launch:
    """What `edgefed launch` tells the run it starts: where to say that a rank was lost, and the restarts of
    this launch so far (each a dict of runlog.RESTART's fields), to be kept in the log."""

    status: Path | None = None
    restarts: tuple = ()

    @property
    def board_back(self) -> Path | None:
        """The file the launcher writes beside the status file when a board it left out answers again: the
        coordinator then ends the world at the next round boundary, so that the next one has the board."""
        return None if self.status is None else self.status.with_name("board-back")


def merged_restarts(logged: tuple, launch: Launch | None) -> tuple:
    """The log's restarts from earlier launches, then this launch's (it passes all of its own every time)."""
    if launch is None or not launch.restarts:
        return tuple(logged)
    ours = {r["launch"] for r in launch.restarts}
    return tuple(r for r in logged if r["launch"] not in ours) + tuple(launch.restarts)


def resolve_config(config_path: str | None, overrides, resume: str | None):
    """The config to run and, when resuming, the resume point (whose config must match)."""
    if resume is None:
        return config_mod.load_config(config_path, overrides), None
    point = read_resume_point(resume)
    where = f"the config stored in {resume}"
    if config_path is None:
        stored, _ = config_mod.stored_config(point.config_toml, where)
        for item in overrides:
            config_mod.apply_override(stored, item)
            config_mod.absolute_paths(stored, Path.cwd())
        cfg = config_mod.config_from_dict(stored)
    else:
        cfg = config_mod.load_config(config_path, overrides)
    logged, diffs = config_mod.log_differences(cfg, point.config_toml, where)
    if diffs:
        raise RunLogError(
            f"--resume {resume}: the log belongs to a different config (differs in {', '.join(diffs)}); "
            "resume with the config it was started with, or start a new run"
        )
    return config_mod.with_placement(logged, cfg), point


def start_weights(cfg: Config, log_path: Path | None = None, resume_point=None, on_info=None) -> dict | None:
    """The state_dict the run starts from (None: drawn from the seed): model.weights read, or for a resumed run
    the one its log started from, whatever the file holds now (a warning says when it moved or changed)."""
    if cfg.model.weights is None:
        return None
    if resume_point is None or resume_point.fresh:
        return read_weights(cfg.model.weights, cfg.model.weights_round)
    weights, warning = resumed_weights(cfg.model.weights, cfg.model.weights_round, log_path)
    if warning:
        on_info(warning)
    return weights


def same_data(resume_point, n_train: np.ndarray) -> None:
    """A resumed run must train on the data it started with: the devices' sample counts the log keeps are a
    fingerprint of the data and its partition (a changed file, or a partition drawn otherwise)."""
    logged = None if resume_point is None or resume_point.fresh else resume_point.n_train
    if logged is None or np.array_equal(logged, n_train):
        return
    if logged.shape != n_train.shape:
        raise RunLogError(f"--resume: the log's run had {logged.size} devices but its data now gives {n_train.size}; "
                          "resume with the data the run started with")
    k = int(np.flatnonzero(logged != n_train)[0])
    raise RunLogError(f"--resume: device {k} trained on {int(logged[k])} samples in the log's run but its data now "
                      f"gives it {int(n_train[k])}: the data file or its partition changed since the run started; "
                      "resume with the data it started with, or start a new run")
