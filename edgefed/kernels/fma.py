"""Fused multiply-add, the one arithmetic primitive of every product and update, emitted as LLVM's `llvm.fma`.

IEEE 754 fma(a, b, c) is a * b + c rounded once, so the same fmas in the same order give the same bits on
every CPU: in hardware on x86-64 with FMA3 and on every ARMv8 core (every 64-bit Pi), through the C
library's correctly rounded `fma` elsewhere. (`fastmath={"contract"}` would let the compiler choose where to
fuse, so bits would depend on the CPU; `llvm.fma` is never split and never reassociated.)

`tile(mr, nr_bytes, masked)` builds a register-blocked micro-kernel (BLIS-style): an mr x nr block of outputs held
in vector registers across the whole reduction, one vector load of B and mr broadcasts of A per step, mr
vector fmas. Each output is its initial value followed by the reduction's terms in index order, one fma
each: the tile shape changes the speed, never the bits, so it is chosen per CPU (`TILE_ROWS`, `TILE_BYTES`).
"""

from llvmlite import ir
from llvmlite import binding as llvm
from numba.core import cgutils, config, types
from numba.extending import intrinsic

_I32, _I64 = ir.IntType(32), ir.IntType(64)


def _vector_bytes() -> int:
    """Bytes of one tile row (two or four vector registers): wide enough to hide the fma latency, narrow
    enough that the mr rows of accumulators stay in registers (16 vector registers on AVX2, 32 elsewhere)."""
    try:
        features = config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()
    except RuntimeError:  # LLVM cannot read this host's features (some ARM hosts): the portable choice below
        features = ""
    name = config.CPU_NAME or llvm.get_host_cpu_name()
    if "+avx512f" in features and name != "generic":
        return 128  # two zmm
    if "+avx" in features and name != "generic":
        return 64  # two ymm
    if llvm.get_process_triple().startswith(("aarch64", "arm64")):
        return 64  # four of NEON's 32 q registers
    return 32  # two xmm


