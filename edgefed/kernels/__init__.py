"""Numba kernels, one module per model, over flat parameter vectors.

`JIT` is the one place the Numba flags live. fastmath stays off: it lets LLVM reorder float sums, and a
trajectory must not depend on which machine or compiler version produced it.
"""

JIT = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")

KERNEL_MODULES = ("logreg", "mlp", "cnn", "quadratic", "linalg", "random", "sgd", "softmax")


def jit_compilations() -> int:
    """How many kernel signatures this process compiled from scratch so far (Numba cache misses).

    A load from the on-disk cache is not counted: it takes milliseconds, a compilation seconds (tens of
    seconds on a Pi), which is what a deadline must not pay for.
    """
    import importlib

    from numba.core.dispatcher import Dispatcher

    total = 0
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        for obj in vars(module).values():
            if isinstance(obj, Dispatcher):
                total += sum(obj.stats.cache_misses.values())
    return total
