"""Uniform fixed-size device sampling, from the round's own stream (independent of minibatch draws)."""

import numpy as np

from edgefed.rng import Purpose, generator


def evaluation_sample(seed: int, n_devices: int, count: int | None) -> np.ndarray | None:
    """The fixed devices a large federation's metrics are taken on ([log] eval_devices): `count` distinct
    devices drawn uniformly once, in ascending id, from their own stream; None: every device."""
    if count is None or count >= n_devices:
        return None
    return np.sort(generator(seed, Purpose.EVALUATION_SAMPLE).choice(n_devices, size=count, replace=False))


def select_devices(seed: int, round_idx: int, active_ids: np.ndarray, count: int) -> np.ndarray:
    """A uniform subset of `count` distinct devices of the active federation, in ascending device id."""
    active_ids = np.asarray(active_ids, dtype=np.int64)
    if count >= active_ids.size:
        return active_ids.copy()
    chosen = generator(seed, Purpose.SELECT, round_idx).choice(active_ids, size=count, replace=False)
    return np.sort(chosen)
