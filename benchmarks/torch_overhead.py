"""A PyTorch module under edgefed beside plain PyTorch and beside the same network as a layer list, one thread.

    python benchmarks/torch_overhead.py [--repeats 40] [--steps 20]

Two networks, each three ways: as a `[model] kind = "torch"` module (edgefed's TorchModel: the parameters
views into the round's flat vector, minibatches from the device's stream, the step y -= lr g on the flat
vector), as plain PyTorch (the same module class and weights, `torch.optim.SGD`, zero_grad, forward,
cross-entropy, backward, step, minibatches sliced from a per-epoch permutation: a training loop's cheapest
form), and as a `sequential` layer list (edgefed's Numba kernels). The networks: Flower's PyTorch quickstart
CNN on 3x32x32 images at batch 32 (examples/flower_quickstart.py), and McMahan et al.'s 2NN (784-200-200-10)
at batch 10, where a step is short and any per-step cost shows.

Per step: one step per call (how a deadline runs a torch model: chunks of one step, the clock read between).
Per round: begin() plus K steps in one call, as a device's round without a deadline. The overhead is
edgefed's torch time over plain PyTorch's, minus one (target <= 5 %). All three alternate in blocks so a slow
phase of the machine hits them alike.
"""

from __future__ import annotations

import os

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[var] = "1"

import argparse  # noqa: E402
import copy  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from edgefed import layers as layer_lib  # noqa: E402
from edgefed.models import Sequential  # noqa: E402
from edgefed.problems import ClassificationData  # noqa: E402
from edgefed.rng import Purpose, generator, kernel_state  # noqa: E402
from edgefed.torchmodel import TorchModel, import_torch  # noqa: E402
from kernel_speed import paired_times  # noqa: E402 - the same alternating blocks

torch = import_torch()  # one thread, deterministic algorithms: the settings edgefed runs torch with
nn = torch.nn
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RELU = {"type": "relu"}


def mlp(input_shape, n_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 200), nn.ReLU(), nn.Linear(200, 200),
                         nn.ReLU(), nn.Linear(200, n_classes))


NETWORKS = {  # name: (module file, factory, sample shape, classes, batch, the same network as a layer list)
    "Flower quickstart CNN": (str(EXAMPLES / "flower_quickstart.py"), "factory", (3, 32, 32), 10, 32, [
        {"type": "conv2d", "out": 6, "kernel": 5, "padding": "valid"}, RELU, {"type": "maxpool2d", "size": 2},
        {"type": "conv2d", "out": 16, "kernel": 5, "padding": "valid"}, RELU, {"type": "maxpool2d", "size": 2},
        {"type": "flatten"}, {"type": "dense", "out": 120}, RELU, {"type": "dense", "out": 84}, RELU,
        {"type": "dense", "out": 10}]),
    "2NN": (__file__, "mlp", (784,), 10, 10, [
        {"type": "flatten"}, {"type": "dense", "out": 200}, RELU, {"type": "dense", "out": 200}, RELU,
        {"type": "dense", "out": 10}]),
}


def data_for(shape, classes, n=500):
    g = np.random.default_rng(0)
    X = g.random((n, int(np.prod(shape))), dtype=np.float32)
    y = g.integers(0, classes, n)
    return ClassificationData(X, y, X[:10], y[:10])


class PlainLoop:
    """Plain PyTorch: the module, torch.optim.SGD, minibatches sliced from a per-epoch permutation."""

    def __init__(self, model: TorchModel, params, data, batch: int, lr: float):
        self.module = copy.deepcopy(model.module)  # the same class, its own storage and gradients
        with torch.no_grad():
            for p, off, shape in zip(self.module.parameters(), model.offsets, model.shapes):
                p.copy_(torch.from_numpy(params[off:off + int(np.prod(shape))]).view(shape))
        for p in self.module.parameters():
            p.grad = None
        self.opt = torch.optim.SGD(self.module.parameters(), lr=lr)
        self.X = torch.from_numpy(data.X_train).view((-1, *model.sample_shape))
        self.y = torch.from_numpy(data.y_train)
        self.batch, self.gen = batch, torch.Generator().manual_seed(1)
        self.perm, self.at = torch.randperm(self.X.shape[0], generator=self.gen), 0
        self.module.train()

    def steps(self, k: int) -> None:
        for _ in range(k):
            if self.at + self.batch > self.X.shape[0]:
                self.perm, self.at = torch.randperm(self.X.shape[0], generator=self.gen), 0
            rows = self.perm[self.at:self.at + self.batch]
            self.at += self.batch
            self.opt.zero_grad()
            nn.functional.cross_entropy(self.module(self.X[rows]), self.y[rows]).backward()
            self.opt.step()


def table(repeats: int, k: int) -> None:
    print("| network | parameters | batch | measure | layer list (Numba) ms | torch module under edgefed ms | "
          "plain PyTorch ms | edgefed's overhead on torch |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    lr = 0.01
    for name, (path, factory, shape, classes, batch, layers) in NETWORKS.items():
        data = data_for(shape, classes)
        tm = TorchModel(path, factory, shape, classes, np.float32, generator(0, Purpose.INIT))
        seq = Sequential.seeded(layer_lib.build(layer_lib.check_layers(layers), shape, classes, np.float32), np.float32, 0)
        assert seq.n_trainable == tm.n_trainable, (seq.n_trainable, tm.n_trainable)
        x_t, x_s = tm.initial_params(), seq.initial_params()
        plain = PlainLoop(tm, x_t, data, batch, lr)
        state = kernel_state(0, Purpose.LOCAL, 1, 0)
        run_t, run_s = tm.begin(data, state), seq.begin(data, state)
        per_step = paired_times({
            "sequential": lambda: seq.local_steps(x_s, data, run_s, 1, batch, lr),
            "torch": lambda: tm.local_steps(x_t, data, run_t, 1, batch, lr),
            "plain": lambda: plain.steps(1)}, repeats)
        per_round = paired_times({
            "sequential": lambda: seq.local_steps(x_s, data, seq.begin(data, state), k, batch, lr),
            "torch": lambda: tm.local_steps(x_t, data, tm.begin(data, state), k, batch, lr),
            "plain": lambda: plain.steps(k)}, max(repeats // 4, 10))
        for what, t in (("a step (1 per call)", per_step), (f"a round ({k} steps)", per_round)):
            print(f"| {name} | {tm.n_trainable:,} | {batch} | {what} | {t['sequential'] * 1e3:.3f} | {t['torch'] * 1e3:.3f} "
                  f"| {t['plain'] * 1e3:.3f} | {(t['torch'] / t['plain'] - 1) * 100:+.1f} % |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--steps", type=int, default=20, help="K, the local steps of a round")
    args = parser.parse_args()
    print(f"{platform.machine()}, {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"NumPy {np.__version__}, PyTorch {torch.__version__}, one thread, deterministic algorithms\n")
    table(args.repeats, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
