"""Local-step speed of edgefed's Numba kernels beside NumPy and PyTorch CPU, single thread, in one run.

    python benchmarks/kernel_speed.py [--repeats 300]
    python benchmarks/kernel_speed.py --terms [--repeats 300]   # only: what an algorithm's local term costs

Prints this core's two ceilings first: its float32 fma throughput (a kernel of nothing but vector fmas on
registers) and OpenBLAS's sgemm on a large product. Then each model's time per SGD step (forward,
backward and update of one minibatch) beside NumPy and PyTorch, its GFLOP/s and its fraction of the
sgemm; then the products the models are made of, alone; then CNN evaluation of 10,000 images and the
cold start of the default experiment (a fresh kernel cache, in a subprocess). (Until issue 26 it also
timed each stage of the hand-written CNN step; the models are layer lists now, and benchmarks/layer_speed.py
times layer lists of your own.) edgefed runs a device's K
local steps in one kernel call, so its time per step is that of a K-step call divided by K (K = 20, the
default local_steps, for logistic regression and the 2NN; 1 for the CNN, whose step is long enough that
the call costs nothing); the one-step-per-call time is shown beside it. NumPy and PyTorch run one step per
Python call, as their training loops do. PyTorch is optional: without it those columns say "-". Threads
are pinned to one before anything loads a BLAS. A last table times each model's K-step call plain, with
SCAFFOLD's correction and with FedProx's proximal term (kernels/sgd.py), interleaved so their ratios hold
on a noisy machine.
"""

from __future__ import annotations

import os

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[var] = "1"

import argparse  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from edgefed.kernels import linalg  # noqa: E402
from edgefed.kernels.sgd import step_terms  # noqa: E402
from edgefed.models import Sequential  # noqa: E402
from edgefed.problems import ClassificationData  # noqa: E402
from edgefed.rng import Purpose, kernel_state  # noqa: E402
from edgefed.runlog import read_run  # noqa: E402

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # optional: only for the comparison
    torch = None


K_STEPS = 20


def LogReg(features, classes, dtype):  # noqa: N802 - the built-in models, as the tables name them
    return Sequential.builtin("logreg", (features,), classes, dtype)


def MLP(sizes, dtype, seed):  # noqa: N802
    return Sequential.builtin("mlp", (sizes[0],), sizes[-1], dtype, seed, tuple(sizes[1:-1]))


def CNN(pixels, classes, dtype, seed):  # noqa: N802
    return Sequential.builtin("cnn", (1, 28, 28), classes, dtype, seed)


def paired_times(fns: dict, repeats: int, rounds: int = 10) -> dict:
    """Median seconds per call of each function, in `rounds` alternating blocks (A's calls, B's calls, A's,
    ...), so a slow phase of the machine (this VM drifts by 2x within a minute) hits every function alike.
    A block's first call is not timed: the one before it left the caches full of another function's data."""
    times = {name: [] for name in fns}
    per_block = max(repeats // rounds, 2)
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            for _ in range(per_block):
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    return {name: float(np.median(ts)) for name, ts in times.items()}


def best_time(fn, repeats: int) -> float:
    """Median seconds per call after a warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


_SGEMM_OPERANDS = [np.random.rand(1024, 1024).astype(np.float32) for _ in range(2)]


def sgemm() -> None:
    """One OpenBLAS float32 GEMM of 1024^3, one thread: what a tuned BLAS gets from this core. Each table
    times it beside its rows (this VM's speed drifts by up to 2x within a run), so each ratio is of one moment."""
    np.matmul(*_SGEMM_OPERANDS)


def sgemm_gflops(seconds: float) -> float:
    return 2 * 1024**3 / seconds / 1e9


def gemm_peak(repeats: int = 10) -> float:
    return sgemm_gflops(best_time(sgemm, repeats))


def _fma_burst():
    """A kernel of nothing but vector fmas on registers (16 independent chains of edgefed's tile width):
    the core's float32 fma throughput, the ceiling any product can reach."""
    from llvmlite import ir
    from numba import njit
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    from edgefed.kernels.fma import TILE_BYTES

    lanes = TILE_BYTES // 8  # one vector register of float32

    @intrinsic
    def burst(typingctx, n, x):
        def codegen(context, builder, sig, args):
            vty = ir.VectorType(ir.FloatType(), lanes)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vty, [vty] * 3),
                                                f"llvm.fma.v{lanes}f32")
            undef = ir.Constant(vty, ir.Undefined)
            xv = builder.shuffle_vector(builder.insert_element(undef, args[1], ir.Constant(ir.IntType(32), 0)),
                                        undef, ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))
            slots = []
            for i in range(16):
                slot = cgutils.alloca_once(builder, vty)
                builder.store(xv, slot)
                slots.append(slot)
            mul = ir.Constant(vty, [ir.Constant(ir.FloatType(), 0.999999)] * lanes)
            with cgutils.for_range(builder, args[0]):
                for slot in slots:
                    builder.store(builder.call(fn, [builder.load(slot), mul, xv]), slot)
            total = builder.load(slots[0])
            for slot in slots[1:]:
                total = builder.fadd(total, builder.load(slot))
            return builder.extract_element(total, ir.Constant(ir.IntType(32), 0))
        return types.float32(n, x), codegen

    @njit
    def run(n):
        return burst(n, np.float32(1e-3))

    return run, 16 * lanes * 2


