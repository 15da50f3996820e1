# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Max and average pooling for NHWC tensors (square window k, stride s, padding p), OpenMP-parallel.

    Ho = (H + 2p - k) // s + 1, window of output (oh, ow): rows oh*s - p + [0, k), cols ow*s - p + [0, k)
    max:  y[n, oh, ow, c] = max over the window (padding is -inf), argmax[n, oh, ow, c] = ih*W + iw
          of the first maximum in row-major window order, a NaN above every number (the
          first NaN, as NumPy's argmax; PyTorch's kernels take the last)
          dx[n, ih, iw, c] = sum of dy[n, oh, ow, c] over the outputs whose argmax is ih*W + iw
    avg:  y = (sum over the window) / k^2  (padding counts as zeros: count_include_pad=True)
          dx[n, ih, iw, c] = sum over the windows containing (ih, iw) of dy[n, oh, ow, c] / k^2

The wrappers (kernels/pool.py) check shapes, allocate outputs and zero dx.
"""
from cython.parallel import prange
from libc.math cimport INFINITY

include "_common.pxi"   # PARALLEL_MIN_BYTES, floating, _max, _min


cdef void _max_row(const floating* x, floating* y, int* arg, Py_ssize_t r,
                   Py_ssize_t H, Py_ssize_t W, Py_ssize_t C, Py_ssize_t Ho, Py_ssize_t Wo,
                   Py_ssize_t k, Py_ssize_t s, Py_ssize_t p) noexcept nogil:
    """Output row r = n*Ho + oh."""
    cdef Py_ssize_t n = r // Ho, oh = r % Ho
    cdef Py_ssize_t ih0 = oh * s - p, i0 = _max(0, -ih0), i1 = _min(k, H - ih0)
    cdef Py_ssize_t ow, iw0, j0, j1, i, j, c
    cdef int pos
    cdef bint take
    cdef floating v
    cdef floating* yp
    cdef int* ap
    cdef const floating* xp
    for ow in range(Wo):
        iw0 = ow * s - p
        j0 = _max(0, -iw0)
        j1 = _min(k, W - iw0)
        yp = y + (r * Wo + ow) * C
        ap = arg + (r * Wo + ow) * C
        pos = <int>((ih0 + i0) * W + iw0 + j0)      # the first valid tap, as PyTorch starts
        for c in range(C):
            yp[c] = -INFINITY
            ap[c] = pos
        for i in range(i0, i1):
            for j in range(j0, j1):
                pos = <int>((ih0 + i) * W + iw0 + j)
                xp = x + ((n * H + ih0 + i) * W + iw0 + j) * C
                for c in range(C):
                    # as selects rather than a branch, so that the channels vectorise;
                    # a NaN is taken unless the maximum so far is one
                    v = xp[c]
                    take = (v > yp[c]) | ((v != v) & (yp[c] == yp[c]))
                    yp[c] = v if take else yp[c]
                    ap[c] = pos if take else ap[c]


def max_pool_forward(const floating[:, :, :, ::1] x, int k, int stride, int pad,
                     floating[:, :, :, ::1] y, int[:, :, :, ::1] argmax):
    """y = window maxima, argmax = ih*W + iw of each (int32), both (N, Ho, Wo, C), overwritten."""
    cdef Py_ssize_t N = x.shape[0], H = x.shape[1], W = x.shape[2], C = x.shape[3]
    cdef Py_ssize_t Ho = y.shape[1], Wo = y.shape[2]
    if y.size == 0:
        return
    cdef const floating* xptr = &x[0, 0, 0, 0]
    cdef floating* yptr = &y[0, 0, 0, 0]
    cdef int* aptr = &argmax[0, 0, 0, 0]
    cdef Py_ssize_t r
    cdef bint threads = y.size * k * k * sizeof(floating) > PARALLEL_MIN_BYTES
    for r in prange(N * Ho, nogil=True, schedule="static", use_threads_if=threads):
        _max_row(xptr, yptr, aptr, r, H, W, C, Ho, Wo, k, stride, pad)


def max_pool_backward(const floating[:, :, :, ::1] dy, const int[:, :, :, ::1] argmax,
                      floating[:, :, :, ::1] dx):
    """dx[n, argmax // W, argmax % W, c] += dy[n, oh, ow, c]; parallel over n (argmax stays in its image)."""
    cdef Py_ssize_t N = dx.shape[0], HW = dx.shape[1] * dx.shape[2], C = dx.shape[3]
    cdef Py_ssize_t M = dy.shape[1] * dy.shape[2]
    if dy.size == 0:
        return
    cdef const floating* gy = &dy[0, 0, 0, 0]
    cdef const int* ap = &argmax[0, 0, 0, 0]
    cdef floating* gx = &dx[0, 0, 0, 0]
    cdef Py_ssize_t n, m, c, o
    cdef bint threads = dy.size * sizeof(floating) > PARALLEL_MIN_BYTES
    for n in prange(N, nogil=True, schedule="static", use_threads_if=threads):
        for m in range(M):
            o = (n * M + m) * C
            for c in range(C):
                gx[(n * HW + ap[o + c]) * C + c] += gy[o + c]


cdef void _avg_row(const floating* x, floating* y, Py_ssize_t r,
                   Py_ssize_t H, Py_ssize_t W, Py_ssize_t C, Py_ssize_t Ho, Py_ssize_t Wo,
                   Py_ssize_t k, Py_ssize_t s, Py_ssize_t p) noexcept nogil:
    cdef Py_ssize_t n = r // Ho, oh = r % Ho
    cdef Py_ssize_t ih0 = oh * s - p, i0 = _max(0, -ih0), i1 = _min(k, H - ih0)
    cdef Py_ssize_t ow, iw0, j0, j1, i, j, c
    cdef floating scale = <floating>1.0 / (k * k)
    cdef floating* yp
    cdef const floating* xp
    for ow in range(Wo):
        iw0 = ow * s - p
        j0 = _max(0, -iw0)
        j1 = _min(k, W - iw0)
        yp = y + (r * Wo + ow) * C
        for c in range(C):
            yp[c] = 0
        for i in range(i0, i1):
            for j in range(j0, j1):
                xp = x + ((n * H + ih0 + i) * W + iw0 + j) * C
                for c in range(C):
                    yp[c] += xp[c]
        for c in range(C):
            yp[c] *= scale


def avg_pool_forward(const floating[:, :, :, ::1] x, int k, int stride, int pad,
                     floating[:, :, :, ::1] y):
    """y = window sums / k^2, (N, Ho, Wo, C), overwritten."""
    cdef Py_ssize_t N = x.shape[0], H = x.shape[1], W = x.shape[2], C = x.shape[3]
    cdef Py_ssize_t Ho = y.shape[1], Wo = y.shape[2]
    if y.size == 0:
        return
    cdef const floating* xptr = &x[0, 0, 0, 0]
    cdef floating* yptr = &y[0, 0, 0, 0]
    cdef Py_ssize_t r
    cdef bint threads = y.size * k * k * sizeof(floating) > PARALLEL_MIN_BYTES
    for r in prange(N * Ho, nogil=True, schedule="static", use_threads_if=threads):
        _avg_row(xptr, yptr, r, H, W, C, Ho, Wo, k, stride, pad)


cdef void _avg_back_row(const floating* dy, floating* dx, Py_ssize_t q,
                        Py_ssize_t H, Py_ssize_t W, Py_ssize_t C, Py_ssize_t Ho, Py_ssize_t Wo,
                        Py_ssize_t k, Py_ssize_t s, Py_ssize_t p) noexcept nogil:
    """Gather into input row q = n*H + ih from every window that covers it."""
    cdef Py_ssize_t n = q // H, ih = q % H
    cdef Py_ssize_t i, t, oh, ow, iw0, j0, j1, j, c
    cdef floating scale = <floating>1.0 / (k * k)
    cdef const floating* g
    cdef floating* d
    for i in range(k):
        t = ih + p - i
        if t < 0 or t % s != 0:
            continue
        oh = t // s
        if oh >= Ho:
            continue
        for ow in range(Wo):
            iw0 = ow * s - p
            j0 = _max(0, -iw0)
            j1 = _min(k, W - iw0)
            g = dy + ((n * Ho + oh) * Wo + ow) * C
            for j in range(j0, j1):
                d = dx + ((n * H + ih) * W + iw0 + j) * C
                for c in range(C):
                    d[c] += g[c] * scale


def avg_pool_backward(const floating[:, :, :, ::1] dy, int k, int stride, int pad,
                      floating[:, :, :, ::1] dx):
    """dx += the adjoint of avg_pool_forward applied to dy; parallel over the N*H input rows."""
    cdef Py_ssize_t N = dx.shape[0], H = dx.shape[1], W = dx.shape[2], C = dx.shape[3]
    cdef Py_ssize_t Ho = dy.shape[1], Wo = dy.shape[2]
    if dy.size == 0 or dx.size == 0:
        return
    cdef const floating* gy = &dy[0, 0, 0, 0]
    cdef floating* gx = &dx[0, 0, 0, 0]
    cdef Py_ssize_t q
    cdef bint threads = dy.size * k * k * sizeof(floating) > PARALLEL_MIN_BYTES
    for q in prange(N * H, nogil=True, schedule="static", use_threads_if=threads):
        _avg_back_row(gy, gx, q, H, W, C, Ho, Wo, k, stride, pad)
