"""float32 GEMMs on the CPU: every product of the layers, on the kernels' thread team.

    matmul(a, b, out)          y = a @ b
    matmul(a, b, out, accumulate=True)    out += a @ b   (one GEMM with beta = 1)
    batched_matmul(a, b, out)  out[k] = a[k] @ b[k] for every k (Winograd's 16 GEMMs)

One team of threads. The layers' other kernels run on Numba's OpenMP team. A BLAS
would run the products on a pool of its own, and two pools of workers on the same
cores either sleep between calls, and are woken for each kernel and each GEMM, or spin
and take each other's cores. So the BLAS runs one thread here, and a product large
enough to share (TEAM_MIN_MACS multiply-adds) is cut into one band of output rows or
columns per team thread, each band one cblas_sgemm call on its thread
(`_team_products`); a stack of products is dealt out a product at a time. Between
kernels the team's threads spin for a moment before they sleep (GOMP_SPINCOUNT,
mpitrain/__init__.py), so the next kernel or GEMM starts without waking anyone.

Each output element comes from one call over the whole inner dimension, and from the
same inner kernel of the BLAS as in one call of the whole product, so it has the same
bits however many bands there are. A BLAS computes its output in blocks, and an element
at a block's edge may be summed in another order: MKL's reproducible mode gives the
same bits at every cut the team makes, but OpenBLAS's kernels take the rows in blocks
from the first row (12 in its Haswell kernels, which AMD's Zen 1 to 3 run too), and the
columns in blocks laid out by the product's width. So OpenBLAS's products are cut by
rows only, at multiples of its core type's row block (`_Blas.granule`,
OPENBLAS_ROW_BLOCKS; docs/benchmarks.md, "The BLAS by CPU").

The BLAS the team calls (`team_blas`) is MKL's sequential library on Intel's CPUs where
the mkl package is installed (the `mkl` extra, which launch.sh installs on those
CPUs), else NumPy's own OpenBLAS, set to one thread (`blas_threads`); MPITRAIN_BLAS=mkl
or openblas chooses (kernels/blas_choice.py). With MKL, products large enough for the team go to
it on one thread too, so that their bits do not depend on the thread count; the smaller
ones stay NumPy's. MKL runs in its reproducible mode (CBWR AUTO, STRICT), whose bits do
not depend on where the operands lie in memory.

An accumulating product (beta = 1) adds into `out` inside the BLAS's kernel, which
reads and writes each output element anyway: no pass of its own (and, with OpenBLAS,
none of the zeroing pass over the output that beta = 0 costs). It goes to the BLAS on
one thread too, so each output element is one call's over the whole inner dimension
whatever the thread count, and has the same bits on any; with OpenBLAS they are those
of a separate add where the inner dimension fits one of its blocks of it, and differ
by a rounding beyond.

Without MKL, where the process has one thread, or the user gave OpenBLAS threads of
its own (OPENBLAS_NUM_THREADS above 1), or NumPy's BLAS is not OpenBLAS, the products
are the BLAS's own, as NumPy runs them.

Two products that OpenBLAS runs below its peak on any number of threads get kernels of
their own: those of a fully connected layer at a small batch.

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
the same bits at any thread count. `matmul` takes them where the shapes and layouts
fit (FEW_ROWS, FEW_INNER); the limits are where they stop beating OpenBLAS on the
development host (docs/benchmarks-record.md).

Without MKL, on one thread, a stack of products goes to OpenBLAS's
sgemm_batch_strided in one call, found in the OpenBLAS that NumPy loaded (threadpoolctl
names its file); with another BLAS, or an OpenBLAS without that function, the products
go to NumPy one by one. So do products of at most 100^3 multiply-adds: OpenBLAS sends
those to its small-matrix kernels, which crash inside a batch in some of its builds
(docs/design-notes.md).
"""
import ctypes
import functools
import os

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .blas_choice import blas_choice, blas_choice_problem

