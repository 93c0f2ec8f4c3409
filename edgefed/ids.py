"""Device ids kept as ascending arrays, looked up by search: a large federation's membership tests cost the
ids asked about, never a set or dict of every device."""

import numpy as np


def find(ascending: np.ndarray, ids) -> tuple[np.ndarray, np.ndarray]:
    """(where each of `ids` would sit in `ascending`, whether it is there)."""
    ids = np.asarray(ids, np.int64)
    if not ascending.size:
        return np.zeros(ids.size, np.int64), np.zeros(ids.size, bool)
    at = np.minimum(np.searchsorted(ascending, ids), ascending.size - 1)
    return at, ascending[at] == ids
