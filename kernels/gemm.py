"""float32 GEMMs that OpenBLAS, as NumPy calls it, runs below its peak: the two of a
fully connected layer at a small batch, and stacks of products.

    rows_dot_rows(a, bt)   y[m, n] = sum_k a[m, k] bt[n, k]    (y = a @ bt.T; few rows m)
    outer_sum(a, b)        y[n, j] = sum_k a[n, k] b[k, j]     (y = a @ b; few k)

The first is the forward y = x W^T of Linear, the second its weight gradient
dW = dy^T x, both with the batch as the short dimension: the weight is read or
written once, and the few multiply-adds per weight must keep pace with that
stream. Each thread takes a few rows of the long operand at a time:
  - rows_dot_rows: 4 x 4 dot products at once, 16 running sums in registers, so
    that every float loaded from `a` or `bt` feeds 4 multiply-adds;
  - outer_sum: two output rows, built from 4 rows of `b` per pass, so that every
    float loaded from `b` feeds both rows, and the rows are read and written K/4
    times, not K.
Each output element is summed by one thread in a fixed order: the same inputs give
the same bits at any thread count.

`matmul(a, b, out)` picks one of them where the shapes and layouts fit (FEW_ROWS,
FEW_INNER) and hands every other product to NumPy. The limits are where the
kernels stop beating OpenBLAS on the development host (docs/benchmarks.md).

`batched_matmul(a, b, out)` computes a stack of products, out[k] = a[k] @ b[k], such
as the 16 GEMMs of a Winograd convolution. NumPy would run them one after another,
each split between the BLAS threads; OpenBLAS's sgemm_batch_strided (OpenBLAS 0.3.30
and later) takes the whole stack in one call and gives each thread whole products.
It is found in the OpenBLAS that NumPy loaded (threadpoolctl names its file); with
another BLAS, or an older OpenBLAS, the products go to NumPy one by one. So do products
of at most 100^3 multiply-adds: OpenBLAS sends those to its small-matrix kernels,
which crash inside a batch in builds for several CPU types, NumPy's among them, up to
0.3.31 (OpenMathLib/OpenBLAS#5980).
"""
import ctypes
import functools

import numpy as np
from numba import njit, prange

FEW_ROWS = 32           # rows_dot_rows for a @ b with a.shape[0] <= FEW_ROWS and b = bt.T
FEW_INNER = 16          # outer_sum for a @ b with a.shape[1] <= FEW_INNER
SMALL_PRODUCT = 100 ** 3    # m n k up to which a batch's products go to np.matmul
# Sums may be reordered (vectorised) and fused into FMAs; nothing more of fastmath:
# an inf or NaN in an operand must reach the product, where the loss scale looks for it.
FAST = {"reassoc", "contract"}


def matmul(a, b, out=None):
    """a @ b on NumPy arrays, into `out` when given, by a kernel of this module
    where the operands fit one, else by np.matmul."""
    if not (a.ndim == b.ndim == 2 and a.shape[1] == b.shape[0] > 0
            and a.dtype == b.dtype == np.float32
            and (out is None or out.shape == (a.shape[0], b.shape[1])
                 and out.dtype == np.float32 and out.flags.c_contiguous)):
        return np.matmul(a, b, out=out)
    N, K = a.shape
    if K <= FEW_INNER and K % 4 == 0 and N % 2 == 0 and b.flags.c_contiguous:
        kernel, args = _outer_sum, (a, b)
    elif N <= FEW_ROWS and a.flags.c_contiguous and b.T.flags.c_contiguous:
        kernel, args = _rows_dot_rows, (a, b.T)
    else:
        return np.matmul(a, b, out=out)
    y = out if out is not None else np.empty((N, b.shape[1]), np.float32)
    kernel(*args, y)
    return y


