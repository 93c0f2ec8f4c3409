"""Which rank hosts which device."""

from __future__ import annotations

import numpy as np

from edgefed.errors import ConfigError


def round_robin_devices(rank: int, n_devices: int, size: int) -> np.ndarray:
    """The devices device rank `rank` hosts under the default placement (device_owners without device_ranks),
    computed on the rank itself: no array of every device travels or is held."""
    return np.arange(rank - 1, n_devices, size - 1, dtype=np.int64)


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
