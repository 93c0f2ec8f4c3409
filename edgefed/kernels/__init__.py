"""Numba kernels over flat parameter vectors: the layer library's operations and the one entry that runs a
model (network.py), the quadratic's oracle, the products, the streams, secure aggregation's encoding.

`JIT` is the one place the Numba flags live. fastmath stays off: it lets LLVM reorder float sums, and a
trajectory must not depend on which machine or compiler version produced it.
"""

JIT = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")

def jit_compilations() -> int:
    """How many functions Numba compiled from scratch in this process so far (cache loads not counted).

    A load from the on-disk cache takes milliseconds, a compilation seconds (tens of seconds on a Pi),
    which is what a deadline must not pay for. Counted by a listener on Numba's compile event, so asking
    costs nothing.
    """
    return _COMPILES.count


def count_compilations(n: int) -> None:
    """Count n compilations made for this process by another (kernels/ops.py's helper) as its own."""
    _COMPILES.count += n


def _install_compile_counter():
    from numba.core import event

    class CompileCounter(event.Listener):
        count = 0

        def on_start(self, ev):
            pass

        def on_end(self, ev):
            CompileCounter.count += 1

    counter = CompileCounter()
    event.register("numba:compile", counter)
    return counter


_COMPILES = _install_compile_counter()
