"""A problem seen through a model's frozen prefix: the devices' samples are the prefix's outputs."""

from __future__ import annotations

import threading

import numpy as np

from edgefed.problems.data import ClassificationData


class FeatureProblem:
    """A problem whose devices' samples are a model's frozen prefix's outputs (Sequential.features), computed
    once when a device's data is built, in every process alike: the model's local steps and evaluation then
    run only its trainable rest. Everything else is the problem's own."""

    def __init__(self, problem, model):
        self._problem, self._model = problem, model
        self._lock = threading.Lock()  # lanes build devices from their threads: one extractor's workspaces
        self._extractor = None

    def __getattr__(self, name):
        return getattr(self._problem, name)

    def device(self, device_id: int) -> ClassificationData:
        data = self._problem.device(device_id)
        with self._lock:
            if self._extractor is None:
                self._extractor = self._model.clone()
            return ClassificationData(self._extractor.features(data.X_train), data.y_train,
                                      self._extractor.features(data.X_test), data.y_test)

    def device_bytes(self, device_ids=None) -> np.ndarray:
        """Each built device's data (of device_ids; None: every device): the samples as features (the raw ones
        are dropped once passed through)."""
        raw = self._problem.device_bytes(device_ids)
        return (raw * (self._model.n_features / max(self._model.n_inputs, 1))).astype(np.int64)
