"""Software prefetch for the CPU kernels' passes over memory.

A pass over arrays larger than the caches that reads a few rows at once and does some
arithmetic on each element (BatchNorm's float64 sums, for one) waits on memory: the
out-of-order core keeps too few loads in flight, and the hardware prefetcher does not run
far enough ahead of them. Asking for the lines AHEAD bytes beyond the ones being read keeps
more of them on their way. Passes that only stream their arrays (elementwise.py) keep the
hardware prefetcher ahead on their own and gain nothing from it; nor do Winograd's
transforms (docs/benchmarks-record.md).

    prefetch(a, i)                   the cache line holding a's element i (a flat index)
    prefetch_ahead(a, lo, hi)        the lines AHEAD bytes beyond elements lo..hi of a

`a` is C-contiguous, as the kernels' arrays are. A prefetch is a hint: it never faults,
also past the end of an array, and changes no value, so the kernels keep their bits.
"""
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

AHEAD = 16 << 10    # bytes: 256 lines, two rows of BatchNorm's widest activations
LINE = 64           # bytes per cache line


@intrinsic
def prefetch(typingctx, a, i):
    """llvm.prefetch of &a.flat[i], for reading (rw 0), into every cache level (locality 3)."""
    if not isinstance(a, types.Array) or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        index = context.cast(builder, args[1], signature.args[1], types.intp)
        byte = ir.IntType(8).as_pointer()
        address = builder.bitcast(builder.gep(data, [index]), byte)
        word = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte, word, word, word]),
            "llvm.prefetch.p0")
        builder.call(fn, [address, word(0), word(3), word(1)])
        return context.get_dummy_value()
    return types.none(a, i), codegen


@njit(inline="always", cache=True)
def prefetch_ahead(a, lo, hi):
    """Prefetch a's elements lo + AHEAD / itemsize up to hi + AHEAD / itemsize (flat indices),
    one line at a time: called before a pass over elements lo..hi, it asks for the
    elements the pass reaches a few thousand later."""
    step, shift = LINE // a.itemsize, AHEAD // a.itemsize
    for i in range(lo + shift, min(hi + shift, a.size), step):
        prefetch(a, i)
