"""Client updates and server aggregation, pure: no transport, no files.

`ALGORITHMS` is the registry `train.algorithm` is checked against and built from.
"""

from edgefed.algorithms.base import Algorithm
from edgefed.algorithms.fedavg import FedAvg
from edgefed.algorithms.fedprox import FedProx
from edgefed.algorithms.scaffold import Scaffold

ALGORITHMS: dict[str, type[Algorithm]] = {"fedavg": FedAvg, "fedprox": FedProx, "scaffold": Scaffold}


def build_algorithm(cfg) -> Algorithm:
    """The algorithm a validated config names, with its own table's settings."""
    return ALGORITHMS[cfg.train.algorithm].from_config(cfg)
