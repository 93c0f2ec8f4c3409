"""Numba kernels, one module per model, over flat parameter vectors.

`JIT` is the one place the Numba flags live. fastmath stays off: it lets LLVM reorder float sums, and a
trajectory must not depend on which machine or compiler version produced it.
"""

JIT = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
