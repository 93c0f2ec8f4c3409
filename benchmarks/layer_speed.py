"""Layer lists of your own beside PyTorch, one thread, in one run: local steps, cold compilation, Pi estimates.

    python benchmarks/layer_speed.py [--repeats 40] [--no-cold]

Two models from the config's layer library (issue 26): a CIFAR-10 CNN (conv 5x5 32 "same", max pool 2,
conv 5x5 64 "same", max pool 2, dense 512, dense 10; ReLUs) at batch 20, and a keyword-spotting-sized 1-D
convolutional model (40 MFCC channels x 49 frames: conv1d 3 64, max pool 2, conv1d 3 64, max pool 2,
dense 12) at batch 20. Each is timed as edgefed runs a device's local steps (K steps in one call, K = 1 for
the CNN) beside the same network in PyTorch (the `torch.nn.Sequential` that `edgefed export` prints, built
from it, with edgefed's initial weights: zero_grad, forward, cross-entropy, backward, SGD step per Python
call, as a training loop does), alternating in blocks so a slow phase of this machine hits both alike.

Then the cold start: a fresh process with an empty kernel cache builds the CIFAR model and takes its first
steps (compiling the layer library's one entry), and a second process in the same cache builds a model it
has never seen (the 1-D one) and compiles nothing. Last, what the shipped board profiles predict for a
CIFAR step (their CNN entry scaled by parameters and batch) and for the cold compilation (this machine's,
scaled by its speed against the board's on the latency-bound logistic-regression step).
"""

from __future__ import annotations

import os

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from edgefed import hwprofile  # noqa: E402
from edgefed import layers as layer_lib  # noqa: E402
from edgefed.models import Sequential  # noqa: E402
from edgefed.problems import ClassificationData  # noqa: E402
from edgefed.rng import Purpose, kernel_state  # noqa: E402
from kernel_speed import paired_times  # noqa: E402 - the same alternating blocks

try:
    import torch
    from torch import nn

    torch.set_num_threads(1)
except ImportError:  # only for the comparison
    torch = nn = None

RELU = {"type": "relu"}
MODELS = {
    "CIFAR-10 CNN": ((3, 32, 32), 10, 20, 1, [
        {"type": "conv2d", "out": 32, "kernel": 5}, RELU, {"type": "maxpool2d", "size": 2},
        {"type": "conv2d", "out": 64, "kernel": 5}, RELU, {"type": "maxpool2d", "size": 2},
        {"type": "flatten"}, {"type": "dense", "out": 512}, RELU, {"type": "dense", "out": 10}]),
    "KWS 1-D conv": ((40, 49), 12, 20, 20, [
        {"type": "conv1d", "out": 64, "kernel": 3}, RELU, {"type": "maxpool1d", "size": 2},
        {"type": "conv1d", "out": 64, "kernel": 3}, RELU, {"type": "maxpool1d", "size": 2},
        {"type": "flatten"}, {"type": "dense", "out": 12}]),
}


def build(name: str, dtype=np.float32):
    shape, classes, batch, k, layers = MODELS[name]
    network = layer_lib.build(layer_lib.check_layers(layers), shape, classes, dtype)
    return Sequential.seeded(network, dtype, 0), batch, k


def data_for(model, n=400):
    g = np.random.default_rng(0)
    X = g.random((n, model.n_features), dtype=np.float32)
    y = g.integers(0, model.n_outputs, n)
    return ClassificationData(X, y, X[:10], y[:10])


def torch_twin(model, params):
    """The PyTorch Sequential edgefed export prints, with these weights."""
    module = eval(layer_lib.torch_text(model.network), {"nn": nn})  # noqa: S307 - our own text
    module.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in model.state_dict(params).items()})
    return module


def step_table(repeats: int) -> None:
    print("| model | batch | edgefed ms/step | PyTorch ms/step | edgefed vs PyTorch | target |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in MODELS:
        model, batch, k = build(name)
        data = data_for(model)
        x = model.initial_params()
        run = model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0))
        fns = {"edgefed": lambda: model.local_steps(x, data, run, k, batch, 0.01)}
        if torch is not None:
            module = torch_twin(model, x)
            opt = torch.optim.SGD(module.parameters(), lr=0.01)
            X = torch.from_numpy(data.X_train.reshape(-1, *model.network.input_shape))
            y = torch.from_numpy(data.y_train)
            loss_fn = nn.CrossEntropyLoss()
            g = np.random.default_rng(1)

            def torch_steps():
                for _ in range(k):
                    rows = torch.from_numpy(g.choice(X.shape[0], batch, replace=False))
                    opt.zero_grad()
                    loss_fn(module(X[rows]), y[rows]).backward()
                    opt.step()

            fns["torch"] = torch_steps
        t = paired_times(fns, repeats)
        ours = t["edgefed"] / k * 1e3
        theirs = t["torch"] / k * 1e3 if "torch" in t else float("nan")
        print(f"| {name} ({model.n_trainable:,} parameters) | {batch} | {ours:.3f} | {theirs:.3f} | {theirs / ours:.2f}x | "
              f">= 1.5x |")


COLD = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
sys.path.insert(0, sys.argv[2])
from layer_speed import build, data_for
from edgefed.kernels import jit_compilations
from edgefed.models import warm_model
model, batch, k = build(sys.argv[1])
t1 = time.perf_counter()
warm_model(model, data_for(model, 60), batch)
print(json.dumps({"import_s": t1 - t0, "first_steps_s": time.perf_counter() - t1, "compiled": jit_compilations()}))
"""


def cold(name: str, cache: str) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": cache}
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", COLD, name, os.path.dirname(os.path.abspath(__file__))],
                         capture_output=True, text=True, env=env, check=True)
    report = json.loads(out.stdout.splitlines()[-1])
    report["wall_s"] = time.perf_counter() - t
    return report


def cold_table() -> float:
    with tempfile.TemporaryDirectory() as cache:
        first = cold("CIFAR-10 CNN", cache)
        second = cold("KWS 1-D conv", cache)
    print("| process, one kernel cache | wall s | of it compiling and first steps, s | kernels compiled |")
    print("| --- | --- | --- | --- |")
    print(f"| CIFAR-10 CNN, empty cache | {first['wall_s']:.1f} | {first['first_steps_s']:.1f} | {first['compiled']} |")
    print(f"| then the KWS model, never seen | {second['wall_s']:.1f} | {second['first_steps_s']:.1f} | "
          f"{second['compiled']} |")
    return first["first_steps_s"]


def profile_table(cold_s: float) -> None:
    model, batch, _ = build("CIFAR-10 CNN")
    here = hwprofile.load_profile("x86-64-laptop").step_seconds("logreg", 20, 610)
    print("| board profile | CIFAR-10 CNN step at batch 20 (its cnn entry, scaled) | cold compilation (this machine's, "
          "scaled by the logreg step) |")
    print("| --- | --- | --- |")
    for name in hwprofile.shipped_names():
        prof = hwprofile.load_profile(name)
        step = prof.step_seconds("cnn", batch, model.n_trainable)
        ratio = prof.step_seconds("logreg", 20, 610) / here
        estimated = "" if prof.measured else " (estimated speeds)"
        print(f"| {prof.name}{estimated} | {step * 1e3:.0f} ms | {cold_s * ratio:.0f} s |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--no-cold", action="store_true")
    args = parser.parse_args()
    print(f"{platform.machine()}, {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"NumPy {np.__version__}, PyTorch {torch.__version__ if torch else '-'}, one thread\n")
    step_table(args.repeats)
    if not args.no_cold:
        print()
        cold_s = cold_table()
        print()
        profile_table(cold_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
