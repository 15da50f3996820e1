"""The overflow check of loss scaling: does the gradient arena hold an inf or a NaN?

    overflow = any_i( not isfinite(grad_i) )

One pass over the array. On the CPU every chunk is reduced to one flag in
parallel; on the GPU any thread that meets a non-finite value writes 1 to a
one-element flag (all writers write the same value, so the race is harmless).

With LARS the norm pass already tells the same thing for free: a segment's
g_norm is non-finite exactly when it holds a non-finite value (squares of fp32
values cannot overflow a float64 sum of fewer than 10^200 terms).
"""
import math

import numpy as np
from numba import cuda, njit, prange

from mpitrain.backend import array_module

from . import segments
from .segments import LANES, cuda_shape, pick


def has_overflow(grad, impl=None):
    """True when the flat float array grad holds an inf or a NaN."""
    return _IMPLS[pick(impl, grad)](grad)


def has_overflow_numpy(grad):
    """Reference: not all(isfinite(grad))."""
    return not bool(array_module(grad).isfinite(grad).all())


@njit(cache=True)
def _nonfinite(x):
    """x * 0 is 0 for every finite x and NaN for inf and NaN, so a sum of x * 0 is NaN
    exactly when x holds a non-finite value. LANES partial sums keep it vectorised."""
    zero = x.dtype.type(0)
    lanes = np.zeros(LANES, x.dtype)
    blocks = x.size // LANES
    for b in range(blocks):
        xs = x[b * LANES:(b + 1) * LANES]
        for k in range(LANES):
            lanes[k] += xs[k] * zero
    total = lanes.sum()
    for i in range(blocks * LANES, x.size):
        total += x[i] * zero
    return not np.isfinite(total)


@njit(parallel=True, cache=True)
def _overflow_cpu(grad, chunk):
    chunks = (grad.size + chunk - 1) // chunk
    flags = np.zeros(chunks, np.bool_)
    for c in prange(chunks):
        flags[c] = _nonfinite(grad[c * chunk:(c + 1) * chunk])
    return flags.any()


def has_overflow_numba(grad):
    """Numba CPU version of has_overflow_numpy: one flag per chunk, in parallel."""
    return bool(_overflow_cpu(grad, segments.CPU_CHUNK))


@cuda.jit
def _overflow_cuda(grad, flag):
    for i in range(cuda.grid(1), grad.size, cuda.gridsize(1)):
        if not math.isfinite(grad[i]):
            flag[0] = 1


def has_overflow_cuda(grad):
    """Numba CUDA version of has_overflow_numpy: a grid-stride loop writing one flag."""
    threads, _ = cuda_shape()
    flag = array_module(grad).zeros(1, np.int32)
    if grad.size:
        _overflow_cuda[min((grad.size + threads - 1) // threads, 4096), threads](grad, flag)
    return bool(flag[0])


_IMPLS = {"numpy": has_overflow_numpy, "numba": has_overflow_numba, "cuda": has_overflow_cuda}
