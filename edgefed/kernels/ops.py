"""Each layer operation compiled on its own, only when a model has it, and called by the network kernel
through a table of their addresses (one forward and one backward signature for all): a logistic regression
never waits for a convolution, and a model made of operations already compiled compiles nothing. The loss and
the SGD step every network ends with (objective.py) are called the same way, so that a cold start compiles
them, and the model's operations, beside the network kernel (Apart).

A table is (ROWS, SLOTS) int64 addresses: row FORWARD and BACKWARD by operation code, row OBJECTIVE by LOSS and
STEP. A kernel is named by its (row, slot).
"""

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
from numba import from_dtype, types
from numba.extending import intrinsic

from edgefed.kernels import count_compilations, jit_compilations
from edgefed.kernels.conv import (conv_backward_op, conv_forward_op, global_pool_backward_op, global_pool_forward_op,
                                  pool_backward_op, pool_forward_op)
from edgefed.kernels.dense import dense_backward_op, dense_forward_op, dense_stepped_backward_op
from edgefed.kernels.norm import groupnorm_backward_op, groupnorm_forward_op
from edgefed.kernels.objective import loss_op, step_op
from edgefed.kernels.pointwise import (activation_backward_op, activation_forward_op, dropout_backward_op,
                                       dropout_forward_op, permute_backward_op, permute_forward_op)
from edgefed.kernels.program import (ACTIVATION, CONV, DENSE, DENSE_STEPPED, DROPOUT, EMBEDDING, GLOBAL_POOL, GROUPNORM,
                                     GRU, INPUT, LSTM, PERMUTE, POOL)
from edgefed.kernels.sequence import (embedding_backward_op, embedding_forward_op, gru_backward_op, gru_forward_op,
                                      lstm_backward_op, lstm_forward_op)

OPERATIONS = {  # code -> (forward, backward)
    DENSE: (dense_forward_op, dense_backward_op),
    DENSE_STEPPED: (dense_forward_op, dense_stepped_backward_op),
    CONV: (conv_forward_op, conv_backward_op),
    POOL: (pool_forward_op, pool_backward_op),
    GLOBAL_POOL: (global_pool_forward_op, global_pool_backward_op),
    ACTIVATION: (activation_forward_op, activation_backward_op),
    DROPOUT: (dropout_forward_op, dropout_backward_op),
    GROUPNORM: (groupnorm_forward_op, groupnorm_backward_op),
    PERMUTE: (permute_forward_op, permute_backward_op),
    EMBEDDING: (embedding_forward_op, embedding_backward_op),
    LSTM: (lstm_forward_op, lstm_backward_op),
    GRU: (gru_forward_op, gru_backward_op),
}
FORWARD, BACKWARD, OBJECTIVE = range(3)  # a table's rows
LOSS, STEP = 0, 1  # row OBJECTIVE's slots
OBJECTIVES = (loss_op, step_op)
ROWS, SLOTS = 3, max(OPERATIONS) + 1  # every code has a slot (INPUT's, and absent ones, hold 0: never called)


def kernel(row: int, slot: int):
    """The compiled function (a Numba dispatcher) of (row, slot)."""
    return OBJECTIVES[slot] if row == OBJECTIVE else OPERATIONS[slot][row]


def signature(row: int, slot: int, dtype) -> tuple:
    """(argument types, return type) kernel (row, slot) is compiled for, in a model of this dtype: one forward
    and one backward signature for every operation."""
    f = from_dtype(np.dtype(dtype))
    vec, mat = types.Array(f, 1, "C"), types.Array(f, 2, "C")
    ints, ints2 = types.Array(types.int64, 1, "C"), types.Array(types.int64, 2, "C")
    aux, rng, terms = types.Array(types.int32, 2, "C"), types.Array(types.uint64, 1, "C"), types.UniTuple(vec, 3)
    i64, flag = types.int64, types.boolean
    if row == FORWARD:
        return (ints, types.float64, ints, vec, mat, aux, vec, vec, i64, i64, flag, rng), types.none
    if row == BACKWARD:
        return (ints, types.float64, ints, vec, vec, mat, mat, aux, mat, vec, vec, vec, vec, vec, i64, i64, flag, f,
                terms), types.none
    if slot == LOSS:
        return ((ints2, ints, mat, ints, i64, i64, f, i64, mat, mat, flag, flag, types.float64),
                types.Tuple((types.float64, types.int64)))
    return (ints2, vec, vec, f, terms), types.none


