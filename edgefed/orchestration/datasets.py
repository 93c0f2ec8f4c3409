"""`edgefed data shard`: each device rank's shard of a run's data, made on the head node before the world."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgefed import config as config_mod
from edgefed.orchestration.run import problem_key
from edgefed.outputs import check_folder
from edgefed.problems import build_problem
from edgefed.problems.shard import shard_name, write_shard
from edgefed.runtime.mpi.placement import device_owners


def make_shards(config: str | None, overrides, ranks: int, out, force: bool) -> list[tuple[int, Path, int]]:
    """rank-1.h5 .. rank-(ranks-1).h5 in out, for a world of `ranks` ranks running this config: each holds the
    rows of the devices its rank hosts (the run's placement: round-robin, or [mpi] device_ranks). Returns
    (rank, file, bytes) of each."""
    cfg = config_mod.load_config(config, overrides)
    names = [shard_name(rank) for rank in range(1, ranks)]
    folder = check_folder(out, names, force=force, inputs=config_mod.files_read(cfg), flag="--out")
    problem = build_problem(*problem_key(cfg))
    owners = device_owners(problem.n_devices, ranks, cfg.mpi.device_ranks)
    folder.mkdir(parents=True, exist_ok=True)
    return [(rank, folder / name, write_shard(problem, np.flatnonzero(owners == rank), folder / name))
            for rank, name in enumerate(names, 1)]