TILE_ROWS = 6
TILE_BYTES = _vector_bytes()


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c with one rounding, in the widest of the three float types (float32 or float64)."""
    if not all(isinstance(t, types.Float) for t in (a, b, c)):
        return None
    wide = max((a, b, c), key=lambda t: t.bitwidth)

    def codegen(context, builder, sig, args):
        ty = context.get_value_type(wide)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty, ty]),
                                            f"llvm.fma.f{wide.bitwidth}")
        return builder.call(fn, [context.cast(builder, v, t, wide) for v, t in zip(args, sig.args)])

    return wide(a, b, c), codegen


def _masked(builder, vty, bits, name, fnty):
    return cgutils.get_or_insert_function(builder.module, fnty, f"llvm.masked.{name}.v{vty.count}f{bits}.p0")


def tile(mr: int, nr_bytes: int, masked: bool):
    """The intrinsic C[i, j] = fold_k fma(A[i, k], B[k, j], C[i, j]) over an mr x nr block, k = 0 .. kc-1.

    Arguments, element offsets and strides into the arrays' data (the last dimension of B and C unit-stride):
    tile(A, a0, sai, sak, rows, B, b0, sbk, C, c0, sci, kc, cols, fresh). A[i, k] is A.data[a0 + i sai + k sak],
    B[k, j] is B.data[b0 + k sbk + j], C[i, j] is C.data[c0 + i sci + j]. Only the first `rows` (>= 1) rows are
    real: the others repeat the last real row, compute its very values and store them onto it, which costs
    their fmas but no branch. masked: only the first `cols` columns are read and written (the right edge).
    fresh (a run-time flag): C's old values are not read, the sums start from +0 (C = A B, the same bits as
    zeroing C first).
    """

    @intrinsic
    def _tile(typingctx, A, a0, sai, sak, rows, B, b0, sbk, C, c0, sci, kc, cols, fresh):
        if not (isinstance(A, types.Array) and A.dtype == B.dtype == C.dtype and isinstance(A.dtype, types.Float)):
            return None

        def codegen(context, builder, sig, args):
            A_, a0_, sai_, sak_, rows_, B_, b0_, sbk_, C_, c0_, sci_, kc_, cols_, fresh_ = args
            dtype = sig.args[0].dtype
            bits, size = dtype.bitwidth, dtype.bitwidth // 8
            nr = nr_bytes // size
            fty = context.get_value_type(dtype)
            vty = ir.VectorType(fty, nr)
            pa, pb, pc = (context.make_array(sig.args[i])(context, builder, v).data
                          for i, v in ((0, A_), (5, B_), (8, C_)))
            fmav = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vty, [vty, vty, vty]),
                                                  f"llvm.fma.v{nr}f{bits}")
            zero = ir.Constant(vty, [ir.Constant(fty, 0.0)] * nr)
            if masked:
                mty = ir.VectorType(ir.IntType(1), nr)
                lanes = ir.Constant(ir.VectorType(_I64, nr), list(range(nr)))
                cv = builder.insert_element(ir.Constant(ir.VectorType(_I64, nr), ir.Undefined), cols_,
                                            ir.Constant(_I32, 0))
                cv = builder.shuffle_vector(cv, ir.Constant(ir.VectorType(_I64, nr), ir.Undefined),
                                            ir.Constant(ir.VectorType(_I32, nr), [0] * nr))
                mask = builder.icmp_signed("<", lanes, cv)
                mload = _masked(builder, vty, bits, "load",
                                ir.FunctionType(vty, [pb.type, _I32, mty, vty]))
                mstore = _masked(builder, vty, bits, "store",
                                 ir.FunctionType(ir.VoidType(), [vty, pc.type, _I32, mty]))

                def load(ptr):
                    return builder.call(mload, [ptr, ir.Constant(_I32, size), mask, zero])

                def store(value, ptr):
                    builder.call(mstore, [value, ptr, ir.Constant(_I32, size), mask])
            else:
                def load(ptr):
                    return builder.load(builder.bitcast(ptr, vty.as_pointer()), align=size)

                def store(value, ptr):
                    builder.store(value, builder.bitcast(ptr, vty.as_pointer()), align=size)

            last = builder.sub(rows_, ir.Constant(_I64, 1))
            row_of = []  # row i, or the last real row for the padding rows
            for i in range(mr):
                ci = ir.Constant(_I64, i)
                row_of.append(builder.select(builder.icmp_signed("<", ci, rows_), ci, last))
            slots, c_ptrs = [], []
            for i in range(mr):
                c_ptrs.append(builder.gep(pc, [builder.add(c0_, builder.mul(row_of[i], sci_))]))
                slots.append(cgutils.alloca_once(builder, vty))  # promoted to registers by LLVM
            with builder.if_else(context.cast(builder, fresh_, sig.args[13], types.boolean)) as (start_zero, start_c):
                with start_zero:
                    for slot in slots:
                        builder.store(zero, slot)
                with start_c:
                    for slot, p in zip(slots, c_ptrs):
                        builder.store(load(p), slot)
            a_rows = [builder.add(a0_, builder.mul(r, sai_)) for r in row_of]
            undef = ir.Constant(vty, ir.Undefined)
            broadcast = ir.Constant(ir.VectorType(_I32, nr), [0] * nr)
            with cgutils.for_range(builder, kc_) as loop:
                k = loop.index
                w = load(builder.gep(pb, [builder.add(b0_, builder.mul(k, sbk_))]))
                ak = builder.mul(k, sak_)
                for i in range(mr):
                    a = builder.load(builder.gep(pa, [builder.add(a_rows[i], ak)]))
                    av = builder.shuffle_vector(builder.insert_element(undef, a, ir.Constant(_I32, 0)), undef,
                                                broadcast)
                    builder.store(builder.call(fmav, [av, w, builder.load(slots[i])]), slots[i])
            for slot, p in zip(slots, c_ptrs):
                store(builder.load(slot), p)
            return context.get_dummy_value()

        return types.none(A, a0, sai, sak, rows, B, b0, sbk, C, c0, sci, kc, cols, fresh), codegen

    return _tile
