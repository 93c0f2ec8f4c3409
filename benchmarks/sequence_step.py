"""Sequence models' local steps beside PyTorch, one thread: McMahan et al.'s character LSTM and a GRU of its size.

    python benchmarks/sequence_step.py [--quick] [--rounds R] [--steps K] [--no-memory]

Two networks over 80 token ids (batch 10, sequence length 80): the built-in "charlstm" (an 8-dimensional
embedding of 80 characters, two LSTM layers of 256 units, the last step's state into a dense layer of 80
classes: 819,920 parameters) and the same with GRU layers (embedding 80x8, GRU 256 x 2 layers, dense 80).
Each is timed as edgefed runs a device's local steps (`model.local_steps`, K SGD steps in one call, per step
= call / K) beside the same network in PyTorch (nn.Embedding, nn.LSTM or nn.GRU with batch_first=True and
num_layers=2, nn.Linear on the last step's output, nn.CrossEntropyLoss, torch.optim.SGD: zero_grad, forward,
backward, step per Python call, minibatches sliced from a per-epoch permutation) with edgefed's initial
weights, one thread each. Beside the steps, each framework's forward pass alone on 10 samples (edgefed's
evaluation, `model.loss_correct`; PyTorch's module under no_grad, with the loss). The four alternate in
rounds (this VM's speed drifts 2x within a minute, so a slow phase hits all alike): medians over every
round, the ratio PyTorch / edgefed of the medians, and its range over the rounds. Target: >= 1.3.
edgefed's kernels are compiled (or loaded from the cache) by a warm-up step before any timing; a check
line shows both frameworks' initial loss on the same 10 samples (the same network and weights).

Then the floor: a step's products counted from the shapes (3.81 GFLOP) at the rate edgefed's packed products
reach on this machine, beside PyTorch's matmul on the same shapes and PyTorch's LSTM step with and without
oneDNN's fused RNN kernels (which its x86 builds use): how fast a step could be before any gate arithmetic.

Then a device-sized run's peak resident memory: a fresh
process (no torch import; started through sh, so that it does not inherit this process's ru_maxrss)
builds the model, runs 300 local steps (--quick: 100) on 2,000 samples in calls of 20, each followed by
an evaluation of 200, and reports its ru_maxrss and VmHWM (target <= 250 MB).

Runtime: about 3 minutes (--quick about 1).
"""

from __future__ import annotations

import os

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numba  # noqa: E402
import numpy as np  # noqa: E402

from edgefed import layers as layer_lib  # noqa: E402
from edgefed.kernels.fma import TILE_BYTES, TILE_ROWS  # noqa: E402
from edgefed.models import Sequential  # noqa: E402
from edgefed.problems import ClassificationData  # noqa: E402
from edgefed.rng import Purpose, kernel_state  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

torch.set_num_threads(1)

VOCAB, LENGTH, EMBED, HIDDEN, STACKED, CLASSES, BATCH, LR = 80, 80, 8, 256, 2, 80, 10, 0.1
GRU_LAYERS = ({"type": "embedding", "num": VOCAB, "dim": EMBED},
              {"type": "gru", "hidden": HIDDEN, "layers": STACKED, "output": "last"}, {"type": "dense", "out": CLASSES})
MODELS = ("char-LSTM", "GRU")


def build(name: str) -> Sequential:
    if name == "char-LSTM":
        model = Sequential.builtin("charlstm", (LENGTH,), CLASSES, np.float32, seed=0)
        assert model.n_trainable == 819_920, model.n_trainable
        return model
    network = layer_lib.build(layer_lib.check_layers(GRU_LAYERS), (LENGTH,), CLASSES, np.float32)
    return Sequential.seeded(network, np.float32, 0, "pytorch")


def token_data(n: int, seed: int = 0) -> ClassificationData:
    """n random sequences of token ids (exact values in float32, as edgefed reads them) and next-token labels."""
    g = np.random.default_rng(seed)
    X = g.integers(0, VOCAB, (n, LENGTH)).astype(np.float32)
    y = g.integers(0, CLASSES, n)
    return ClassificationData(X, y, X[:10].copy(), y[:10].copy())