def fma_peak() -> float:
    run, flops_per_iter = _fma_burst()
    n = 2_000_000
    return flops_per_iter * n / best_time(lambda: run(n), 15) / 1e9


def numpy_step(sizes, X, y, params, batch, lr):
    """A plain NumPy minibatch SGD step of an MLP (no hidden layer = logistic regression)."""
    rows = np.random.randint(0, X.shape[0], batch)
    hs = [X[rows]]
    for i, (W, b) in enumerate(params):
        z = hs[-1] @ W + b
        hs.append(np.maximum(z, 0) if i < len(params) - 1 else z)
    z = hs[-1] - hs[-1].max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(batch), y[rows]] -= 1
    delta = p / batch
    for i in range(len(params) - 1, -1, -1):
        W, b = params[i]
        gW, gb = hs[i].T @ delta, delta.sum(axis=0)
        if i:
            delta = (delta @ W.T) * (hs[i] > 0)
        W -= lr * gW
        b -= lr * gb


def torch_step(model, opt, X, y, batch):
    rows = torch.randint(0, X.shape[0], (batch,))
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(X[rows]), y[rows])
    loss.backward()
    opt.step()


def mlp_flops(sizes, batch) -> int:
    """Forward, weight gradients, and input gradients of every layer but the first (none is computed)."""
    macs = [a * b for a, b in zip(sizes[:-1], sizes[1:])]
    return 2 * batch * (2 * sum(macs) + sum(macs[1:]))


def row(name, batch, ours, single, numpy_s, torch_s, flops, peaks):
    gf = flops / ours / 1e9
    cell = lambda t: "-" if t is None else f"{t * 1e6:.0f}"  # noqa: E731
    ratio = lambda t: "-" if t is None else f"{t / ours:.2f}x"  # noqa: E731
    print(f"| {name} | {batch} | {ours * 1e6:.1f} | {single * 1e6:.1f} | {cell(numpy_s)} | {cell(torch_s)} | "
          f"{ratio(torch_s)} | {ratio(numpy_s)} | {gf:.1f} | {gf / peaks[1]:.0%} | {gf / peaks[0]:.0%} |", flush=True)


