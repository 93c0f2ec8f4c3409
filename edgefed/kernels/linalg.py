"""The dense products every model kernel is made of, through the fused multiply-add micro-kernels of fma.py.

Summation order, the same on every CPU and for every tile shape: an output starts from the value already
in it (a bias, or zero) and adds the reduction's terms in index order, each by one fma. A NumPy loop
`z = fma(a[k], b[k], z) for k in range(n)` gives the same bits; tests/test_kernels.py checks it.
Operands are 2-D views whose last dimension is unit-stride (rows may be strided, e.g. a column block).
"""

from numba import njit, types
from numba.core import cgutils
from numba.core.imputils import impl_ret_untracked
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array

from edgefed.kernels import JIT
from edgefed.kernels.fma import TILE_BYTES, TILE_ROWS, tile

_TILE = tile(TILE_ROWS, TILE_BYTES, False)
_EDGE = tile(TILE_ROWS, TILE_BYTES, True)  # the right-hand columns that do not fill a tile
_PANEL_BYTES = 16384  # of B per panel piece: half a 32 KB L1 data cache (Cortex-A72/A76, most x86 cores)


@njit(inline="always", **JIT)  # inlined into its two callers: one compilation fewer each (cold start)
def _gemm(A, sai, sak, B, C, m, n, kc, fresh):
    """C[:m, :n] += A~ B[:kc, :n], where A~[i, k] = A.data[i sai + k sak] (so A or its transpose);
    fresh: C[:m, :n] = A~ B, C's old values never read (a weight gradient's first term: no zeroing pass).

    Column panels of B outermost, cut into pieces of `depth` rows that fit the L1 cache: every row tile then
    reads a panel piece from L1, and B streams from memory once (a small batch times a large weight matrix
    is bound by that stream: 18 -> 36 GFLOP/s on 10 x 3136 x 512). Cutting the reduction keeps its order: a tile
    stores its outputs and the next piece goes on from them.
    """
    nr = TILE_BYTES // C.itemsize
    depth = _PANEL_BYTES // TILE_BYTES
    ldb = B.strides[0] // B.itemsize
    ldc = C.strides[0] // C.itemsize
    for j0 in range(0, n, nr):
        cols = min(nr, n - j0)
        for k0 in range(0, max(kc, 1), depth):  # kc = 0 still visits each tile: fresh then writes zeros
            kn = min(depth, kc - k0)
            for i0 in range(0, m, TILE_ROWS):
                rows = min(TILE_ROWS, m - i0)
                a0, b0, c0 = i0 * sai + k0 * sak, k0 * ldb + j0, i0 * ldc + j0
                first = fresh and k0 == 0
                if cols == nr:
                    _TILE(A, a0, sai, sak, rows, B, b0, ldb, C, c0, ldc, kn, cols, first)
                else:
                    _EDGE(A, a0, sai, sak, rows, B, b0, ldb, C, c0, ldc, kn, cols, first)


