"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020; docs/design.md 2.9).

Local step y <- y - lr (g_k(y) + mu (y - x)), x the round's server model: the proximal term pulls every
device towards x, and whatever part of its budget a device completes is accepted (the paper's
gamma-inexact solutions), so it combines with every scheme. The term is one more vector in the kernels'
update (kernels/sgd.py), no extra pass over the data. The server is FedAvg's; mu = 0 is FedAvg exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgefed.algorithms.base import DELTA_X
from edgefed.algorithms.fedavg import FedAvg
from edgefed.kernels.sgd import step_terms
from edgefed.rng import Purpose


@dataclass(frozen=True)
class FedProx(FedAvg):
    mu: float = 0.01

    @classmethod
    def from_config(cls, cfg) -> "FedProx":
        return cls(cfg.fedprox.mu)

    def client_update(self, model, data, task, out):
        if self.mu == 0:  # FedAvg's very steps, not a zero term added to each
            return super().client_update(model, data, task, out)
        x = task.x
        y = x.copy()
        terms = step_terms(x.dtype, anchor=x, mu=self.mu)
        run = task.stream(Purpose.LOCAL)
        steps = task.runner(lambda n: model.local_steps(y, data, run, n, task.batch_size, task.lr, terms),
                            task.n_steps)
        np.subtract(y, x, out=out[DELTA_X])
        return steps