class TorchNet(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, EMBED)
        self.rnn = cell(EMBED, HIDDEN, num_layers=STACKED, batch_first=True)
        self.dense = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        out, _ = self.rnn(self.embedding(x))
        return self.dense(out[:, -1])


def torch_twin(name: str, model: Sequential, params: np.ndarray) -> TorchNet:
    """The PyTorch network with edgefed's weights (state_dict: PyTorch's names and layouts, 0. 1. 2. per layer)."""
    module = TorchNet(nn.LSTM if name == "char-LSTM" else nn.GRU)
    rename = {"0": "embedding", "1": "rnn", "2": "dense"}
    state = {rename[k.split(".", 1)[0]] + "." + k.split(".", 1)[1]: torch.from_numpy(np.ascontiguousarray(v).copy())
             for k, v in model.state_dict(params).items()}
    module.load_state_dict(state)
    return module


class TorchLoop:
    """Plain PyTorch training: torch.optim.SGD, minibatches sliced from a per-epoch permutation."""

    def __init__(self, module: TorchNet, data: ClassificationData):
        self.module, self.loss = module, nn.CrossEntropyLoss()
        self.opt = torch.optim.SGD(module.parameters(), lr=LR)
        self.X = torch.from_numpy(data.X_train.astype(np.int64))
        self.y = torch.from_numpy(data.y_train)
        self.gen = torch.Generator().manual_seed(1)
        self.perm, self.at = torch.randperm(self.X.shape[0], generator=self.gen), 0
        self.module.train()

    def steps(self, k: int) -> None:
        for _ in range(k):
            if self.at + BATCH > self.X.shape[0]:
                self.perm, self.at = torch.randperm(self.X.shape[0], generator=self.gen), 0
            rows = self.perm[self.at:self.at + BATCH]
            self.at += BATCH
            self.opt.zero_grad()
            self.loss(self.module(self.X[rows]), self.y[rows]).backward()
            self.opt.step()

    def forward(self, X, y) -> float:
        with torch.no_grad():
            return float(self.loss(self.module(X), y))


def alternate(fns: dict, rounds: int, per_block: int) -> dict:
    """Seconds per unit of each function, per round: in each round every function in turn, one untimed call
    (the one before left the caches full of another's data) then per_block timed ones. fns: name -> (fn, units
    per call)."""
    times = {name: [[] for _ in range(rounds)] for name in fns}
    for r in range(rounds):
        for name, (fn, units) in fns.items():
            fn()
            for _ in range(per_block):
                t = time.perf_counter()
                fn()
                times[name][r].append((time.perf_counter() - t) / units)
    return times


def median(rounds_of_times) -> float:
    return float(np.median([t for ts in rounds_of_times for t in ts]))