@njit(**JIT)
def _product(A, W, Z, b, din, dout, fresh):
    _gemm(A, A.strides[0] // A.itemsize, 1, W, Z, b, dout, din, fresh)


@njit(**JIT)
def _outer(A, D, G, b, din, dout, fresh):
    _gemm(A, 1, A.strides[0] // A.itemsize, D, G, din, dout, b, fresh)


def packed_values(rows: int, cols: int, itemsize: int) -> int:
    """Values pack_columns writes for a (rows, cols) operand: its columns rounded up to whole tiles."""
    nr = TILE_BYTES // itemsize
    return rows * -(-cols // nr) * nr


@njit(inline="always", **JIT)
def pack_columns(B, kc, n, P):
    """P <- B[:kc, :n] as column panels one tile wide, each (kc, tile) contiguous (packed_values of room): the
    operand packed_product reads."""
    nr = TILE_BYTES // P.itemsize
    for j0 in range(0, n, nr):
        cols = min(nr, n - j0)
        for k in range(kc):
            src, dst = B[k], vector(P, (j0 * kc + k * nr), cols)
            for j in range(cols):
                dst[j] = src[j0 + j]


@njit(**JIT)
def _packed(A, sai, sak, P, C, m, n, kc, fresh):
    """_gemm with B packed (pack_columns): the same tiles, the same fmas in the same order, the same bits. A
    packed panel streams from L1 whatever B's row length; rows of B 4 KB apart (1,024 floats, an LSTM's 4H)
    fall into a few cache sets and do not stay there (recurrent products: 4.6 -> 2.4 ms a pass, measured)."""
    nr = TILE_BYTES // C.itemsize
    depth = _PANEL_BYTES // TILE_BYTES
    ldc = C.strides[0] // C.itemsize
    for j0 in range(0, n, nr):
        cols = min(nr, n - j0)
        for k0 in range(0, max(kc, 1), depth):
            kn = min(depth, kc - k0)
            for i0 in range(0, m, TILE_ROWS):
                rows = min(TILE_ROWS, m - i0)
                a0, b0, c0 = i0 * sai + k0 * sak, j0 * kc + k0 * nr, i0 * ldc + j0
                first = fresh and k0 == 0
                if cols == nr:
                    _TILE(A, a0, sai, sak, rows, P, b0, nr, C, c0, ldc, kn, cols, first)
                else:
                    _EDGE(A, a0, sai, sak, rows, P, b0, nr, C, c0, ldc, kn, cols, first)


@njit(inline="always", **JIT)
def packed_product(A, P, Z, b, din, dout, fresh):
    """accumulate_product with W packed: Z[:b, :dout] += A[:b, :din] W (fresh: =)."""
    _packed(A, A.strides[0] // A.itemsize, 1, P, Z, b, dout, din, fresh != (b < 0))


@njit(inline="always", **JIT)
def packed_outer(A, P, G, b, din, dout, fresh):
    """accumulate_outer with D packed: G[:din, :dout] += A[:b, :din]^T D[:b, :dout] (fresh: =)."""
    _packed(A, 1, A.strides[0] // A.itemsize, P, G, din, dout, b, fresh != (b < 0))


# The two entries below are inlined into their callers and pass the compiled products a run-time flag: a
# literal True or an omitted False would each compile the product once more (so would another layout: each
# entry passes its operands in one).
@njit(inline="always", **JIT)
def accumulate_product(A, W, Z, b, din, dout, fresh=False):
    """Z[:b, :dout] += A[:b, :din] W[:din, :dout] (fresh: Z[:b, :dout] = A W)."""
    _product(A, W, Z, b, din, dout, fresh != (b < 0))


@njit(inline="always", **JIT)
def accumulate_outer(A, D, G, b, din, dout, fresh=False):
    """G[:din, :dout] += A[:b, :din]^T D[:b, :dout] (a weight gradient: terms in sample order; fresh: =).
    A is passed as a strided view whatever it is (a column block where a large layer is stepped fused): one
    compiled product for both, which reads A by its strides anyway."""
    _outer(A[:, :din], D, G, b, din, dout, fresh != (b < 0))


@njit(inline="always", **JIT)
def transpose_into(W, WT, rows, cols):
    """WT[:cols, :rows] <- W[:rows, :cols]^T, four rows of W at a time (each read contiguously, each row of WT
    written four values at a time): measured 2-3x a 16 x 16 blocked loop on the models' shapes.

    A product with W^T then streams contiguous rows like any other; packing W^T once per step costs a
    fraction of the product it feeds (the operand is read once, the product reads it b times).
    """
    k = 0
    while k + 4 <= rows:
        w0, w1, w2, w3 = W[k], W[k + 1], W[k + 2], W[k + 3]
        for j in range(cols):
            o = WT[j]
            o[k], o[k + 1], o[k + 2], o[k + 3] = w0[j], w1[j], w2[j], w3[j]
        k += 4
    for kk in range(k, rows):
        w = W[kk]
        for j in range(cols):
            WT[j, kk] = w[j]


@njit(inline="always", **JIT)
def copy_into(dst, src):
    """dst[:] <- src[:] for 1-D arrays of one length; a loop, not dst[:] = src, whose shape check alone
    costs Numba seconds of compilation (an error message built from the shapes)."""
    for k in range(src.shape[0]):
        dst[k] = src[k]


def _view_codegen(ndim: int):
    """Codegen of a C-contiguous view of ndim dimensions into a C-contiguous array's data, from an element
    offset on, that holds no reference (see matrix): args (buf, start, *sizes)."""

    def codegen(context, builder, sig, args):
        retty = sig.return_type
        src = context.make_array(sig.args[0])(context, builder, args[0])
        out = context.make_array(retty)(context, builder)
        intp = context.get_value_type(types.intp)
        start, *dims = (context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:]))
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(retty.dtype)))
        strides = [itemsize]
        for d in reversed(dims[1:]):
            strides.insert(0, builder.mul(d, strides[0]))
        populate_array(out, data=builder.gep(src.data, [start]), shape=cgutils.pack_array(builder, dims, ty=intp),
                       strides=cgutils.pack_array(builder, strides, ty=intp), itemsize=itemsize,
                       meminfo=cgutils.get_null_value(src.meminfo.type), parent=cgutils.get_null_value(src.parent.type))
        return impl_ret_untracked(context, builder, retty, out._getvalue())

    return codegen


def _contiguous(buf) -> bool:
    return isinstance(buf, types.Array) and buf.layout == "C"


@intrinsic
def matrix(typingctx, buf, start, rows, cols):
    """The C-contiguous (rows, cols) view of buf's data (any C-contiguous array) from element start on.

    What buf.reshape(-1)[start:start + rows * cols].reshape((rows, cols)) gives, without Numba's reshape
    (a call into a C helper, 20-25 ns a view, measured) and without a reference count: the view holds no
    reference to buf's memory, so it is never counted up and down (an atomic operation each way). A layer
    list's step makes dozens of views; buf outlives them all, since a kernel's caller holds it and a view
    never leaves the kernel. The caller keeps the view inside buf (nothing is checked, as with the kernels'
    other indexing).
    """
    if _contiguous(buf):
        return types.Array(buf.dtype, 2, "C")(buf, start, rows, cols), _view_codegen(2)


@intrinsic
def vector(typingctx, buf, start, n):
    """buf's data[start:start + n] as a 1-D view that holds no reference (as matrix)."""
    if _contiguous(buf):
        return types.Array(buf.dtype, 1, "C")(buf, start, n), _view_codegen(1)


@njit(inline="always", **JIT)
def block(buf, offset, n):
    """The rows (buf.shape[0], n) of one region of a batch buffer. Regions are stored layer-major: all of a
    region's rows together, from buf.shape[0] * offset on, so a layer's batch is one C-contiguous matrix
    (its products stream it, its row loops vectorize) and one sample's row of it is contiguous too."""
    rows = buf.shape[0]
    return matrix(buf, rows * offset, rows, n)