FEW_ROWS = 32           # rows_dot_rows for a @ b with a.shape[0] <= FEW_ROWS and b = bt.T
FEW_INNER = 16          # outer_sum for a @ b with a.shape[1] <= FEW_INNER
SMALL_PRODUCT = 100 ** 3    # m n k up to which a batch's products go to np.matmul
TEAM_MIN_MACS = 1 << 20     # m n k from which a product, or a band of one, is the team's
MIN_BAND = 16               # rows (or columns) of the output a team thread takes at least
# OpenBLAS's bands start at multiples of its core type's row block (threadpoolctl's
# "architecture", measured: docs/benchmarks.md, "The BLAS by CPU"), for another core type
# at multiples of OPENBLAS_ROWS, a multiple of each
OPENBLAS_ROW_BLOCKS = {"Haswell": 12, "Nehalem": 8, "Katmai": 4, "SkylakeX": 1, "Sandybridge": 1}
OPENBLAS_ROWS = 48
# Sums may be reordered (vectorised) and fused into FMAs; nothing more of fastmath:
# an inf or NaN in an operand must reach the product, where the loss scale looks for it.
FAST = {"reassoc", "contract"}


def matmul(a, b, out=None, accumulate=False):
    """a @ b on NumPy arrays, into `out` when given: by a kernel of this module where the
    operands fit one, shared among the team where it has more than one thread, else by
    np.matmul. accumulate: out += a @ b (out given), as one GEMM with beta = 1 where
    the team's BLAS can take it (module docstring), else the product added after."""
    if not (a.ndim == b.ndim == 2 and a.shape[1] == b.shape[0] > 0
            and a.dtype == b.dtype == np.float32
            and (out is None or out.shape == (a.shape[0], b.shape[1])
                 and out.dtype == np.float32 and out.flags.c_contiguous)):
        return np.add(out, np.matmul(a, b), out=out) if accumulate else np.matmul(a, b, out=out)
    N, K = a.shape
    if accumulate:
        y = _on_team(a[None], b[None], out[None], beta=1.0)
        return np.add(out, np.matmul(a, b), out=out) if y is None else out
    if K <= FEW_INNER and K % 4 == 0 and N % 2 == 0 and b.flags.c_contiguous:
        kernel, args = _outer_sum, (a, b)
    elif N <= FEW_ROWS and a.flags.c_contiguous and b.T.flags.c_contiguous:
        kernel, args = _rows_dot_rows, (a, b.T)
    else:
        y = _on_team(a[None], b[None], None if out is None else out[None])
        return np.matmul(a, b, out=out) if y is None else y[0]
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
    """out[k] = a[k] @ b[k] for every k: (K, m, q) @ (K, q, n) -> (K, m, n): shared among
    the team where it takes them (_on_team), else in one call of OpenBLAS's
    sgemm_batch_strided where the operands allow it (_batch_call), else by np.matmul
    product by product. out must not overlap a or b. Returns out."""
    if _on_team(a, b, out) is None and _batch_call(a, b, out) is None:
        for k in range(a.shape[0]):
            np.matmul(a[k], b[k], out=out[k])
    return out


def _batch_call(a, b, out):
    """The stack in one call of OpenBLAS's sgemm_batch_strided, into out, which it
    returns: where NumPy's OpenBLAS has it, the operands are float32, each stack a
    strided view whose matrices have a unit-stride axis (out's along its rows), and the
    products are above SMALL_PRODUCT; else None, having done nothing."""
    call = _batch_strided()
    if (call is None or not a.dtype == b.dtype == out.dtype == np.float32
            or min(a.shape[1:] + b.shape[2:]) <= 1 or a.shape[0] == 0
            or a.shape[1] * a.shape[2] * b.shape[2] <= SMALL_PRODUCT):
        return None
    layouts = [_layout(m) for m in (a, b, out)]
    if None in layouts or layouts[2][0] != _NO_TRANS:
        return None
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