def step_table(rounds: int, per_block: int, k: int) -> dict:
    print(f"Per local step, batch {BATCH}, sequence length {LENGTH}, lr {LR}; {k} steps per call; {rounds} rounds x "
          f"{per_block} timed calls each, alternating; medians (ms)\n")
    print("| model | parameters | edgefed ms/step | PyTorch ms/step | PyTorch / edgefed (range over rounds) | "
          "edgefed forward, 10 samples | PyTorch forward, 10 samples (no_grad) | forward share of edgefed's step "
          "| target |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    out, checks = {}, []
    for name in MODELS:
        model = build(name)
        data = token_data(1000)
        x = model.initial_params()
        loop = TorchLoop(torch_twin(name, model, x), data)
        Xb, yb = data.X_train[:BATCH].copy(), data.y_train[:BATCH].copy()
        Xt, yt = torch.from_numpy(Xb.astype(np.int64)), torch.from_numpy(yb)
        ours_loss = model.loss_correct(x, Xb, yb)[0] / BATCH  # (also compiles or loads the evaluation kernel)
        checks.append(f"{name}: initial loss on 10 samples, edgefed {ours_loss:.6f}, PyTorch "
                      f"{loop.forward(Xt, yt):.6f} (the same weights)")
        run = model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0))
        model.local_steps(x, data, run, 1, BATCH, LR)  # warm-up: edgefed's kernels compiled or loaded before timing
        loop.steps(2)
        t = alternate({
            "edgefed": (lambda: model.local_steps(x, data, run, k, BATCH, LR), k),
            "torch": (lambda: loop.steps(k), k),
            "edgefed forward": (lambda: model.loss_correct(x, Xb, yb), 1),
            "torch forward": (lambda: loop.forward(Xt, yt), 1)}, rounds, per_block)
        finite = np.isfinite(x).all() and all(torch.isfinite(p).all() for p in loop.module.parameters())
        if not finite:
            checks.append(f"{name}: WARNING, the parameters went non-finite during timing")
        ratios = [np.median(tt) / np.median(te) for tt, te in zip(t["torch"], t["edgefed"])]
        ours, theirs = median(t["edgefed"]), median(t["torch"])
        fwd, tfwd = median(t["edgefed forward"]), median(t["torch forward"])
        out[name] = {"step": ours, "torch": theirs, "forward": fwd}
        print(f"| {name} | {model.n_trainable:,} | {ours * 1e3:.1f} | {theirs * 1e3:.1f} | {theirs / ours:.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}) | {fwd * 1e3:.1f} | {tfwd * 1e3:.1f} | {fwd / ours * 100:.0f} % "
              f"| >= 1.3x |")
    print()
    for line in checks:
        print(line)
    return out


# ------------------------------------------------------------------------------------------ peak memory
MEMORY = r"""
import json, os, resource, sys, time
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[var] = "1"
import numpy as np
from edgefed import layers as layer_lib
from edgefed.models import Sequential
from edgefed.problems import ClassificationData
from edgefed.rng import Purpose, kernel_state
layers, length, classes, vocab, samples, steps, batch, lr = json.loads(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
if layers is None:
    model = Sequential.builtin("charlstm", (length,), classes, np.float32, seed=0)
else:
    network = layer_lib.build(layer_lib.check_layers(layers), (length,), classes, np.float32)
    model = Sequential.seeded(network, np.float32, 0, "pytorch")
g = np.random.default_rng(0)
X = g.integers(0, vocab, (samples, length)).astype(np.float32)
y = g.integers(0, classes, samples)
test = max(samples // 10, 1)
data = ClassificationData(X, y, X[:test].copy(), y[:test].copy())
x = model.initial_params()
run = model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0))
done = 0
while done < steps:  # a device's rounds: local steps, then its local evaluation
    done += model.local_steps(x, data, run, min(20, steps - done), batch, lr)
    model.loss_correct(x, data.X_test, data.y_test)
hwm = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")]
print(json.dumps({"imports_mb": before, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "vmhwm_mb": int(hwm[0]) / 1024 if hwm else float("nan"),
                  "workspace_mb": model.memory_bytes(batch) / 2**20, "torch_loaded": "torch" in sys.modules}))
"""


