"""Uniform fixed-size device sampling, from the round's own stream (independent of minibatch draws)."""

import numpy as np

from edgefed.rng import Purpose, generator


def select_devices(seed: int, round_idx: int, active_ids: np.ndarray, count: int) -> np.ndarray:
    """A uniform subset of `count` distinct devices of the active federation, in ascending device id."""
    active_ids = np.asarray(active_ids, dtype=np.int64)
    if count >= active_ids.size:
        return active_ids.copy()
    chosen = generator(seed, Purpose.SELECT, round_idx).choice(active_ids, size=count, replace=False)
    return np.sort(chosen)
