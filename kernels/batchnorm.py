"""BatchNorm's CPU kernels, on (M, C) activations (NHWC with M = N*H*W rows).

The same functions and formulas as the CUDA kernels of kernels/gpu.py, so that
nets/batchnorm.py runs one code path on either device:

    batchnorm_sums(x)              (sum_m (x_mc - x_0c), sum_m (x_mc - x_0c)^2), about the
                                   shift x[0]: one pass gives an accurate variance
    batchnorm_sums(x, dy, mean)    (sum_m dy_mc, sum_m dy_mc (x_mc - mean_c))
    batchnorm_finalize(...)        mean, invstd, scale = gamma invstd; running averages
    batchnorm_affine(x, ...)       y = (x - mean) scale + beta [then max(y, 0)]
                                   [or max(y + r, 0): a residual block's output]
    batchnorm_backward_coefficients(...)   dgamma, dbeta, and (a, b, d) of dx
    batchnorm_dx(dy, x, ...)       dx = a dy' + b (x - mean) + d, dy' = dy [* (y > 0)]

`relu` fuses the ReLU that follows a BatchNorm into its passes: forward clamps y
at 0; backward takes the ReLU's gradient (dy where y > 0, else 0) as it reads dy,
recomputing y's sign from x, which it reads anyway, and the per-channel (mean,
scale, beta) of forward, rounded as forward stored y. That saves the ReLU
layer's two passes, its mask, and keeping y.

The element passes run on Numba's thread pool, each thread a block of rows
(block_rows: fewer rows a block where there are few, so that every thread has some);
the sums are taken per block in float64 and the blocks added in order, so the result
does not depend on the number of threads. Each pass asks for the rows it reaches a
few rows later (kernels/prefetch.py), without which the sums wait on memory.
float16 activations are read and written as their uint16 bits through
kernels.cast.load/store (Numba's CPU target has no float16), with the arithmetic in
the statistics dtype.
"""
import math

import numpy as np
from numba import njit, prange

from . import team
from .cast import ZERO, bits as _bits, load, rounded, store
from .prefetch import prefetch_ahead

ROWS = 256          # rows per block of the parallel passes at most (at C = 64: 64 KiB of fp32)
MIN_BLOCKS = 8      # blocks a pass is cut into at least, where that leaves MIN_ROWS a block
MIN_ROWS = 16       # rows a block holds at least