def memory_table(samples: int, steps: int) -> None:
    print(f"\nPeak resident memory of a device-sized run: a fresh process, no torch import, builds the model, "
          f"{samples:,} samples of {LENGTH} tokens, {steps} local steps at batch {BATCH} in calls of 20, each call "
          f"followed by an evaluation of {max(samples // 10, 1)} (warm kernel cache)\n")
    print("| model | after imports MB | peak (ru_maxrss) MB | peak (VmHWM) MB | model's workspaces MB | target |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in MODELS:
        spec = [None if name == "char-LSTM" else list(GRU_LAYERS), LENGTH, CLASSES, VOCAB, samples, steps, BATCH, LR]
        # through sh, which forks it: a child this process forked itself would report this process's peak (Linux
        # keeps the larger ru_maxrss across fork and exec), hundreds of MB of PyTorch
        out = subprocess.run(["/bin/sh", "-c", '"$0" -c "$1" "$2"; exit $?', sys.executable, MEMORY, json.dumps(spec)],
                             capture_output=True, text=True)
        if out.returncode:
            print(f"| {name} | failed: {(out.stderr.strip().splitlines() or ['?'])[-1]} | | | | |")
            continue
        r = json.loads(out.stdout.splitlines()[-1])
        assert not r["torch_loaded"]
        print(f"| {name} | {r['imports_mb']:.0f} | {r['peak_mb']:.0f} | {r['vmhwm_mb']:.0f} | "
              f"{r['workspace_mb']:.1f} | "
              f"<= 250 MB |")


# ------------------------------------------------------------------------------------------ the floor
def lstm_step_flops() -> dict:
    """Multiply-adds x 2 of one char-LSTM step's products (batch b, length L): forward, and backward's input
    gradients and weight gradients. The gate arithmetic, the dense layer and the embedding are left out."""
    b, L, H, D = BATCH, LENGTH, HIDDEN, EMBED
    product = lambda rows, k, n: 2 * rows * k * n  # noqa: E731
    forward = product(L * b, D, 4 * H) + product(L * b, H, 4 * H) * 3  # layer 0: input, recurrent; layer 1: both
    backward = (product(L * b, 4 * H, H) * 2 + product(4 * H, L * b, H) * 2  # layer 1: dh, dx, dW_hh, dW_ih
                + product(L * b, 4 * H, H) + product(4 * H, L * b, H)  # layer 0: dh, dW_hh
                + product(L * b, 4 * H, D) + product(4 * H, L * b, D))  # layer 0: dx (to the embedding), dW_ih
    return {"forward": forward, "backward": backward}


def floor_table(rounds: int, measured: dict) -> None:
    """How fast could a char-LSTM step be? Its products' FLOPs at the rate edgefed's products reach, beside
    PyTorch's matmul on the same shapes and PyTorch's LSTM step with and without oneDNN's fused RNN kernels."""
    from numba import njit

    from edgefed.kernels import linalg

    @njit(cache=False)
    def recurrent(A, P, Z, steps, b, k, n):  # one step's product after another, as the forward runs them
        for t in range(steps):
            linalg.packed_product(A[t * b:(t + 1) * b], P, Z[t * b:(t + 1) * b], b, k, n, True)

    @njit(cache=False)
    def pack(B, k, n, P):
        linalg.pack_columns(B, k, n, P)

    g = np.random.default_rng(0)
    A = g.standard_normal((LENGTH * BATCH, HIDDEN), dtype=np.float32)
    W = g.standard_normal((HIDDEN, 4 * HIDDEN), dtype=np.float32)
    P = np.zeros(linalg.packed_values(HIDDEN, 4 * HIDDEN, 4), np.float32)
    Z = np.zeros((LENGTH * BATCH, 4 * HIDDEN), np.float32)
    pack(W, HIDDEN, 4 * HIDDEN, P)
    At, Wt = torch.from_numpy(A), torch.from_numpy(W)
    module = TorchNet(nn.LSTM)
    Xt = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))
    yt = torch.randint(0, CLASSES, (BATCH,), generator=torch.Generator().manual_seed(1))
    loss = nn.CrossEntropyLoss()

    def torch_step():
        for p in module.parameters():
            p.grad = None
        loss(module(Xt), yt).backward()
        with torch.no_grad():
            for p in module.parameters():
                p.add_(p.grad, alpha=-LR)

    def torch_step_plain():
        with torch.backends.mkldnn.flags(enabled=False):
            torch_step()

    rows, k, n = LENGTH * BATCH, HIDDEN, 4 * HIDDEN
    t = alternate({
        "edgefed products, 80 x (10 x 256 x 1024)": (lambda: recurrent(A, P, Z, LENGTH, BATCH, k, n), 1),
        "edgefed product, 800 x 256 x 1024": (lambda: recurrent(A, P, Z, 1, rows, k, n), 1),
        "torch matmul, 80 x (10 x 256 x 1024)": (lambda: [At[i:i + BATCH] @ Wt for i in range(0, rows, BATCH)], 1),
        "torch matmul, 800 x 256 x 1024": (lambda: At @ Wt, 1),
        "torch LSTM step (oneDNN)": (torch_step, 1),
        "torch LSTM step (oneDNN off)": (torch_step_plain, 1)}, rounds, 3)
    per = 2 * rows * k * n
    print("\nThe floor: one char-LSTM step's products (FLOPs from the shapes) at the rates measured here, "
          f"alternating, {rounds} rounds x 3 calls, medians\n")
    print("| what | ms | GFLOP/s |")
    print("| --- | --- | --- |")
    rate = {}
    for name, ts in t.items():
        ms = median(ts) * 1e3
        flops = per if "step" not in name else sum(lstm_step_flops().values())
        rate[name] = flops / (ms * 1e-3) / 1e9
        print(f"| {name} | {ms:.2f} | {rate[name]:.0f} |")
    flops = lstm_step_flops()
    total = sum(flops.values())
    best = max(rate["edgefed products, 80 x (10 x 256 x 1024)"], rate["edgefed product, 800 x 256 x 1024"])
    floor = total / (best * 1e9) * 1e3
    torch_ms = median(t["torch LSTM step (oneDNN)"]) * 1e3
    print(f"\nA step's products: {flops['forward'] / 1e9:.2f} GFLOP forward + {flops['backward'] / 1e9:.2f} backward = "
          f"{total / 1e9:.2f} GFLOP; at edgefed's best product rate here ({best:.0f} GFLOP/s) {floor:.1f} ms before any "
          f"gate arithmetic. PyTorch's step (oneDNN's fused LSTM) {torch_ms:.1f} ms; 1.3x of it is "
          f"{torch_ms / 1.3:.1f} ms, leaving {torch_ms / 1.3 - floor:.1f} ms for the gates, the dense layer and "
          f"the embedding.")
    if measured:
        ours = measured["char-LSTM"]["step"] * 1e3
        print(f"edgefed's char-LSTM step in the table above: {ours:.1f} ms, {ours - floor:.1f} ms over the floor.")