def bench(name, sizes, batch, repeats, peaks):
    g = np.random.default_rng(0)
    X = g.random((2000, sizes[0]), dtype=np.float32)
    y = g.integers(0, sizes[-1], 2000)
    data = ClassificationData(X, y, X[:10], y[:10])
    model = LogReg(sizes[0], sizes[-1], np.float32) if len(sizes) == 2 else MLP(sizes, np.float32, 0)
    x = model.initial_params()
    run = model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0))
    params = [(0.01 * g.standard_normal((a, b), dtype=np.float32), np.zeros(b, np.float32))
              for a, b in zip(sizes[:-1], sizes[1:])]
    net = opt = tx = ty = None
    if torch is not None:
        layers = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(torch.nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(torch.nn.ReLU())
        net = torch.nn.Sequential(*layers)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        tx, ty = torch.from_numpy(X), torch.from_numpy(y)
    fns = {"ours": lambda: model.local_steps(x, data, run, K_STEPS, batch, 0.01),
           "single": lambda: model.local_steps(x, data, run, 1, batch, 0.01),
           "numpy": lambda: numpy_step(sizes, X, y, params, batch, 0.01), "sgemm": sgemm}
    if torch is not None:
        fns["torch"] = lambda: torch_step(net, opt, tx, ty, batch)
    med = paired_times(fns, repeats)
    row(name, batch, med["ours"] / K_STEPS, med["single"], med["numpy"], med.get("torch"), mlp_flops(sizes, batch),
        (peaks[0], sgemm_gflops(med["sgemm"])))


def bench_cnn(batch, repeats, peaks):
    """McMahan's CNN on 28x28 inputs: edgefed's kernel beside PyTorch (NumPy has no convolution to compare)."""
    g = np.random.default_rng(0)
    X = g.random((500, 784), dtype=np.float32)
    y = g.integers(0, 10, 500)
    data = ClassificationData(X, y, X[:10], y[:10])
    model = CNN(784, 10, np.float32, 0)
    x = model.initial_params()
    run = model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0))
    net = opt = tx = ty = None
    if torch is not None:
        nn = torch.nn
        net = nn.Sequential(nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                            nn.Linear(3136, 512), nn.ReLU(), nn.Linear(512, 10))
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        tx, ty = torch.from_numpy(X).reshape(-1, 1, 28, 28), torch.from_numpy(y)
    fns = {"ours": lambda: model.local_steps(x, data, run, 1, batch, 0.01), "sgemm": sgemm}
    if torch is not None:
        fns["torch"] = lambda: torch_step(net, opt, tx, ty, batch)
    med = paired_times(fns, repeats)
    ours, torch_s = med["ours"], med.get("torch")
    conv1, conv2, fc1, fc2 = 28 * 28 * 25 * 32, 14 * 14 * 25 * 32 * 64, 3136 * 512, 512 * 10
    flops = 2 * batch * (2 * (conv1 + conv2 + fc1 + fc2) + conv2 + fc1 + fc2)  # no input gradient of conv1
    row("CNN 5x5x32, 5x5x64, 512", batch, ours, ours, None, torch_s, flops, (peaks[0], sgemm_gflops(med["sgemm"])))
    return model, x


def bench_products(peaks, repeats):
    """Each dense product of the models alone (fresh operands, warm caches), as GFLOP/s."""
    print("\n| product (m x k x n) | what | µs | GFLOP/s | of sgemm (beside it) | of fma peak |\n"
          "| --- | --- | --- | --- | --- | --- |")
    g = np.random.default_rng(1)
    cases = (("2NN layer 1, batch 64", "Z += A W", 64, 784, 200, False),
             ("2NN layer 1, batch 64", "G += A^T D", 64, 784, 200, True),
             ("2NN layer 2, batch 64", "Z += A W", 64, 200, 200, False),
             ("2NN layer 1, batch 10", "Z += A W", 10, 784, 200, False),
             ("2NN layer 1, batch 10", "G += A^T D", 10, 784, 200, True),
             ("CNN conv2 (im2col), one sample", "Z += A W", 196, 800, 64, False),
             ("CNN conv2 weight gradient, one sample", "G += A^T D", 196, 800, 64, True),
             ("CNN fc1, batch 10", "Z += A W", 10, 3136, 512, False))
    for name, what, m, k, n, outer in cases:
        A = g.random((m, k), dtype=np.float32)
        if outer:
            D, G = g.random((m, n), dtype=np.float32), np.zeros((k, n), np.float32)
            fn = lambda: linalg.accumulate_outer(A, D, G, m, k, n)  # noqa: E731
        else:
            W, Z = g.random((k, n), dtype=np.float32), np.zeros((m, n), np.float32)
            fn = lambda: linalg.accumulate_product(A, W, Z, m, k, n)  # noqa: E731
        med = paired_times({"product": fn, "sgemm": sgemm}, repeats)
        t, peak = med["product"], sgemm_gflops(med["sgemm"])
        gf = 2 * m * k * n / t / 1e9
        print(f"| {name} ({m} x {k} x {n}) | {what} | {t * 1e6:.1f} | {gf:.1f} | {gf / peak:.0%} | "
              f"{gf / peaks[0]:.0%} |", flush=True)


def bench_cnn_eval(model, x, n=10_000):
    g = np.random.default_rng(2)
    X = g.random((n, 784), dtype=np.float32)
    y = g.integers(0, 10, n)
    model.loss_correct(x, X[:64], y[:64])
    t = time.perf_counter()
    model.loss_correct(x, X, y)
    print(f"\nCNN evaluation of {n:,} images (batched through the dense layers): {time.perf_counter() - t:.2f} s")


