"""`edgefed trace record`: measure participation traces with a deadline run, one device per trace.

Every device works every round under the deadline beside its CPU competitor; the completed fractions s/K
it logs become its trace. Under `mpiexec` the devices are a cluster's. Without a given deadline it is
1.1 times the time of the K steps on a free core of this machine, so fractions compare across machines.
An upload lost on a weak link (`drop`) is drawn from its own stream and makes the round inactive.
"""

from __future__ import annotations

import datetime
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from edgefed import config as config_mod
from edgefed.hwprofile import AUTO_FACTOR
from edgefed.outputs import check_output
from edgefed.orchestration.ranks import execute
from edgefed.orchestration.run import problem_and_model
from edgefed.rng import Purpose, generator, kernel_state
from edgefed.runlog import read_run
from edgefed.runtime.mpi.comm import world
from edgefed.tracefiles import write_trace_file


def record_traces(out: str, force: bool, names: list[str], loads: list[float], drops: list[float], *, rounds: int,
                  local_steps: int, deadline_s: float | None, seed: int, overrides=(), command: str = "",
                  on_round=None, on_info=print, on_error=print) -> int | None:
    """Record and write the trace file (an existing one replaced only with force); returns an exit code where
    this process wrote nothing (a device rank, or a run that failed), None once the file is written."""
    comm = world()
    coordinator = comm is None or comm.Get_rank() == 0  # device ranks get the config from rank 0

    def checked_out(cfg):  # (under mpiexec inside the setup, whose errors reach every rank)
        check_output(out, force=force, inputs=config_mod.files_read(cfg), example="traces.csv")
        return cfg

    if comm is None:  # before anything is measured
        checked_out(config_mod.load_config(None, list(overrides)))
    if deadline_s is None and coordinator:  # so a free device just completes K, a loaded one shows its loss
        deadline_s = round(AUTO_FACTOR * unloaded_seconds(local_steps, overrides), 5)
        on_info(f"deadline: {deadline_s * 1e3:.2f} ms ({AUTO_FACTOR} x the time of {local_steps} steps measured here)")
    tmp = tempfile.TemporaryDirectory()
    log_path = Path(tmp.name) / "record.h5"
    settings = [f"seed={seed}", f"rounds={rounds}", f"data.clients={len(names)}",
                'train.clients_per_round="all"', f"train.local_steps={local_steps}",
                'participation.mode="deadline"', f"participation.deadline_s={deadline_s}",
                f"participation.contention={loads}", f"log.eval_every={rounds}", *overrides]
    result = execute(lambda: (checked_out(config_mod.load_config(None, settings)), None, log_path), False, on_round,
                     on_info, on_error)
    if isinstance(result, int):
        return result
    log = read_run(log_path, state=False)
    fractions = log["participation/steps"] / np.maximum(log["participation/budget"], 1)
    for k, p in enumerate(drops):  # an upload lost on a weak link: the round counts as inactive
        lost = np.array([generator(seed, Purpose.TRACE_DROP, r + 1, k).random() < p for r in range(rounds)])
        fractions[lost, k] = 0.0
    meta = {"recorded": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "local_steps": local_steps, "deadline_s": deadline_s,
            "contention": ",".join(map(str, loads)), "drop": ",".join(map(str, drops))}
    write_trace_file(out, names, fractions, meta)
    return None


def unloaded_seconds(n_steps: int, overrides) -> float:
    """Median wall time of n_steps local steps of device 0 of the recording's model, on this core, unloaded."""
    cfg = config_mod.load_config(None, ['train.clients_per_round="all"', "data.clients=1", *overrides])
    problem, model = problem_and_model(cfg)
    data = problem.device(0)
    batch = None if cfg.train.batch_size == "full" else cfg.train.batch_size
    times = []
    for i in range(7):
        x = model.initial_params()
        run = model.begin(data, kernel_state(cfg.seed, Purpose.LOCAL, 1, 0))
        start = time.perf_counter()
        model.local_steps(x, data, run, n_steps, batch, cfg.train.lr_local)
        if i:  # the first call compiles or loads the kernels
            times.append(time.perf_counter() - start)
    return float(sorted(times)[len(times) // 2])