@njit(parallel=True, fastmath=FAST, nogil=True, cache=True)
def _rows_dot_rows(a, bt, y):
    """y[m, n] = sum_k a[m, k] bt[n, k];  a (M, K), bt (N, K), y (M, N)."""
    M, N = y.shape
    for q in prange((N + 3) // 4):
        n0, n1 = 4 * q, min(4 * q + 4, N)
        m4 = M - M % 4 if n1 - n0 == 4 else 0
        for m in range(0, m4, 4):
            _dot_4x4(a, bt, y, m, n0)
        for m in range(m4, M):
            for n in range(n0, n1):
                s = np.float32(0)
                for k in range(a.shape[1]):
                    s += a[m, k] * bt[n, k]
                y[m, n] = s


@njit(fastmath=FAST, nogil=True, cache=True)
def _dot_4x4(a, bt, y, m, n):
    """y[m:m+4, n:n+4] = a[m:m+4] bt[n:n+4]^T, the 16 sums held in registers."""
    a0, a1, a2, a3 = a[m], a[m + 1], a[m + 2], a[m + 3]
    b0, b1, b2, b3 = bt[n], bt[n + 1], bt[n + 2], bt[n + 3]
    s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = np.float32(0)
    s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = np.float32(0)
    for k in range(a.shape[1]):
        u0, u1, u2, u3 = a0[k], a1[k], a2[k], a3[k]
        v = b0[k]
        s00 += u0 * v; s10 += u1 * v; s20 += u2 * v; s30 += u3 * v
        v = b1[k]
        s01 += u0 * v; s11 += u1 * v; s21 += u2 * v; s31 += u3 * v
        v = b2[k]
        s02 += u0 * v; s12 += u1 * v; s22 += u2 * v; s32 += u3 * v
        v = b3[k]
        s03 += u0 * v; s13 += u1 * v; s23 += u2 * v; s33 += u3 * v
    y[m, n], y[m, n + 1], y[m, n + 2], y[m, n + 3] = s00, s01, s02, s03
    y[m + 1, n], y[m + 1, n + 1], y[m + 1, n + 2], y[m + 1, n + 3] = s10, s11, s12, s13
    y[m + 2, n], y[m + 2, n + 1], y[m + 2, n + 2], y[m + 2, n + 3] = s20, s21, s22, s23
    y[m + 3, n], y[m + 3, n + 1], y[m + 3, n + 2], y[m + 3, n + 3] = s30, s31, s32, s33


@njit(parallel=True, fastmath=FAST, nogil=True, cache=True)
def _outer_sum(a, b, y):
    """y[n, j] = sum_k a[n, k] b[k, j];  a (N, K), b (K, J), y (N, J);  N even, K % 4 == 0."""
    N, K = a.shape
    for q in prange(N // 2):
        n = 2 * q
        r0, r1 = y[n], y[n + 1]
        for k in range(0, K, 4):
            c0, c1, c2, c3 = a[n, k], a[n, k + 1], a[n, k + 2], a[n, k + 3]
            d0, d1, d2, d3 = a[n + 1, k], a[n + 1, k + 1], a[n + 1, k + 2], a[n + 1, k + 3]
            b0, b1, b2, b3 = b[k], b[k + 1], b[k + 2], b[k + 3]
            first = k == 0
            for j in range(r0.size):
                u, v, w, z = b0[j], b1[j], b2[j], b3[j]
                s0 = c0 * u + c1 * v + c2 * w + c3 * z
                s1 = d0 * u + d1 * v + d2 * w + d3 * z
                r0[j] = s0 if first else r0[j] + s0
                r1[j] = s1 if first else r1[j] + s1


def batched_matmul(a, b, out):
    """out[k] = a[k] @ b[k] for every k: (K, m, q) @ (K, q, n) -> (K, m, n), in one call
    of OpenBLAS's sgemm_batch_strided where the operands allow it (float32, each stack a
    strided view whose matrices have a unit-stride axis, out's along its rows), else by
    np.matmul product by product. out must not overlap a or b. Returns out."""
    call = _batch_strided()
    layouts = None
    if (call is not None and a.dtype == b.dtype == out.dtype == np.float32
            and min(a.shape[1:] + b.shape[2:]) > 1 and a.shape[0] > 0
            and a.shape[1] * a.shape[2] * b.shape[2] > SMALL_PRODUCT):
        layouts = [_layout(m) for m in (a, b, out)]
    if layouts is None or None in layouts or layouts[2][0] != _NO_TRANS:
        for k in range(a.shape[0]):
            np.matmul(a[k], b[k], out=out[k])
        return out
    (ta, lda, sa), (tb, ldb, sb), (_, ldc, sc) = layouts
    K, m, q = a.shape
    call(_ROW_MAJOR, ta, tb, m, b.shape[2], q, 1.0, a.ctypes.data, lda, sa,
         b.ctypes.data, ldb, sb, 0.0, out.ctypes.data, ldc, sc, K)
    return out


_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112          # CBLAS's enum values


def _layout(stack):
    """(transpose, leading dimension, stride between matrices) of a (K, r, c) stack in
    elements, as CBLAS row-major takes it, or None if no matrix axis has unit stride."""
    s0, s1, s2 = (s // stack.itemsize for s in stack.strides)
    if s2 == 1 and s1 >= stack.shape[2]:
        return _NO_TRANS, s1, s0
    if s1 == 1 and s2 >= stack.shape[1]:
        return _TRANS, s2, s0
    return None


@functools.cache
def _batch_strided():
    """OpenBLAS's cblas_sgemm_batch_strided from the library NumPy loaded, its integers
    (blasint) 64-bit where OpenBLAS was built with USE64BITINT; None where absent."""
    from threadpoolctl import threadpool_info
    for info in threadpool_info():
        if info.get("internal_api") != "openblas":
            continue
        lib = ctypes.CDLL(info["filepath"])
        call = _symbol(lib, "cblas_sgemm_batch_strided", "scipy_cblas_sgemm_batch_strided")
        config = _symbol(lib, "openblas_get_config", "scipy_openblas_get_config")
        if call is None or config is None:
            continue
        config.restype = ctypes.c_char_p
        integer = ctypes.c_int64 if b"USE64BITINT" in config() else ctypes.c_int32
        call.argtypes = ([ctypes.c_int] * 3 + [integer] * 3 + [ctypes.c_float]
                         + [ctypes.c_void_p, integer, integer] * 2 + [ctypes.c_float]
                         + [ctypes.c_void_p, integer, integer, integer])
        call.restype = None
        return call
    return None


def _symbol(lib, *names):
    """The first of names, or of their ILP64 spellings (suffix 64_), that lib exports."""
    for name in names:
        for spelled in (name, name + "64_"):
            try:
                return getattr(lib, spelled)
            except AttributeError:
                pass
    return None
