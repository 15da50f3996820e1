# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""im2col / col2im for NHWC tensors, parallel over output (input) rows with OpenMP.

Geometry (kernel kh x kw, stride s, zero padding p):
    Ho = (H + 2p - kh) // s + 1,   Wo = (W + 2p - kw) // s + 1
    row r = (n*Ho + oh)*Wo + ow,   column q = (i*kw + j)*C + c
    im2col:  col[r, q] = x[n, oh*s - p + i, ow*s - p + j, c]   (0 outside the image)
    col2im:  dx[n, h, w, c] (+)= sum of col[r, q] over every (r, q) that im2col read from (n, h, w, c)

Columns are ordered (i, j, c), so `col @ W.reshape(O, kh*kw*C).T` is the
convolution with OHWI weights W. For a fixed output pixel and kernel row i, the
kernel columns j read consecutive input pixels, so one kernel row is a single
contiguous copy of (valid j) * C elements; that is what both kernels exploit.
The Python wrappers (kernels/im2col.py) check shapes and allocate outputs.
"""
from cython.parallel import prange
from libc.string cimport memcpy, memset

import numpy as np

include "_common.pxi"   # PARALLEL_MIN_BYTES, floating, _max, _min


cdef void _im2col_row(const unsigned char* x, unsigned char* col, Py_ssize_t r,
                      Py_ssize_t H, Py_ssize_t W, Py_ssize_t Ho, Py_ssize_t Wo,
                      Py_ssize_t kh, Py_ssize_t kw, Py_ssize_t s, Py_ssize_t p,
                      Py_ssize_t pix) noexcept nogil:
    """Fill the Wo rows of col that belong to output row r = n*Ho + oh; pix = bytes per pixel."""
    cdef Py_ssize_t n = r // Ho, oh = r % Ho
    cdef Py_ssize_t ih, iw0, j0, j1, ow, i
    cdef unsigned char* dst
    for ow in range(Wo):
        iw0 = ow * s - p
        j0 = _max(0, -iw0)              # valid kernel columns are [j0, j1)
        j1 = _min(kw, W - iw0)
        for i in range(kh):
            ih = oh * s - p + i
            dst = col + ((r * Wo + ow) * kh + i) * kw * pix
            if ih < 0 or ih >= H or j1 <= j0:
                memset(dst, 0, kw * pix)
                continue
            if j0 > 0:
                memset(dst, 0, j0 * pix)
            memcpy(dst + j0 * pix, x + ((n * H + ih) * W + iw0 + j0) * pix, (j1 - j0) * pix)
            if j1 < kw:
                memset(dst + j1 * pix, 0, (kw - j1) * pix)


def im2col(x, int kh, int kw, int stride, int pad, col):
    """col[(n*Ho + oh)*Wo + ow, (i*kw + j)*C + c] = x[n, oh*s - p + i, ow*s - p + j, c], zero outside.

    x: C-contiguous (N, H, W, C) of any dtype; col: C-contiguous (N*Ho*Wo, kh*kw*C)
    of the same dtype, overwritten. A pure copy, done bytewise (C * itemsize bytes
    per kernel tap), so float16, float32 and float64 share one kernel.
    """
    cdef Py_ssize_t N = x.shape[0], H = x.shape[1], W = x.shape[2], C = x.shape[3]
    cdef Py_ssize_t Ho = (H + 2 * pad - kh) // stride + 1
    cdef Py_ssize_t Wo = (W + 2 * pad - kw) // stride + 1
    if col.dtype != x.dtype or col.shape != (N * Ho * Wo, kh * kw * C):
        raise ValueError(f"col must be {x.dtype} of shape {(N * Ho * Wo, kh * kw * C)}, "
                         f"got {col.dtype} {col.shape}")
    if col.size == 0:
        return col
    cdef const unsigned char[:, :, :, ::1] xb = x.view(np.uint8)      # (N, H, W, C*itemsize)
    cdef unsigned char[:, ::1] cb = col.view(np.uint8)
    cdef Py_ssize_t pix = xb.shape[3]
    cdef const unsigned char* xptr = &xb[0, 0, 0, 0]
    cdef unsigned char* cptr = &cb[0, 0]
    cdef Py_ssize_t r
    cdef bint threads = cb.shape[0] * cb.shape[1] > PARALLEL_MIN_BYTES
    for r in prange(N * Ho, nogil=True, schedule="static", use_threads_if=threads):
        _im2col_row(xptr, cptr, r, H, W, Ho, Wo, kh, kw, stride, pad, pix)
    return col


cdef void _col2im_row(const floating* col, floating* dx, Py_ssize_t q,
                      Py_ssize_t H, Py_ssize_t W, Py_ssize_t C, Py_ssize_t Ho, Py_ssize_t Wo,
                      Py_ssize_t kh, Py_ssize_t kw, Py_ssize_t s, Py_ssize_t p,
                      bint zero) noexcept nogil:
    """Gather into input row q = n*H + ih every column entry that im2col copied from it,
    having zeroed the row first with `zero`.

    Each thread owns whole input rows, so no two threads write the same dx element.
    """
    cdef Py_ssize_t n = q // H, ih = q % H
    cdef Py_ssize_t i, t, oh, ow, iw0, j0, j1, k, L
    cdef const floating* src
    cdef floating* dst
    if zero:
        memset(dx + q * W * C, 0, W * C * sizeof(floating))
    for i in range(kh):
        t = ih + p - i                  # = oh * s for the output row that reads ih through kernel row i
        if t < 0 or t % s != 0:
            continue
        oh = t // s
        if oh >= Ho:
            continue
        for ow in range(Wo):
            iw0 = ow * s - p
            j0 = _max(0, -iw0)
            j1 = _min(kw, W - iw0)
            if j1 <= j0:
                continue
            src = col + (((n * Ho + oh) * Wo + ow) * kh + i) * kw * C + j0 * C
            dst = dx + ((n * H + ih) * W + iw0 + j0) * C
            L = (j1 - j0) * C
            for k in range(L):
                dst[k] += src[k]


def col2im(const floating[:, ::1] col, int kh, int kw, int stride, int pad,
           floating[:, :, :, ::1] dx, bint zero):
    """The adjoint of im2col: dx[n, oh*s - p + i, ow*s - p + j, c] += col[(n*Ho + oh)*Wo + ow, (i*kw + j)*C + c].

    col: (N*Ho*Wo, kh*kw*C); dx: (N, H, W, C) of the same dtype (float32 or
    float64), summed into, or into zeros with `zero` (each thread zeroes the rows it
    sums into, while they are in its cache). Parallel over the N*H input rows.
    """
    cdef Py_ssize_t N = dx.shape[0], H = dx.shape[1], W = dx.shape[2], C = dx.shape[3]
    cdef Py_ssize_t Ho = (H + 2 * pad - kh) // stride + 1
    cdef Py_ssize_t Wo = (W + 2 * pad - kw) // stride + 1
    if col.shape[0] != N * Ho * Wo or col.shape[1] != kh * kw * C:
        raise ValueError(f"col must have shape {(N * Ho * Wo, kh * kw * C)}, "
                         f"got {(col.shape[0], col.shape[1])}")
    if col.shape[0] == 0 or col.shape[1] == 0:
        return
    cdef const floating* cptr = &col[0, 0]
    cdef floating* dptr = &dx[0, 0, 0, 0]
    cdef Py_ssize_t q
    cdef bint threads = col.shape[0] * col.shape[1] * sizeof(floating) > PARALLEL_MIN_BYTES
    for q in prange(N * H, nogil=True, schedule="static", use_threads_if=threads):
        _col2im_row(cptr, dptr, q, H, W, C, Ho, Wo, kh, kw, stride, pad, zero)
