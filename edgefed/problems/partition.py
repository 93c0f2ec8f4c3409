"""Partitions of a labelled pool over N devices, all seeded and the same on every rank.

- `iid`: a seeded shuffle cut into N equal parts (or Pareto-sized parts with `samples = "pareto"`);
- `label`: each device draws one label uniformly at random and shares that label's samples equally with
  the devices that drew it (the flexible-participation paper's non-IID MNIST/EMNIST);
- `shards`: sort by label, cut into 2N shards, two per device (McMahan et al.'s pathological non-IID);
- `dirichlet`: each label's samples split over the devices in Dirichlet(alpha) proportions (Hsu et al.),
  drawn again while a device holds fewer than `data.min_partition_size` samples (as Flower's
  DirichletPartitioner), at most DIRICHLET_DRAWS times in all.
The partition needs only the labels (small), never the images.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from edgefed.errors import ConfigError
from edgefed.rng import Purpose, generator

PARTITIONS = ("iid", "label", "shards", "dirichlet")  # data.partition
MIN_SAMPLES = 2  # the fewest samples any partition leaves a device (one to train, one to test when held out)
DIRICHLET_DRAWS = 100  # the dirichlet partition's draws in all (the first and 99 redraws) before it refuses


class Partition(NamedTuple):
    parts: list[np.ndarray]  # ascending pool indices of every device
    draws: int | None  # the dirichlet partition's draws (1: the first fitted); None for the other kinds


def partition(kind: str, labels: np.ndarray, n_devices: int, seed: int, n_classes: int, alpha: float = 0.5,
              sizes: np.ndarray | None = None, min_size: int = MIN_SAMPLES) -> Partition:
    """Every device's pool indices, and the draws the dirichlet partition took. min_size
    (data.min_partition_size) applies to the dirichlet partition only; every partition leaves each device
    at least MIN_SAMPLES."""
    g = generator(seed, Purpose.DATA_DEVICE, round_idx=1)  # one stream for the whole partition
    draws = None
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
        parts, draws = _dirichlet(g, labels, n_devices, seed, n_classes, alpha, min_size)
    else:
        raise ConfigError(f"config: data.partition = {kind!r} is not known; choose one of {', '.join(PARTITIONS)}")
    out = [np.sort(p).astype(np.int64) for p in parts]
    empty = [k for k, p in enumerate(out) if p.size < MIN_SAMPLES]
    if empty:
        raise ConfigError(f"config: data.partition = {kind!r} leaves device {empty[0]} with {out[empty[0]].size} samples; "
                          "use fewer devices (data.clients) or another partition")
    return Partition(out, draws)


def _dirichlet(g, labels, n_devices, seed, n_classes, alpha, min_size) -> tuple[list[np.ndarray], int]:
    """Each label's samples in a seeded order (from g), cut in Dirichlet(alpha) shares, drawn until every
    device holds max(min_size, MIN_SAMPLES). Draw 0 is the partition's first (and, before min_partition_size,
    only) draw: class c's shares from the stream (seed, DATA_DEVICE, round 3, device c). Redraw a >= 1 draws
    class c's shares from (seed, DIRICHLET_REDRAW, round a, device c), a purpose no other draw uses; the
    labels' orders are drawn once (a device's size does not depend on them). So the result is a function of
    (seed, labels, N, alpha, min_size) alone."""
    pools = [g.permutation(np.flatnonzero(labels == c)) for c in range(n_classes)]
    need = max(int(min_size), MIN_SAMPLES)
    if labels.size < n_devices * need:  # no draw can fit: said at once, not after every draw was tried
        raise ConfigError(f'config: data.partition = "dirichlet" cannot give {n_devices} devices {need} samples each '
                          f"(data.min_partition_size) from {labels.size}; use at most {labels.size // need} devices "
                          "(data.clients) or a smaller min_partition_size")
    best = -1  # the largest smallest device over the draws
    for draw in range(DIRICHLET_DRAWS):
        purpose, round_idx = (Purpose.DATA_DEVICE, 3) if draw == 0 else (Purpose.DIRICHLET_REDRAW, draw)
        cuts, held = [], np.zeros(n_devices, np.int64)
        for c, pool in enumerate(pools):
            share = generator(seed, purpose, round_idx, c).dirichlet(np.full(n_devices, alpha))
            cuts.append(np.round(np.cumsum(share)[:-1] * pool.size).astype(np.int64))
            held += np.diff(np.clip(np.concatenate([[0], cuts[-1], [pool.size]]), 0, pool.size))  # np.split's sizes
        smallest = int(held.min())
        if smallest >= need:
            parts = [[] for _ in range(n_devices)]
            for pool, cut in zip(pools, cuts):
                for k, part in enumerate(np.split(pool, cut)):
                    parts[k].append(part)
            return [np.concatenate(p) for p in parts], draw + 1
        best = max(best, smallest)
    if min_size >= MIN_SAMPLES:
        below, fix = f"data.min_partition_size = {min_size}", ", or lower min_partition_size"
    else:
        below, fix = f"the {MIN_SAMPLES} samples every device needs", ""
    raise ConfigError(f'config: data.partition = "dirichlet" with dirichlet_alpha = {alpha} over {n_devices} devices '
                      f"left a device with {best} samples at best in {DIRICHLET_DRAWS} draws, below {below}; raise "
                      f"dirichlet_alpha, use fewer devices (data.clients){fix}")


def describe_partition(kind: str, alpha: float, draws: int | None, min_size: int) -> str:
    """A partition's name for a problem's describe(): the dirichlet one says when it was drawn again."""
    if kind != "dirichlet" or draws is None or draws <= 1:
        return kind
    return f"dirichlet({alpha}), {draws} draws for min_partition_size {min_size}"