# ----- the products on the team -----
def _on_team(a, b, out, beta=0.0):
    """The stack out[k] = a[k] @ b[k] + beta out[k] computed on the team by team_blas(),
    into `out` (a new array where None; beta 0 or 1), where the team has more than one
    thread (or beta is 1, or the BLAS is not NumPy's: then on one thread too), the BLAS
    runs one thread of its own, the operands are float32 with a layout CBLAS takes, and
    the products are large enough to share; else None, having done nothing."""
    threads = numba.get_num_threads()
    count, m, q = a.shape
    n = b.shape[2]
    blas = team_blas()
    # where one thread takes np.matmul, so does the team: a product of one row or column
    # too, which NumPy sends to gemv, whose sums sgemm's bands would not repeat
    if (blas is None or beta == 0 and blas.numpys and (threads == 1 or min(m, n) == 1)
            or not a.dtype == b.dtype == np.float32
            or (out is not None and out.dtype != np.float32)
            or count * m * n * q < TEAM_MIN_MACS or min(m, n, q) == 0 or blas.threads() != 1):
        return None
    layouts = [_layout(x) for x in (a, b)]
    if None in layouts:
        return None
    out = out if out is not None else np.empty((count, m, n), np.float32)
    layouts.append(_layout(out))
    if layouts[2] is None or layouts[2][0] != _NO_TRANS:
        return None
    (ta, lda, sa), (tb, ldb, sb), (_, ldc, sc) = layouts
    if threads == 1:            # each product one call, from here
        a, b, c = a.ctypes.data, b.ctypes.data, out.ctypes.data
        for i in range(count):
            blas.call(_ROW_MAJOR, ta, tb, m, n, q, 1.0, a + 4 * i * sa, lda, b + 4 * i * sb, ldb,
                      beta, c + 4 * i * sc, ldc)
        return out
    # bands of the longer side of each output (of the rows where the BLAS's bits allow
    # no other cut), enough for every thread to have work; each a whole number of the
    # BLAS's granules and at least TEAM_MIN_MACS, above the products that OpenBLAS sends
    # to its small-matrix kernels (SMALL_PRODUCT), which sum in another order: a band has
    # the bits of the whole product
    by_rows = m >= n or blas.granule > 1
    side, across = (m, n) if by_rows else (n, m)
    granule = blas.granule if by_rows else 1
    need = max(-(-MIN_BAND // granule), -(-TEAM_MIN_MACS // (granule * across * q)))
    bands = max(1, min(-(-threads // count), side // granule // need))
    _team_products(blas.sgemm, blas.integer(0), ta, tb, m, n, q,
                   a.ctypes.data, lda, sa, b.ctypes.data, ldb, sb, np.float32(beta),
                   out.ctypes.data, ldc, sc, count, bands, by_rows, granule)
    return out


@njit(inline="always", cache=True)
def band_rows(band, bands, size, granule):
    """(lo, hi): band `band` of `bands` over `size` rows (or columns), each cut at the
    multiple of `granule` nearest the even cut: band * size / bands, rounded half up."""
    half = bands * granule
    lo = (2 * band * size + half) // (2 * half) * granule
    hi = size if band == bands - 1 else (2 * (band + 1) * size + half) // (2 * half) * granule
    return lo, hi


@intrinsic
def _cblas_sgemm(typingctx, fn, blasint, order, ta, tb, m, n, k, alpha, a, lda, b, ldb,
                 beta, c, ldc):
    """cblas_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) called at
    the address fn: the enums as C ints, the sizes as integers of blasint's type (the
    BLAS's), alpha and beta as float32, the matrices given by their addresses."""
    signature = types.void(fn, blasint, order, ta, tb, m, n, k, alpha, a, lda, b, ldb,
                           beta, c, ldc)

    def codegen(context, builder, sig, args):
        enum, size = ir.IntType(32), ir.IntType(blasint.bitwidth)
        pointer, single = ir.IntType(8).as_pointer(), ir.FloatType()
        params = [enum] * 3 + [size] * 3 + [single, pointer, size, pointer, size, single,
                                            pointer, size]
        values = []
        for value, param in zip(args[2:], params):
            if param is pointer:
                value = builder.inttoptr(value, pointer)
            elif param is not single:
                value = builder.sext(value, param) if param.width > value.type.width \
                    else builder.trunc(value, param) if param.width < value.type.width else value
            values.append(value)
        callee = builder.inttoptr(args[0], ir.FunctionType(ir.VoidType(), params).as_pointer())
        builder.call(callee, values)
    return signature, codegen


@njit(parallel=True, nogil=True, cache=True)
def _team_products(sgemm, blasint, ta, tb, m, n, k, a, lda, sa, b, ldb, sb, beta, c, ldc, sc,
                   count, bands, by_rows, granule):
    """c[i] = a[i] @ b[i] + beta c[i] for i < count, row-major float32 matrices at the
    addresses a, b and c (matrix i at a + 4 i sa, ...), a[i] and b[i] transposed as ta and
    tb say; each product in `bands` bands of its rows (by_rows) or columns (band_rows, at
    multiples of `granule`), each band one sgemm call (at the address sgemm) on one
    thread of the team."""
    one = np.float32(1.0)
    for t in prange(count * bands):
        i, band = t // bands, t % bands
        ai, bi, ci = a + 4 * i * sa, b + 4 * i * sb, c + 4 * i * sc
        rows, cols = m, n
        if by_rows:         # rows lo..hi of c: of a's rows, or of its columns if transposed
            lo, hi = band_rows(band, bands, m, granule)
            ai += 4 * lo * (lda if ta == _NO_TRANS else 1)
            ci += 4 * lo * ldc
            rows = hi - lo
        else:               # columns lo..hi of c: of b's columns, or of its rows if transposed
            lo, hi = band_rows(band, bands, n, granule)
            bi += 4 * lo * (1 if tb == _NO_TRANS else ldb)
            ci += 4 * lo
            cols = hi - lo
        _cblas_sgemm(sgemm, blasint, _ROW_MAJOR, ta, tb, rows, cols, k, one, ai, lda, bi, ldb,
                     beta, ci, ldc)


# ----- the team's BLAS: MKL on Intel's CPUs where installed, else NumPy's OpenBLAS -----
class _Blas:
    """A BLAS whose cblas_sgemm the team calls: its name and version, the library, the
    address of cblas_sgemm, its integer type (blasint), its thread count, whether it is
    NumPy's own BLAS (np.matmul then computes the team's bits), and the granule: 1 where
    a product may be cut anywhere with its bits kept, else the rows a band is a multiple
    of (and no columns are cut)."""

    def __init__(self, name, version, lib, sgemm, integer, threads, numpys, granule):
        self.name, self.version, self.lib, self.integer = name, version, lib, integer
        self.sgemm = ctypes.cast(sgemm, ctypes.c_void_p).value
        self.threads, self.numpys, self.granule = threads, numpys, granule
        size = ctypes.c_int64 if integer == np.int64 else ctypes.c_int32
        # cblas_sgemm from Python, for the products of a team of one: a Numba kernel's
        # launch cost more than the call
        self.call = ctypes.CFUNCTYPE(None, *[ctypes.c_int] * 3, size, size, size,
                                     ctypes.c_float, ctypes.c_void_p, size, ctypes.c_void_p,
                                     size, ctypes.c_float, ctypes.c_void_p, size)(self.sgemm)


@functools.cache
def team_blas():
    """The BLAS the team's products go to (_Blas): MKL where blas_choice() says so and it
    loads, else NumPy's OpenBLAS; None where neither is found. On Intel's CPUs MKL is
    preferred because its beta = 0 kernel writes the output without zeroing and re-reading
    it first, which makes the step's products faster (docs/benchmarks-record.md)."""
    problem = blas_choice_problem()
    if problem:
        raise ValueError(problem)
    openblas = _openblas()      # on one thread either way: NumPy's smaller products are its
    mkl = _mkl() if blas_choice() == "mkl" else None
    return mkl or openblas


# MKL's constants (mkl_service.h)
_MKL_INTERFACE_LP64, _MKL_THREADING_SEQUENTIAL = 0, 1
_MKL_CBWR_AUTO, _MKL_CBWR_STRICT = 2, 0x10000


def _mkl():
    """MKL's single dynamic library (libmkl_rt) from the mkl package, as _Blas: set to its
    LP64 interface (32-bit integers), its sequential threading layer (no threads of its
    own: the team's threads call it, one product or band each), and reproducible results
    (CBWR AUTO and STRICT: the same bits whatever the operands' alignment, which a resumed
    run needs); None where the package is not installed or the library does not load."""
    import importlib.metadata
    try:
        files = importlib.metadata.files("mkl") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for path in (f.locate() for f in files if f.name.startswith("libmkl_rt.so")):
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:
            continue
        lib.MKL_Set_Interface_Layer(_MKL_INTERFACE_LP64)
        lib.MKL_Set_Threading_Layer(_MKL_THREADING_SEQUENTIAL)
        if lib.MKL_CBWR_Set(_MKL_CBWR_AUTO | _MKL_CBWR_STRICT) != 0:
            continue
        return _Blas("mkl", importlib.metadata.version("mkl") + " (sequential)", lib,
                     lib.cblas_sgemm, np.int32, lambda: 1, numpys=False, granule=1)
    return None


@functools.cache
def _openblas():
    """NumPy's OpenBLAS (_Blas), set to one thread at the first call unless the user gave
    it more (OPENBLAS_NUM_THREADS); None where NumPy's BLAS is not an OpenBLAS with the
    functions used here."""
    from threadpoolctl import threadpool_info
    info = numpys_openblas(threadpool_info())
    if info is None:
        return None
    lib = ctypes.CDLL(info["filepath"])
    found = [_symbol(lib, name, "scipy_" + name) for name in
             ("openblas_get_config", "cblas_sgemm", "openblas_get_num_threads",
              "openblas_set_num_threads")]
    if None in found:
        return None
    config, sgemm, threads, set_threads = found
    config.restype, threads.restype = ctypes.c_char_p, ctypes.c_int
    set_threads.argtypes = [ctypes.c_int]
    if not _user_blas_threads():
        set_threads(1)
    integer = np.int64 if b"USE64BITINT" in config() else np.int32
    granule = OPENBLAS_ROW_BLOCKS.get(info.get("architecture"), OPENBLAS_ROWS)
    return _Blas("openblas", f"{info.get('version')} (NumPy's)", lib, sgemm, integer,
                 threads, numpys=True, granule=granule)


def numpys_openblas(infos):
    """Of threadpoolctl's threadpool_info() entries, NumPy's OpenBLAS: the one in NumPy's
    wheel (numpy.libs) or package, else the only OpenBLAS, else one of the version NumPy
    was built with; None where none is. SciPy's wheel brings an OpenBLAS of its own
    (another version, 32-bit integers), which may be listed first."""
    import numpy
    found = [i for i in infos if i.get("internal_api") == "openblas"]
    home = os.path.dirname(os.path.realpath(numpy.__file__))
    for info in found:
        if os.path.realpath(info["filepath"]).startswith((home + os.sep, home + ".libs" + os.sep)):
            return info
    if len(found) == 1:
        return found[0]
    built = getattr(numpy.__config__, "CONFIG", {}).get("Build Dependencies", {}) \
        .get("blas", {}).get("version")
    return next((i for i in found if built and i.get("version") == built), None)


def _user_blas_threads():
    """Whether the user gave OpenBLAS threads of its own: OPENBLAS_NUM_THREADS above 1."""
    value = os.environ.get("OPENBLAS_NUM_THREADS", "")
    return value.isdigit() and int(value) > 1


def team_gemms(threads):
    """Whether a process running `threads` threads cuts its products among the team: more
    than one thread and a team BLAS (team_blas), and, where that is NumPy's OpenBLAS, no
    OpenBLAS threads of its own from the user."""
    blas = team_blas()
    return threads > 1 and blas is not None and not (blas.numpys and _user_blas_threads())


def describe(threads):
    """Who runs the products of a process running `threads` threads, in words (the run's
    environment report)."""
    blas = team_blas()
    if blas is None:
        return ("NumPy's BLAS, on its own threads (no team BLAS: threadpoolctl finds no "
                "OpenBLAS of NumPy's, and MKL is not chosen)")
    who = f"{blas.name} {blas.version}"
    if team_gemms(threads):
        return f"{who}, cut among the team's {threads} threads"
    if blas.numpys and _user_blas_threads():
        given = os.environ["OPENBLAS_NUM_THREADS"]
        return f"{who}, on its own {given} threads (OPENBLAS_NUM_THREADS)"
    return f"{who}, on one thread"


def blas_threads(threads):
    """The threads NumPy's BLAS runs on in a process running `threads` threads: one where
    the team runs the products (team_gemms), else all of them."""
    return 1 if team_gemms(threads) else threads


@functools.cache
def _batch_strided():
    """OpenBLAS's cblas_sgemm_batch_strided from the library NumPy loaded, its integers
    the library's blasint; None where absent."""
    blas = _openblas()
    call = blas and _symbol(blas.lib, "cblas_sgemm_batch_strided",
                            "scipy_cblas_sgemm_batch_strided")
    if not call:
        return None
    integer = ctypes.c_int64 if blas.integer == np.int64 else ctypes.c_int32
    call.argtypes = ([ctypes.c_int] * 3 + [integer] * 3 + [ctypes.c_float]
                     + [ctypes.c_void_p, integer, integer] * 2 + [ctypes.c_float]
                     + [ctypes.c_void_p, integer, integer, integer])
    call.restype = None
    return call


def _symbol(lib, *names):
    """The first of names, or of their ILP64 spellings (suffix 64_), that lib exports."""
    for name in names:
        for spelled in (name, name + "64_"):
            try:
                return getattr(lib, spelled)
            except AttributeError:
                pass
    return None