_addresses = {}  # (row, slot, dtype) -> the compiled function's address, for the process
_lock = threading.Lock()


def cached(dispatcher, args) -> bool:
    """Whether a compilation of dispatcher for these argument types is in this process or in Numba's on-disk
    cache (the test Dispatcher.compile makes first, through the same private `_cache`; loading it is
    milliseconds, compiling it seconds). Without that attribute (another Numba), every kernel counts as
    uncached: a warm start then only starts a helper that finds everything cached."""
    if tuple(args) in dispatcher.overloads:
        return True
    cache = getattr(dispatcher, "_cache", None)
    return cache is not None and cache.load_overload(tuple(args), dispatcher.targetctx) is not None


def kernels_of(codes) -> list[tuple[int, int]]:
    """(row, slot) of every kernel a program of these operation codes calls: its operations' forward and
    backward, then the loss and the step. An unknown code never reaches the network: ValueError."""
    codes = sorted({int(c) for c in codes} - {INPUT})
    unknown = [c for c in codes if c not in OPERATIONS]
    if unknown or not codes:
        raise ValueError(f"operation codes {unknown or codes} have no kernel")
    return [(row, c) for c in codes for row in (FORWARD, BACKWARD)] + [(OBJECTIVE, LOSS), (OBJECTIVE, STEP)]


NAMES = {DENSE: "dense", DENSE_STEPPED: "dense (stepped)", CONV: "convolution", POOL: "pooling",
         GLOBAL_POOL: "global pooling", ACTIVATION: "activation", DROPOUT: "dropout", GROUPNORM: "group norm",
         PERMUTE: "permutation", EMBEDDING: "embedding", LSTM: "LSTM", GRU: "GRU"}


def kernel_names(items) -> list[str]:
    """The kernels (row, slot), in words: an operation once for its forward and backward."""
    ops = [NAMES[slot] for row, slot in items if row != OBJECTIVE]
    objective = [("loss", "SGD step")[slot] for row, slot in items if row == OBJECTIVE]
    return list(dict.fromkeys(ops)) + objective


def uncached(items, dtype) -> list[tuple[int, int]]:
    """Those of the kernels (row, slot) that would compile, not load."""
    return [(row, slot) for row, slot in items if not cached(kernel(row, slot), signature(row, slot, dtype)[0])]


def address(row: int, slot: int, dtype) -> int:
    """The address of kernel (row, slot) for this dtype, compiled (or loaded from the cache) on first use."""
    key = (row, slot, np.dtype(dtype))
    with _lock:
        if key not in _addresses:
            dispatcher, (args, _) = kernel(row, slot), signature(row, slot, dtype)
            dispatcher.compile(args)  # (loaded if another process put it in the cache meanwhile)
            result = dispatcher.overloads[args]
            _addresses[key] = result.library.get_pointer_to_function(result.fndesc.llvm_func_name)
        return _addresses[key]


class Apart:
    """Kernels compiled in a process of their own beside this one (a cold start: on two cores in about the
    time of the longer share). The two share the list by claims: whoever first creates an item's claim file
    compiles it, the helper from the first item on, this process (when done with its own work) from the last."""

    def __init__(self, todo, dtype):
        self.todo, self.dtype = list(todo), np.dtype(dtype)
        self.folder = tempfile.mkdtemp(prefix="edgefed-compile-")
        spec = ",".join(f"{row}:{slot}" for row, slot in self.todo)
        here = str(Path(__file__).resolve().parents[2])  # this edgefed's, whatever the helper's sys.path holds
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "edgefed.kernels.ops", self.dtype.name, spec, self.folder],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        except OSError:
            self.process = None

    def help(self) -> None:
        """Compile, from the last item back, what the helper has not claimed."""
        for row, slot in reversed(self.todo):
            if claim(self.folder, row, slot):
                address(row, slot, self.dtype)

    def wait(self) -> None:
        """Until the helper is done (each item is then in the cache, or compiled by the caller on use); what
        it compiled counts as this process's (jit_compilations)."""
        if self.process is not None:
            self.process.wait()
        try:
            count_compilations(int((Path(self.folder) / "compiled").read_text()))
        except (OSError, ValueError):
            pass
        shutil.rmtree(self.folder, ignore_errors=True)


