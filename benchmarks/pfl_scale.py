"""The same large-federation workload in pfl-research (Apple's simulator of large populations), for
benchmarks/scale.py to be read against: SYNTHETIC(1,1) devices built by edgefed's own generator from the
same config (so both train on the same data), logistic regression (60 -> 10) in PyTorch, FedAvg with S users
a round, K local SGD steps of the config's batch and lr, server lr 1, the metrics every `log.eval_every`
rounds on the same 1,000 fixed users.

pfl is not one of edgefed's dependencies: install it apart and put it on the path, then let scale.py run
both side by side (`--pfl`), or this alone:

    pip install --target pfl_pkgs --no-deps pfl==0.6.0 'dp-accounting<0.6' 'multiprocess<0.71' dill \
        'prv-accountant<0.3' absl-py attrs dm-tree mpmath wrapt
    PYTHONPATH=pfl_pkgs:. python benchmarks/pfl_scale.py --devices 100000 1000000

(torch and scipy come from edgefed's own environment with the torch extra). Each N runs in its own process
(peak RSS its own); start-up is the time before the first round.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import time


def one(n: int, settings: list[str]) -> None:
    t0 = time.perf_counter()
    import numpy as np
    import torch

    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Weighted
    from pfl.model.pytorch import PyTorchModel

    from edgefed import config as config_mod
    from edgefed.participation.sampling import evaluation_sample
    from edgefed.problems.synthetic import SyntheticProblem

    torch.set_num_threads(1)
    cfg = config_mod.load_config(None, [f"data.clients={n}", *settings])
    rounds, t = cfg.rounds, cfg.train
    problem = SyntheticProblem(cfg.data, cfg.seed, np.dtype(np.float32))

    def user(uid):
        d = problem.device(int(uid))
        return Dataset(raw_data=[torch.from_numpy(d.X_train), torch.from_numpy(d.y_train)])

    def held_out(uid):
        d = problem.device(int(uid))
        return Dataset(raw_data=[torch.from_numpy(d.X_test), torch.from_numpy(d.y_test)])

    class LogReg(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(60, 10)
            torch.nn.init.zeros_(self.linear.weight)
            torch.nn.init.zeros_(self.linear.bias)

        def forward(self, x):
            return self.linear(x)

        def loss(self, x, y, eval=False):
            self.eval() if eval else self.train()
            return torch.nn.functional.cross_entropy(self(x), y)

        @torch.no_grad()
        def metrics(self, x, y, eval=False):
            logits = self(x)
            loss = torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
            correct = (logits.argmax(1) == y).sum().item()
            return {"loss": Weighted(loss, len(y)), "accuracy": Weighted(correct, len(y))}

    sample = evaluation_sample(cfg.seed, n, cfg.log.eval_devices)
    sample = np.arange(n) if sample is None else sample
    train = FederatedDataset(user, get_user_sampler("random", list(range(n))))
    val = FederatedDataset(held_out, get_user_sampler("minimize_reuse", sample.tolist()))
    module = LogReg()
    model = PyTorchModel(module, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(module.parameters(), lr=t.lr_global))
    backend = SimulatedBackend(training_data=train, val_data=val)
    started = time.perf_counter()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=rounds, evaluation_frequency=cfg.log.eval_every,
                                           train_cohort_size=t.clients_per_round, val_cohort_size=sample.size),
        backend=backend, model=model,
        model_train_params=NNTrainHyperParams(local_num_epochs=None, local_learning_rate=t.lr_local,
                                              local_batch_size=t.batch_size, local_num_steps=t.local_steps),
        model_eval_params=NNEvalHyperParams(local_batch_size=1000))
    done = time.perf_counter()
    print(f"{n} {started - t0:.2f} {done - started:.2f} "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} {rounds}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                        help="the workload's settings (default: scale.py's)")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    from scale import WORKLOAD, evaluated_on  # (benchmarks/ is this script's folder, first on the path)
    settings = WORKLOAD if args.set is None else args.set
    if args.one:
        settings = [*settings, *evaluated_on(args.one)]
        one(args.one, settings)
        return
    print(f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; command: "
          f"python benchmarks/pfl_scale.py {' '.join(sys.argv[1:])}\n")
    print("| devices N | start-up s | ms a round | peak RSS MB |\n| --- | --- | --- | --- |")
    for n in args.devices:
        r = measure(sys.executable, n, settings)
        print(f"| {n:,} | {r['start']:.1f} | {r['ms_round']:.0f} | {r['peak_mb']:.0f} |", flush=True)


def measure(python: str, n: int, settings: list[str]) -> dict:
    """One N in its own process of `python` (an interpreter that has pfl)."""
    sets = [a for s in settings for a in ("--set", s)]
    out = subprocess.run([python, __file__, "--one", str(n), *sets], capture_output=True, text=True,
                         check=True).stdout.split()
    _, startup, run_s, peak, rounds = out[-5:]
    return {"start": float(startup), "ms_round": 1e3 * float(run_s) / int(rounds), "peak_mb": float(peak)}


if __name__ == "__main__":
    main()