@njit(cache=True)
def block_rows(M):
    """Rows per block of a pass over M rows: ROWS, or fewer where M is small, so that
    the late stages' few rows (128 in ResNet-50's last stage at 64x64, batch 32) still
    give every thread blocks. It depends on M alone, so the sums' blocks, and their bits,
    do not depend on the thread count."""
    return min(ROWS, max(MIN_ROWS, -(-M // MIN_BLOCKS)))


def acc_dtype(dtype):
    """The statistics dtype of activations of `dtype`: float64 for float64, else float32."""
    return np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)


# ----- sums -----
# The row helpers take the whole (M, C) array and a row index: a view per row (x[m])
# would cost each row a view's set-up and its reference count, an atomic update of a
# word the threads share; at C = 64 that costs more than the row's arithmetic.
@team.by_size
@njit(parallel=True, cache=True)
def _sums_forward(x, rows, part):
    M, C = x.shape
    for p in prange(part.shape[0]):
        s0, s1 = part[p, 0], part[p, 1]
        s0[:] = 0.0
        s1[:] = 0.0
        start, stop = p * rows, min(M, (p + 1) * rows)
        fours = start + (stop - start) // 4 * 4
        for m in range(start, fours, 4):
            prefetch_ahead(x, m * C, (m + 4) * C)
            _shifted4(x, m, s0, s1)
        for m in range(fours, stop):
            _shifted(x, m, s0, s1)


@njit(cache=True)
def _shifted(x, m, s0, s1):
    for c in range(x.shape[1]):
        v = np.float64(load(x, (m, c))) - np.float64(load(x, (0, c)))
        s0[c] += v
        s1[c] += v * v


@njit(cache=True)
def _shifted4(x, m, s0, s1):
    """_shifted over rows m..m+3: the running sums are read and written once per four
    elements, not once per element."""
    for c in range(x.shape[1]):
        h = np.float64(load(x, (0, c)))
        v0 = np.float64(load(x, (m, c))) - h
        v1 = np.float64(load(x, (m + 1, c))) - h
        v2 = np.float64(load(x, (m + 2, c))) - h
        v3 = np.float64(load(x, (m + 3, c))) - h
        s0[c] += (v0 + v1) + (v2 + v3)
        s1[c] += (v0 * v0 + v1 * v1) + (v2 * v2 + v3 * v3)


@team.by_size
@njit(parallel=True, cache=True)
def _sums_backward(x, dy, mean64, relu, mean, scale, beta, rows, part):
    M, C = x.shape
    for p in prange(part.shape[0]):
        s0, s1 = part[p, 0], part[p, 1]
        s0[:] = 0.0
        s1[:] = 0.0
        start, stop = p * rows, min(M, (p + 1) * rows)
        pairs = start + (stop - start) // 2 * 2
        for m in range(start, pairs, 2):
            prefetch_ahead(x, m * C, (m + 2) * C)
            prefetch_ahead(dy, m * C, (m + 2) * C)
            _products2(x, dy, m, mean64, relu, mean, scale, beta, s0, s1)
        for m in range(pairs, stop):
            _products(x, dy, m, mean64, relu, mean, scale, beta, s0, s1)


@njit(cache=True)
def _products(x, dy, m, mean64, relu, mean, scale, beta, s0, s1):
    for c in range(x.shape[1]):
        d = np.float64(load(dy, (m, c)))
        if relu and _clamped(x, m, c, mean, scale, beta):
            d = 0.0
        s0[c] += d
        s1[c] += d * (np.float64(load(x, (m, c))) - mean64[c])


@njit(cache=True)
def _products2(x, dy, m, mean64, relu, mean, scale, beta, s0, s1):
    """_products over rows m and m+1: the running sums are read and written once per two
    elements."""
    for c in range(x.shape[1]):
        d0, d1 = np.float64(load(dy, (m, c))), np.float64(load(dy, (m + 1, c)))
        if relu:
            if _clamped(x, m, c, mean, scale, beta):
                d0 = 0.0
            if _clamped(x, m + 1, c, mean, scale, beta):
                d1 = 0.0
        s0[c] += d0 + d1
        s1[c] += (d0 * (np.float64(load(x, (m, c))) - mean64[c])
                  + d1 * (np.float64(load(x, (m + 1, c))) - mean64[c]))


@njit(cache=True)
def _clamped(x, m, c, mean, scale, beta):
    """Whether forward's fused ReLU output 0 for x[m, c]: y as _affine_row stored it."""
    return rounded(x, (load(x, (m, c)) - mean[c]) * scale[c] + beta[c]) <= 0


def batchnorm_sums(x, dy=None, mean=None, relu=None):
    """Per-channel sums of the (M, C) activations x, (2, C) float64: forward (dy None)
    the sums about the shift x[0]; backward the sums of dy and dy (x - mean), dy taken
    through the fused ReLU when relu = (scale, beta) of forward's affine map is given."""
    M, C = x.shape
    rows = block_rows(M)
    part = np.empty((-(-M // rows), 2, C))           # (blocks, 2, C) partial sums
    if dy is None:
        _sums_forward(_bits(x), rows, part)
    else:
        scale, beta = relu if relu is not None else (mean, mean)
        _sums_backward(_bits(x), _bits(dy), mean.astype(np.float64), relu is not None, mean,
                       scale, beta, rows, part)
    return part.sum(axis=0)


# ----- per-channel statistics and coefficients -----
FINALIZE_MODES = {"shifted": 0, "group": 1, "eval": 2}


def batchnorm_finalize(sums, x, count, mode, gamma, eps, momentum, running_mean, running_var):
    """(mean, invstd, scale), each (C,) in gamma's dtype:

        mode "shifted": sums from batchnorm_sums(x):  mean = x_0 + sums[0] / count,
                        var = sums[1] / count - (sums[0] / count)^2
        mode "group":   sums = (sum x, sum (x - mean)^2) over a group: mean = sums[0] / count,
                        var = sums[1] / count
        mode "eval":    mean, var = running_mean, running_var (sums unused)
        invstd = 1 / sqrt(var + eps),  scale = gamma * invstd

    and, in the train modes, running_mean += momentum (mean - running_mean), running_var
    += momentum (var count / (count - 1) - running_var), in place."""
    C = gamma.size
    out = np.empty((3, C), gamma.dtype)
    shift = np.asarray(x[0], np.float64) if mode == "shifted" else np.zeros(C)
    _finalize(sums if sums is not None else np.zeros((2, C)), shift, FINALIZE_MODES[mode],
              float(count), gamma, float(eps), float(momentum), running_mean, running_var, out)
    return out[0], out[1], out[2]


@njit(cache=True)
def _finalize(sums, shift, mode, count, gamma, eps, momentum, running_mean, running_var, out):
    for c in range(gamma.size):
        if mode == 2:
            mean, var = np.float64(running_mean[c]), np.float64(running_var[c])
        else:
            mean = sums[0, c] / count + (shift[c] if mode == 0 else 0.0)
            var = sums[1, c] / count
            if mode == 0:
                var -= (sums[0, c] / count) ** 2
            var = max(var, 0.0)
            running_mean[c] += momentum * (mean - running_mean[c])
            running_var[c] += momentum * (var * count / (count - 1) - running_var[c])
        invstd = 1.0 / math.sqrt(var + eps)
        out[0, c] = mean
        out[1, c] = invstd
        out[2, c] = gamma[c] * invstd


def batchnorm_backward_coefficients(local, group, gamma, invstd, count, train, grad_gamma,
                                    grad_beta):
    """coef (3, C) = (a, b, d) of dx = a dy + b (x - mean) + d, with a = gamma invstd and,
    in train mode, b = -a invstd (group[1] invstd) / count, d = -a group[0] / count (eval:
    0, 0); also grad_beta = local[0], grad_gamma = local[1] invstd, written in place.
    local, group: (2, C) sums (sum dy, sum dy (x - mean)): this rank's, and those for dx
    (the group's, or local again). The coefficients are computed in float64 and rounded
    once to the statistics' dtype (invstd's), as on the GPU: dx's pass then runs in it."""
    coef = np.empty((3, local.shape[1]), invstd.dtype)
    _coefficients(local, group, gamma, invstd, float(count), train, grad_gamma, grad_beta, coef)
    return coef


@njit(cache=True)
def _coefficients(local, group, gamma, invstd, count, train, grad_gamma, grad_beta, coef):
    for c in range(coef.shape[1]):
        grad_beta[c] = local[0, c]
        grad_gamma[c] = local[1, c] * invstd[c]
        inv = np.float64(invstd[c])
        a = gamma[c] * inv
        coef[0, c] = a
        coef[1, c] = -a * inv * (group[1, c] * inv) / count if train else 0.0
        coef[2, c] = -a * group[0, c] / count if train else 0.0


# ----- the element passes -----
@team.by_size
@njit(parallel=True, cache=True)
def _affine(x, mean, scale, beta, relu, with_r, r, y):
    M, C = x.shape
    rows = block_rows(M)
    for p in prange((M + rows - 1) // rows):
        for m in range(p * rows, min(M, (p + 1) * rows)):
            prefetch_ahead(x, m * C, (m + 1) * C)
            if with_r:
                prefetch_ahead(r, m * C, (m + 1) * C)
            _affine_row(x, m, mean, scale, beta, relu, with_r, r, y)


@njit(cache=True)
def _affine_row(x, m, mean, scale, beta, relu, with_r, r, y):
    for c in range(x.shape[1]):
        v = (load(x, (m, c)) - mean[c]) * scale[c] + beta[c]
        if with_r:      # from y as x's dtype stores it: a separate add's bits
            v = max(rounded(x, v) + load(r, (m, c)), ZERO)
        elif relu:
            v = max(v, ZERO)
        store(y, (m, c), v)


def batchnorm_affine(x, mean, scale, beta, relu=False, residual=None):
    """y (M, C) = (x - mean) * scale + beta per channel (then max(y, 0) with relu),
    computed in the statistics' dtype and rounded to x's dtype once. With `residual`
    (M, C), of x's dtype, and no relu: max(y + residual, 0), a residual block's output,
    in the same pass, with the bits of that add applied to y as stored in x's dtype."""
    out = np.empty_like(x)
    r = x if residual is None else np.ascontiguousarray(residual)
    _affine(_bits(x), mean, scale, beta.astype(scale.dtype), relu, residual is not None,
            _bits(r), _bits(out))
    return out


@team.by_size
@njit(parallel=True, cache=True)
def _dx(dy, x, mean, coef, relu, scale, beta, dx):
    M, C = x.shape
    a, b, d = coef[0], coef[1], coef[2]    # (C,) each, taken once: cheaper than coef[k, c]
    rows = block_rows(M)
    for p in prange((M + rows - 1) // rows):
        for m in range(p * rows, min(M, (p + 1) * rows)):
            prefetch_ahead(dy, m * C, (m + 1) * C)
            prefetch_ahead(x, m * C, (m + 1) * C)
            _dx_row(dy, x, m, mean, a, b, d, relu, scale, beta, dx)


@njit(cache=True)
def _dx_row(dy, x, m, mean, a, b, d, relu, scale, beta, dx):
    for c in range(x.shape[1]):
        g = load(dy, (m, c))
        if relu and _clamped(x, m, c, mean, scale, beta):
            g = ZERO
        store(dx, (m, c), a[c] * g + b[c] * (load(x, (m, c)) - mean[c]) + d[c])


def batchnorm_dx(dy, x, mean, coef, relu=None):
    """dx (M, C) = a dy + b (x - mean) + d per channel, (a, b, d) = coef, with dy taken
    through the fused ReLU (0 where forward's output was) when relu = (scale, beta)."""
    dx = np.empty_like(dy)
    scale, beta = relu if relu is not None else (mean, mean)
    _dx(_bits(dy), _bits(x), mean, coef, relu is not None, scale, beta, _bits(dx))
    return dx