def claim(folder: str, row: int, slot: int) -> bool:
    """Whether this process is first to claim the item (an exclusively created file)."""
    try:
        os.close(os.open(os.path.join(folder, f"{row}-{slot}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def tables(codes, dtype, apart: Apart | None = None) -> np.ndarray:
    """(ROWS, SLOTS) int64: the addresses of the kernels a program of these operation codes calls; only its own
    are compiled, the other slots hold 0 and are never called (the network calls only the codes of the program
    the table was made for). apart: the process compiling some of them, helped and waited for first."""
    items = kernels_of(codes)
    if apart is not None:
        apart.help()
        apart.wait()
    out = np.zeros((ROWS, SLOTS), np.int64)
    for row, slot in items:
        out[row, slot] = address(row, slot, dtype)
    return out


def _typed_call(row: int, kind: int, table, slot, args):
    """(signature, codegen) of a call of table[row, slot](*args) by Numba's own calling convention (as a direct
    call: no wrapper), or None unless args are what kernel (row, kind) is compiled for (every operation of a
    row shares one signature)."""
    if not (isinstance(table, types.Array) and table.dtype == types.int64 and isinstance(slot, types.Integer)):
        return None
    dtype = next(a.dtype for a in args if isinstance(a, types.Array) and isinstance(a.dtype, types.Float))
    expected, restype = signature(row, kind, np.dtype(str(dtype)))
    if tuple(types.unliteral(a) for a in args) != expected:
        return None

    def codegen(context, builder, sig, llargs):
        arr = context.make_array(sig.args[0])(context, builder, llargs[0])
        at = builder.add(context.get_constant(types.int64, row * SLOTS),
                         context.cast(builder, llargs[1], sig.args[1], types.int64))
        fnty = context.call_conv.get_function_type(restype, expected)
        fptr = builder.inttoptr(builder.load(builder.gep(arr.data, [at])), fnty.as_pointer())
        values = [context.cast(builder, v, t, e) for v, t, e in zip(llargs[2:], sig.args[2:], expected)]
        _, result = context.call_conv.call_function(builder, fptr, restype, expected, values)  # (none raises)
        return result

    return restype(table, slot, *args), codegen


@intrinsic
def call_forward(typingctx, table, code, op, slope, perms, params, acts, aux, cols, pads, r0, r1, train, rng):
    """table's forward of operation `code`, on these arguments (the forward signature)."""
    return _typed_call(FORWARD, 0, table, code, (op, slope, perms, params, acts, aux, cols, pads, r0, r1, train, rng))


@intrinsic
def call_backward(typingctx, table, code, op, slope, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock,
                  pads, r0, r1, step, lr, terms):
    """table's backward of operation `code`, on these arguments (the backward signature)."""
    return _typed_call(BACKWARD, 0, table, code, (op, slope, perms, params, grad, acts, deltas, aux, tr, cols, wt,
                                                  gt, gblock, pads, r0, r1, step, lr, terms))


@intrinsic
def call_loss(typingctx, table, slot, prog, labels, targets, idx, first, b, scale, loss_kind, acts, deltas,
              want_deltas, squares, loss):
    """table's loss (objective.loss_op): (the running loss, correct predictions or -1 - a bad label's row)."""
    return _typed_call(OBJECTIVE, LOSS, table, slot, (prog, labels, targets, idx, first, b, scale, loss_kind, acts,
                                                      deltas, want_deltas, squares, loss))


@intrinsic
def call_step(typingctx, table, slot, prog, params, grad, lr, terms):
    """table's SGD step (objective.step_op)."""
    return _typed_call(OBJECTIVE, STEP, table, slot, (prog, params, grad, lr, terms))


if __name__ == "__main__":  # an Apart's helper: python -m edgefed.kernels.ops DTYPE ROW:SLOT,... FOLDER
    for item in sys.argv[2].split(","):
        row, slot = map(int, item.split(":"))
        if claim(sys.argv[3], row, slot):
            address(row, slot, sys.argv[1])
    (Path(sys.argv[3]) / "compiled").write_text(str(jit_compilations()))
