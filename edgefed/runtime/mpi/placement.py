"""Which rank hosts which device."""

from __future__ import annotations

import numpy as np

from edgefed.errors import ConfigError


def device_owners(n_devices: int, size: int, device_ranks=()) -> np.ndarray:
    """The rank hosting each device: round-robin over 1..P-1, or the config's `[mpi] device_ranks`."""
    if not device_ranks:
        return 1 + np.arange(n_devices) % (size - 1)
    owners = np.asarray(device_ranks, dtype=np.int64)
    if owners.size != n_devices:
        raise ConfigError(f"config: mpi.device_ranks has {owners.size} entries; give one rank per device ({n_devices})")
    bad = owners[(owners < 1) | (owners >= size)]
    if bad.size:
        raise ConfigError(f"config: mpi.device_ranks holds rank {bad[0]}; devices live on ranks 1..{size - 1} "
                          f"of this mpirun -n {size}")
    return owners
