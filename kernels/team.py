"""Which threads run a parallel Numba kernel: the whole team, or the calling thread alone.

Starting the team's threads on a kernel costs about what one core takes to pass over
PARALLEL_MIN_BYTES while they spin between kernels (GOMP_SPINCOUNT, mpitrain/__init__.py),
and far more once they have gone to sleep (docs/design-notes.md). So a layer's kernel
whose first array holds fewer than PARALLEL_MIN_BYTES runs on the calling thread alone,
where starting the team would cost more than it saves. The Cython kernels follow the
same rule with their own limit (kernels/_common.pxi). Either way a kernel gives the
same bits: each element, and each block's partial sum, is computed by one thread in a
fixed order.

    @team.by_size
    @njit(parallel=True, cache=True)
    def _kernel(x, ...):        # x: the array whose size decides
"""
import functools
import types

import numba

PARALLEL_MIN_BYTES = 1 << 16


def by_size(kernel):
    """`kernel`, a Numba dispatcher compiled with parallel=True, wrapped to run on the
    calling thread alone when its first argument holds fewer than PARALLEL_MIN_BYTES,
    and on the caller's Numba thread count otherwise."""
    def run(first, *rest):
        threads = numba.get_num_threads()
        if threads == 1 or first.nbytes >= PARALLEL_MIN_BYTES:
            return kernel(first, *rest)
        numba.set_num_threads(1)
        try:
            return kernel(first, *rest)
        finally:
            numba.set_num_threads(threads)
    return functools.update_wrapper(run, kernel, updated=())


def serial(loop):
    """`loop` compiled for the calling thread alone (prange runs as range), and cached.

    Numba's cache keys a kernel by its function's name, bytecode and argument types, not
    by its compile options: compiled from `loop` itself, this kernel and the parallel
    one would take each other's place in the cache. So it compiles a copy of `loop`
    named NAME_serial, which has cache files of its own."""
    copy = types.FunctionType(loop.__code__, loop.__globals__, f"{loop.__name__}_serial",
                              loop.__defaults__, loop.__closure__)
    copy.__qualname__ = f"{loop.__qualname__}_serial"
    return numba.njit(nogil=True, cache=True)(copy)
