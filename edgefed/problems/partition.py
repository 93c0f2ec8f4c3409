"""Partitions of a labelled pool over N devices, all seeded and the same on every rank.

- `iid`: a seeded shuffle cut into N equal parts (or Pareto-sized parts with `samples = "pareto"`);
- `label`: each device draws one label uniformly at random and shares that label's samples equally with
  the devices that drew it (the flexible-participation paper's non-IID MNIST/EMNIST);
- `shards`: sort by label, cut into 2N shards, two per device (McMahan et al.'s pathological non-IID);
- `dirichlet`: each label's samples split over the devices in Dirichlet(alpha) proportions (Hsu et al.).
The partition needs only the labels (small), never the images.
"""

from __future__ import annotations

import numpy as np

from edgefed.errors import ConfigError
from edgefed.rng import Purpose, generator

PARTITIONS = ("iid", "label", "shards", "dirichlet")  # data.partition


def partition(kind: str, labels: np.ndarray, n_devices: int, seed: int, n_classes: int, alpha: float = 0.5,
              sizes: np.ndarray | None = None) -> list[np.ndarray]:
    """Ascending pool indices of every device."""
    g = generator(seed, Purpose.DATA_DEVICE, round_idx=1)  # one stream for the whole partition
    n = labels.size
    if kind == "iid":
        order = g.permutation(n)
        if sizes is None:
            parts = np.array_split(order, n_devices)
        else:
            cuts = np.cumsum(sizes)[:-1]
            parts = np.split(order[: int(np.sum(sizes))], cuts)
    elif kind == "label":
        choice = np.array([generator(seed, Purpose.DATA_DEVICE, 2, k).integers(n_classes) for k in range(n_devices)])
        parts = [None] * n_devices
        for c in range(n_classes):
            owners = np.flatnonzero(choice == c)
            if owners.size:
                pool = g.permutation(np.flatnonzero(labels == c))
                for k, part in zip(owners, np.array_split(pool, owners.size)):
                    parts[k] = part
    elif kind == "shards":
        order = np.lexsort((g.permutation(n), labels))  # by label, ties in a seeded order
        shards = np.array_split(order, 2 * n_devices)
        pick = g.permutation(2 * n_devices)
        parts = [np.concatenate([shards[pick[2 * k]], shards[pick[2 * k + 1]]]) for k in range(n_devices)]
    elif kind == "dirichlet":
        parts = [[] for _ in range(n_devices)]
        for c in range(n_classes):
            pool = g.permutation(np.flatnonzero(labels == c))
            share = generator(seed, Purpose.DATA_DEVICE, 3, c).dirichlet(np.full(n_devices, alpha))
            cuts = np.round(np.cumsum(share)[:-1] * pool.size).astype(np.int64)
            for k, part in enumerate(np.split(pool, cuts)):
                parts[k].append(part)
        parts = [np.concatenate(p) for p in parts]
    else:
        raise ConfigError(f"config: data.partition = {kind!r} is not known; choose one of {', '.join(PARTITIONS)}")
    out = [np.sort(p).astype(np.int64) for p in parts]
    empty = [k for k, p in enumerate(out) if p.size < 2]
    if empty:
        raise ConfigError(f"config: data.partition = {kind!r} leaves device {empty[0]} with {out[empty[0]].size} samples; "
                          "use fewer devices (data.clients) or another partition")
    return out
