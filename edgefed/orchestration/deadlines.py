"""Each device's deadline in deadline mode: the configured seconds, or a multiple of the time its K_k
steps take on its board, by that board's hardware profile."""

from __future__ import annotations

import dataclasses

import numpy as np

from edgefed import hwprofile
from edgefed.errors import ConfigError
from edgefed.participation.budgets import local_budgets


def device_deadlines(setup, owners: np.ndarray | None = None, on_info=None, resume_point=None):
    """Setup with each device's deadline: the configured seconds, or a multiple of the time its budget of
    K_k steps takes on its board, by the hardware profile of the rank hosting it (owners; None: this
    process hosts every device, on [device] profile's board). The deadlines go into the log's attributes;
    a resumed run keeps the ones its log holds, whatever its profiles say now."""
    cfg, p = setup.cfg, setup.cfg.participation
    if p.mode != "deadline":
        return setup
    n = setup.problem.n_devices
    factor = hwprofile.parse_deadline(p.deadline_s)
    logged = None if resume_point is None else resume_point.attrs.get("deadline_s")
    if logged is not None and np.shape(logged) == (n,):
        deadlines = np.asarray(logged, np.float64)
    elif factor is None:
        deadlines = np.full(n, float(p.deadline_s))
    else:
        if setup.model.kind not in hwprofile.MODELS:
            raise ConfigError(f"config: participation.deadline_s = {p.deadline_s!r} needs a profiled model "
                              f"({', '.join(hwprofile.MODELS)}); give the {setup.model.kind} model's deadline in seconds")
        dev = cfg.device
        if owners is None or not dev.boards:
            if dev.profile is None:
                raise ConfigError("config: the simulator runs every device on this machine; set [device] profile "
                                  "to its hardware profile (device.boards applies under mpirun)")
            names = [dev.profile] * n
        else:
            names = [dev.boards[int(r) - 1] for r in owners]
        profiles = {name: hwprofile.load_profile(name) for name in dict.fromkeys(names)}
        budgets = local_budgets(cfg.train, setup.problem.n_train)
        batches = setup.problem.n_train if cfg.train.batch_size == "full" else np.minimum(cfg.train.batch_size,
                                                                                          setup.problem.n_train)
        model = setup.model
        deadlines = np.array([factor * budgets[k] * profiles[names[k]].step_seconds(model.kind, int(batches[k]),
                                                                                      model.dim) for k in range(n)])
        if on_info is not None:
            parts = []
            for name, prof in profiles.items():
                mine = deadlines[[k for k in range(n) if names[k] == name]]
                estimated = "" if prof.measured else ", estimated speeds"
                parts.append(f"{prof.name} ({name}{estimated}): {mine.min() * 1e3:.1f}..{mine.max() * 1e3:.1f} ms")
            on_info(f"deadlines {factor:g}x the profiled time of each device's steps: " + "; ".join(parts))
    setup.header.attrs["deadline_s"] = deadlines
    return dataclasses.replace(setup, deadlines=deadlines)
