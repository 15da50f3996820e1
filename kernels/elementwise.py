"""The networks' elementwise passes: ReLU and the residual block's add, on any float dtype.

    relu(x)            y = max(x, 0)
    relu_grad(dy, y)   dy where y > 0, else 0     (the ReLU's gradient, from its output)
    add_into(a, b)     a += b                     (in place: a residual block's dx, where its
                                                   first convolution cannot add its own
                                                   into the shortcut's: nets/conv.py)
    column_sums(a, out)  out_c = sum_m a_mc        (a bias's gradient from dy, (M, C))
    zero_padded(a, c)  a (..., C) with c - C zero channels after its own (a first
                       convolution's images and filter: nets/conv.py)

Each returns a new array (add_into: a itself). On NumPy arrays one pass of a Numba
kernel on the thread pool, each thread a block of elements: NumPy's own
elementwise operations run on one core. float16 is read and written as its uint16
bits (kernels.cast.load/store) and computed in float32. On CuPy arrays relu_grad is
one CUDA kernel each (kernels/gpu.py), reading and writing 16-byte packs;
column_sums is NumPy's pairwise sum on the CPU and gpu.column_sums on a GPU.
A residual block's output, max(a + b, 0), is its last BatchNorm's pass
(kernels/batchnorm.py, batchnorm_affine's residual).
"""
import numpy as np
from numba import njit, prange

from mpitrain.backend import array_module

from . import gpu, team
from .cast import ZERO, bits as _bits, load, store

BLOCK = 1 << 15         # elements per block of a parallel pass


def _flat(a):
    return _bits(np.ascontiguousarray(a)).reshape(-1)


@team.by_size
@njit(parallel=True, cache=True)
def _relu(x, y):
    for p in prange((x.size + BLOCK - 1) // BLOCK):
        lo, hi = p * BLOCK, min(x.size, (p + 1) * BLOCK)
        _relu_block(x[lo:hi], y[lo:hi])


@njit(cache=True)
def _relu_block(x, y):
    for i in range(x.size):
        store(y, i, max(load(x, i), ZERO))


def relu(x):
    """max(x, 0), a new array."""
    if gpu.handles(x):
        return gpu.relu(array_module(x).ascontiguousarray(x))
    if array_module(x) is not np:
        return array_module(x).maximum(x, 0)
    y = np.empty_like(x)
    _relu(_flat(x), _flat(y))
    return y


@team.by_size
@njit(parallel=True, cache=True)
def _relu_grad(dy, y, dx):
    for p in prange((dy.size + BLOCK - 1) // BLOCK):
        lo, hi = p * BLOCK, min(dy.size, (p + 1) * BLOCK)
        _relu_grad_block(dy[lo:hi], y[lo:hi], dx[lo:hi])


@njit(cache=True)
def _relu_grad_block(dy, y, dx):
    for i in range(dy.size):
        store(dx, i, load(dy, i) if load(y, i) > 0 else ZERO)


def relu_grad(dy, y):
    """dy where y (a ReLU's output) > 0, else 0: the gradient through the ReLU."""
    if gpu.handles(dy):
        xp = array_module(dy)
        return gpu.relu_grad(xp.ascontiguousarray(dy), xp.ascontiguousarray(y))
    dx = np.empty_like(dy)
    _relu_grad(_flat(dy), _flat(y), _flat(dx))
    return dx


@team.by_size
@njit(parallel=True, cache=True)
def _add_into(a, b):
    for p in prange((a.size + BLOCK - 1) // BLOCK):
        lo, hi = p * BLOCK, min(a.size, (p + 1) * BLOCK)
        _add_block(a[lo:hi], b[lo:hi])


@njit(cache=True)
def _add_block(a, b):
    for i in range(a.size):
        store(a, i, load(a, i) + load(b, i))


def add_into(a, b):
    """a += b, in place (a contiguous); returns a."""
    if gpu.handles(a) and b.dtype == a.dtype and b.shape == a.shape:
        return gpu.add_into(a, array_module(b).ascontiguousarray(b))
    if array_module(a) is not np:
        a += b
        return a
    _add_into(_bits(a).reshape(-1), _flat(b))
    return a


def column_sums(a, out):
    """out (C,) = the sums over the rows of a (M, C), in out's dtype; returns out."""
    if gpu.handles(a):
        out[...] = gpu.column_sums(array_module(a).ascontiguousarray(a))
        return out
    return a.sum(axis=0, dtype=out.dtype, out=out)


def zero_padded(a, channels):
    """a (..., C) widened to (..., channels), the new channels 0; a itself where C == channels."""
    if a.shape[-1] == channels:
        return a
    out = array_module(a).zeros(a.shape[:-1] + (channels,), a.dtype)
    out[..., :a.shape[-1]] = a
    return out