def cold_start():
    """The default experiment in a fresh process with an empty kernel cache: wall time and kernels compiled."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "NUMBA_CACHE_DIR": tmp}
        out = f"{tmp}/run.h5"
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "edgefed", "run", "--quiet", "--out", out], env=env, check=True,
                       capture_output=True)
        wall = time.perf_counter() - t
        attrs = read_run(out)["attrs"]
        compiled, warm_s = int(attrs["warmup_compiled"][0]), float(attrs["warmup_s"][0])
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "edgefed", "run", "--quiet", "--force", "--out", out], env=env,
                       check=True, capture_output=True)
        warm = time.perf_counter() - t
    print(f"cold start of the default experiment (`edgefed run`, 100 rounds): {wall:.2f} s for the whole process, "
          f"{compiled} kernels compiled in {warm_s:.2f} s; the same run with the cache warm: {warm:.2f} s")


def bench_terms(repeats):
    """Per-step time of a K-step call with no term, SCAFFOLD's correction, FedProx's proximal term."""
    print("\n| model | batch | plain µs/step | with SCAFFOLD's correction | with FedProx's term | correction / plain "
          "| FedProx / plain |\n| --- | --- | --- | --- | --- | --- | --- |")
    g = np.random.default_rng(0)
    for name, make, features, batch, k in (("logreg 60→10", lambda: LogReg(60, 10, np.float32), 60, 20, K_STEPS),
                                           ("2NN 784-200-200-10", lambda: MLP((784, 200, 200, 10), np.float32, 0),
                                            784, 10, K_STEPS),
                                           ("CNN", lambda: CNN(784, 10, np.float32, 0), 784, 10, 1)):
        X = g.random((500, features), dtype=np.float32)
        y = g.integers(0, 10, 500)
        data = ClassificationData(X, y, X[:10], y[:10])
        model = make()
        x = model.initial_params()
        run = model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0))
        variants = {"plain": step_terms(np.float32),
                    "correction": step_terms(np.float32, correction=np.full(model.n_trainable, 1e-4, np.float32)),
                    "prox": step_terms(np.float32, anchor=x.copy(), mu=0.01)}
        n = repeats if k > 1 else max(repeats // 60, 5)
        times = {v: [] for v in variants}
        for _ in range(n):  # interleaved: every variant sees the same machine state
            for v, terms in variants.items():
                t = time.perf_counter()
                model.local_steps(x, data, run, k, batch, 0.001, terms)
                times[v].append((time.perf_counter() - t) / k)
        med = {v: float(np.median(ts[1:])) for v, ts in times.items()}
        print(f"| {name} | {batch} | {med['plain'] * 1e6:.1f} | {med['correction'] * 1e6:.1f} | {med['prox'] * 1e6:.1f} "
              f"| {med['correction'] / med['plain']:.3f} | {med['prox'] / med['plain']:.3f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--terms", action="store_true", help="only the table of local terms")
    args = parser.parse_args()
    if args.terms:
        print(f"# {platform.machine()}, Python {platform.python_version()}, NumPy {np.__version__}")
        bench_terms(args.repeats)
        return
    import llvmlite.binding as llvm

    peaks = (fma_peak(), gemm_peak())
    version = "not installed" if torch is None else torch.__version__
    print(f"# {platform.machine()} ({llvm.get_host_cpu_name()}), Python {platform.python_version()}, "
          f"NumPy {np.__version__}, PyTorch {version}")
    print(f"# single-core float32 fma peak (vector fmas on registers): {peaks[0]:.1f} GFLOP/s; "
          f"OpenBLAS sgemm (1024^3): {peaks[1]:.1f} GFLOP/s\n")
    print(f"| model | batch | edgefed µs/step (K = {K_STEPS}) | edgefed, 1 step per call | NumPy µs/step | PyTorch µs/step "
          "| vs PyTorch | vs NumPy | GFLOP/s | of sgemm (beside it) | of fma peak |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    bench("logreg 60→10", (60, 10), 20, args.repeats, peaks)
    bench("2NN 784-200-200-10", (784, 200, 200, 10), 10, args.repeats // 2, peaks)
    bench("2NN 784-200-200-10", (784, 200, 200, 10), 64, max(args.repeats // 5, 30), peaks)
    model, x = bench_cnn(10, max(args.repeats // 10, 15), peaks)
    bench_products(peaks, max(args.repeats // 3, 20))
    bench_cnn_eval(model, x)
    cold_start()
    bench_terms(args.repeats)


if __name__ == "__main__":
    main()