# ------------------------------------------------------------------------------------------ the machine
def machine() -> str:
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu = info.get("model name", platform.processor() or platform.machine())
    if "cpu family" in info:
        cpu += f" (family {info['cpu family']}, model {info['model']})"

    def cache(index):
        try:
            return Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size").read_text().strip()
        except OSError:
            return "?"

    import llvmlite.binding as llvm
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{cpu}, {os.cpu_count()} logical CPUs ({cores} usable), L1d {cache(0)} / L2 {cache(2)} / L3 {cache(3)}, "
            f"LLVM target {llvm.get_host_cpu_name()} (edgefed tiles {TILE_ROWS} x {TILE_BYTES} bytes), "
            f"{platform.system()} {platform.release()}\nPython {platform.python_version()}, NumPy {np.__version__}, "
            f"Numba {numba.__version__}, PyTorch {torch.__version__}; one thread each "
            f"(torch.get_num_threads() = {torch.get_num_threads()})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="about a minute: fewer rounds, steps and repeats")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 24, quick 6)")
    parser.add_argument("--steps", type=int, help="K, local steps per call (default 5, quick 3)")
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args()
    rounds = args.rounds or (6 if args.quick else 24)
    k = args.steps or (3 if args.quick else 5)
    t0 = time.perf_counter()
    print(f"command: {shlex.join([sys.executable] + sys.argv)}  (in {os.getcwd()})")
    print(machine() + "\n")
    measured = step_table(rounds, 2, k)
    floor_table(max(rounds // 2, 3), measured)
    if not args.no_memory:
        memory_table(2000, 100 if args.quick else 300)
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
