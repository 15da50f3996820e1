"""Fused CUDA kernels for the GPU branches of batch norm (with a residual block's add and
ReLU in its output pass), pooling, dropout and the ReLU's gradient (CuPy RawModule).

On CuPy arrays these replace a chain of small array operations by a few
kernels, all queued on CuPy's current stream. Every kernel is a C++ template
over the storage type T of the activations and the arithmetic type A:

    float16 activations: T = unsigned short (the fp16 bits, converted with the PTX
                         cvt instructions, so that no CUDA header is needed), A = float
    float32:             T = float,  A = float
    float64:             T = double, A = double

so batch-norm statistics and every sum are fp32 (float64 in float64 checks)
whatever the activations, and results are rounded to T once. Activations are
C-contiguous NHWC; batch norm sees them as (M, C), M = N*H*W. The formulas are
in each kernel's comment in gpu.cu, the CUDA C++ beside this file, and in the
docstrings below.

These passes are bound by memory, so their threads read and write V
consecutive elements at a time (a 16-byte `Pack`: 8 fp16, 4 fp32 or 2 fp64
values, when the channels are a multiple of V), which keeps more bytes in
flight; a template parameter V = 1 serves every other shape with the same
body. In batch norm's passes a thread keeps its V channels for all the rows
it visits, so their coefficients are read once, into registers, not once
an element.

Reductions are deterministic: fixed chunks of rows, a fixed tree inside each
block, and a fixed order across blocks (no atomics), so a rerun on the same
device gives the same bits. Nothing here reads a value back to the host.

Dropout draws its mask on the device from a 64-bit key that the kernel reads
from device memory, a (2,) uint32 array of the key's low and high words
(`key_words`), so that a CUDA graph's replay draws the mask of whatever key was
written before it (mpitrain/graph.py). `philox4x32` and `dropout_keep` are the
NumPy reference of the mask; this module imports without CuPy.
"""
import math
import os

import numpy as np

from .batchnorm import FINALIZE_MODES

ROW_THREADS = 256        # threads per block of batch norm's passes over (M, C)
FOLD = 256               # threads per block that adds the partial sums of one column
THREADS = 256            # threads per block of the elementwise and pooling kernels
MAX_POOL_WINDOW = 16     # k of max pooling: its k^2 places in a window fit in a byte
TARGET_BLOCKS = 1024     # blocks of a partial-sum pass, whatever C: enough to fill a GPU
ROW_BLOCKS = 4096        # blocks of batch norm's element passes (rows taken grid-stride)


# dtype -> (the C++ storage type T, the arithmetic type A and its NumPy dtype)
_TYPES = {np.dtype(np.float16): ("unsigned short", "float", np.float32),
          np.dtype(np.float32): ("float", "float", np.float32),
          np.dtype(np.float64): ("double", "double", np.float64)}
# templates over <T, A, V>: each compiled for V = 1 and for the V of a 16-byte Pack
_TEMPLATES_TAV = ("bn_partial_sums", "bn_affine", "bn_backward_dx", "relu_grad", "relu",
                  "add_into", "pool_forward", "pool_backward")
_TEMPLATES_TA = ("bn_finalize", "dropout")
_TEMPLATES_A = ("bn_fold", "bn_backward_coefficients")
_module = None


def name_expressions():
    """Every template instance the module compiles, as RawModule names them."""
    names = []
    for dtype, (T, A, _) in _TYPES.items():
        names += [f"{f}<{T}, {A}, {V}>" for f in _TEMPLATES_TAV for V in (1, 16 // dtype.itemsize)]
        names += [f"{f}<{T}, {A}>" for f in _TEMPLATES_TA]
    for A in ("float", "double"):
        names += [f"{f}<{A}>" for f in _TEMPLATES_A]
    return names


def source():
    """The CUDA C++ source (gpu.cu) with the block-shape constants defined."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu.cu")) as f:
        return f"#define ROW_THREADS {ROW_THREADS}\n#define FOLD {FOLD}\n" + f.read()


# --fmad=false: a * b + c rounded twice, as the CPU's kernels round it, so that the
# elementwise passes keep the CPU's bits (NVRTC contracts such expressions into FMAs)
OPTIONS = ("--std=c++17", "--fmad=false")


def _kernel(name, dtype=None, acc=None, pack=1):
    """The compiled kernel `name` for activations of `dtype` (T and A; `pack`: V, for the
    templates that take it), or for the arithmetic dtype `acc` alone (A); the module
    compiles once (CuPy caches it on disk)."""
    global _module
    import cupy
    if _module is None:
        _module = cupy.RawModule(code=source(), options=OPTIONS,
                                 name_expressions=name_expressions())
    if dtype is not None:
        T, A, _ = _TYPES[np.dtype(dtype)]
        args = f"{T}, {A}, {pack}" if name in _TEMPLATES_TAV else f"{T}, {A}"
    else:
        args = "double" if np.dtype(acc) == np.float64 else "float"
    return _module.get_function(f"{name}<{args}>")


def handles(x):
    """Whether x is a CuPy array of a dtype these kernels take (float16/32/64)."""
    return type(x).__module__.startswith("cupy") and x.dtype in _TYPES


def acc_dtype(dtype):
    """The arithmetic (statistics) dtype of activations of `dtype`: float64 for float64,
    else float32."""
    return np.dtype(_TYPES[np.dtype(dtype)][2])


def _pack(C, *arrays):
    """V of the Pack kernels for rows of C elements: the elements of 16 bytes when C is
    a multiple of them and every array starts on 16 bytes (CuPy's allocations start on
    256), else 1."""
    V = 16 // arrays[0].itemsize
    interface = "__cuda_array_interface__" if hasattr(arrays[0], "__cuda_array_interface__") \
        else "__array_interface__"
    aligned = all(getattr(a, interface)["data"][0] % 16 == 0 for a in arrays)
    return V if C % V == 0 and aligned else 1


def _row_blocks(M, C, V, target):
    """(grid, block) of the (M, C) passes: blockDim.x threads across the C / V packs (up
    to a warp), blockDim.y (a power of 2) down the rows, ROW_THREADS threads a block, and
    about `target` blocks (at most one row a thread, and 65535 along y)."""
    tx = min(32, C // V)
    ty = 1 << (ROW_THREADS // tx).bit_length() - 1
    gx = -(-C // (V * tx))
    gy = max(1, min(-(-M // ty), target // gx, 65535))
    return (gx, gy), (tx, ty)


def _blocks(n):
    """Blocks of THREADS for a grid-stride loop over n items."""
    return (max(1, min(-(-n // THREADS), 8192)),)


# ----- batch norm -----

def batchnorm_sums(x, dy=None, mean=None, relu=None):
    """Per-channel sums of the (M, C) activations x, (2, C) in acc_dtype:
    forward (dy None): (sum_m (x_mc - x_0c), sum_m (x_mc - x_0c)^2), about the shift x[0];
    backward: (sum_m dy_mc, sum_m dy_mc (x_mc - mean_c)), mean (C,) in acc_dtype, dy taken
    through a fused ReLU (0 where forward's output was, recomputed in the kernel) when
    relu = (scale, beta). Two kernels: partial sums over TARGET_BLOCKS blocks of rows and
    channels, then a fold."""
    import cupy
    M, C = x.shape
    acc = acc_dtype(x.dtype)
    grads = dy is not None
    V = _pack(C, x, dy) if grads else _pack(C, x)
    (ctiles, P), block = _row_blocks(M, C, V, TARGET_BLOCKS)
    rows = -(-M // P)
    P = -(-M // rows)                                 # chunks of `rows` rows, none empty
    part = cupy.empty((P, 2, C), acc)                 # (P, 2, C) partial sums
    scale, beta = relu if relu is not None else (part, part)     # unread without relu
    _kernel("bn_partial_sums", x.dtype, pack=V)(
        (ctiles, P), block,
        (x, dy if grads else x, mean if grads else part, scale, beta, np.int32(grads),
         np.int32(relu is not None), np.int64(M), np.int32(C), np.int64(rows), part))
    sums = cupy.empty((2, C), acc)
    _kernel("bn_fold", acc=acc)((2 * C,), (FOLD,), (part, np.int32(P), np.int32(C), sums))
    return sums


def column_sums(a):
    """(C,) sums over the rows of the (M, C) array a, in acc_dtype: a bias's gradient
    from dy. batchnorm_sums' backward kernels with dy = a and a zero mean (their first row
    is sum_m a_mc), folded for that row alone: the whole GPU at memory speed, where a
    reduction over the leading axis of a C-contiguous array would take one block per 32
    columns."""
    import cupy
    M, C = a.shape
    acc = acc_dtype(a.dtype)
    V = _pack(C, a)
    (ctiles, P), block = _row_blocks(M, C, V, TARGET_BLOCKS)
    rows = -(-M // P)
    P = -(-M // rows)
    part = cupy.empty((P, 2, C), acc)
    _kernel("bn_partial_sums", a.dtype, pack=V)(
        (ctiles, P), block,
        (a, a, cupy.zeros(C, acc), part, part, np.int32(1), np.int32(0), np.int64(M),
         np.int32(C), np.int64(rows), part))
    sums = cupy.empty((2, C), acc)
    _kernel("bn_fold", acc=acc)((C,), (FOLD,), (part, np.int32(P), np.int32(C), sums))
    return sums[0]


def batchnorm_finalize(sums, x, count, mode, gamma, eps, momentum, running_mean, running_var):
    """kernels.batchnorm.batchnorm_finalize (its docstring has the formulas) on CuPy arrays:
    (mean, invstd, scale), each (C,) in acc_dtype, from one kernel (one thread per channel),
    the running statistics updated in place in the train modes."""
    import cupy
    M, C = x.shape
    acc = acc_dtype(x.dtype)
    mean, invstd, scale = (cupy.empty(C, acc) for _ in range(3))
    _kernel("bn_finalize", x.dtype)(
        _blocks(C), (THREADS,),
        (sums if sums is not None else mean, x, np.int32(FINALIZE_MODES[mode]),
         np.float64(count), np.int32(C), gamma, np.float64(eps), np.float64(momentum),
         running_mean, running_var, mean, invstd, scale))
    return mean, invstd, scale


def batchnorm_affine(x, mean, scale, beta, relu=False, residual=None):
    """y (M, C) = (x - mean) * scale + beta per channel, computed in acc_dtype, rounded
    to x's dtype once; max(y, 0) with relu, in the same kernel. With `residual` (M, C):
    max(y + residual, 0), also in that kernel (the CPU's one pass, and its bits)."""
    import cupy
    M, C = x.shape
    y = cupy.empty_like(x)
    r = x if residual is None else cupy.ascontiguousarray(residual)     # unread without
    V = _pack(C, x, r, y)
    _kernel("bn_affine", x.dtype, pack=V)(
        *_row_blocks(M, C, V, ROW_BLOCKS),
        (x, mean, scale, beta, np.int32(bool(relu)), r, np.int32(residual is not None),
         np.int64(M), np.int32(C), y))
    return y


def batchnorm_backward_coefficients(local, group, gamma, invstd, count, train, grad_gamma,
                                    grad_beta):
    """coef (3, C) = (a, b, d) of dx = a dy + b (x - mean) + d, with a = gamma invstd and,
    in train mode, b = -a invstd (group[1] invstd) / count, d = -a group[0] / count (eval:
    0, 0); also grad_beta = local[0], grad_gamma = local[1] invstd, written in place.
    local, group: (2, C) sums (sum dy, sum dy (x - mean)): this rank's, and those for dx
    (the group's, or local again). One kernel, one thread per channel."""
    import cupy
    C = local.shape[1]
    coef = cupy.empty((3, C), local.dtype)
    _kernel("bn_backward_coefficients", acc=local.dtype)(
        _blocks(C), (THREADS,),
        (local, group, gamma, invstd, np.float64(count), np.int32(bool(train)), np.int32(C),
         grad_gamma, grad_beta, coef))
    return coef


def batchnorm_dx(dy, x, mean, coef, relu=None):
    """dx (M, C) = a dy + b (x - mean) + d per channel, (a, b, d) = coef, dy taken through
    a fused ReLU (0 where forward's output was) when relu = (scale, beta)."""
    import cupy
    M, C = x.shape
    dx = cupy.empty_like(dy)
    scale, beta = relu if relu is not None else (coef, coef)     # unread without relu
    V = _pack(C, dy, x, dx)
    _kernel("bn_backward_dx", dy.dtype, pack=V)(
        *_row_blocks(M, C, V, ROW_BLOCKS),
        (dy, x, mean, coef, scale, beta, np.int32(relu is not None), np.int64(M),
         np.int32(C), dx))
    return dx


# ----- the ReLU's gradient -----

def relu_grad(dy, y):
    """dy where y > 0, else 0, a new array: one pass (dy and y C-contiguous)."""
    import cupy
    dx = cupy.empty_like(dy)
    V = _pack(dy.size, dy, y, dx)
    _kernel("relu_grad", dy.dtype, pack=V)(_blocks(dy.size // V), (THREADS,),
                                           (dy, y, np.int64(dy.size), dx))
    return dx


# ----- pooling -----

def _pool_args(x_shape, y_shape, k, stride, pad):
    N, H, W, C = x_shape
    return tuple(np.int32(v) for v in (N, H, W, C, y_shape[1], y_shape[2], k, stride, pad))


def pool_forward(x, y_shape, k, stride, pad, avg):
    """Max pooling (avg False): (y, argmax), both y_shape (N, Ho, Wo, C), the window maxima
    and each one's place i*k + j in its window (uint8, so k is at most 16: a quarter of the
    bytes of an int32 index into the plane; the first maximum in row-major window order, a
    NaN above every number). Average pooling (avg True): y = window sums (padding as zeros)
    / k^2, summed in acc_dtype. One thread per output pixel and Pack of channels."""
    import cupy
    if not avg and k > MAX_POOL_WINDOW:
        raise ValueError(f"max pooling on a GPU takes windows up to {MAX_POOL_WINDOW}x"
                         f"{MAX_POOL_WINDOW} (a maximum's place is one byte), not {k}x{k}")
    x = cupy.ascontiguousarray(x)
    y = cupy.empty(y_shape, x.dtype)
    arg = None if avg else cupy.empty(y_shape, np.uint8)
    V = _pack(x.shape[3], x)
    _kernel("pool_forward", x.dtype, pack=V)(
        _blocks(y.size // V), (THREADS,),
        (x, np.int32(avg), *_pool_args(x.shape, y_shape, k, stride, pad), y,
         y if avg else arg))                                  # arg unwritten when avg
    return y if avg else (y, arg)


def pool_backward(dy, argmax, x_shape, k, stride, pad):
    """dx (x_shape): for max pooling (argmax given, as pool_forward's) the sum of dy over
    the windows whose maximum is that pixel; for average pooling (argmax None) the sum of
    dy / k^2 over the windows that cover it. One thread per input pixel and Pack of
    channels (no atomics)."""
    import cupy
    dy = cupy.ascontiguousarray(dy)
    dx = cupy.empty(x_shape, dy.dtype)
    avg = argmax is None
    arg = dy if avg else cupy.ascontiguousarray(argmax, dtype=np.uint8)   # unread when avg
    V = _pack(dy.shape[3], dy, arg)
    _kernel("pool_backward", dy.dtype, pack=V)(
        _blocks(dx.size // V), (THREADS,),
        (dy, arg, np.int32(avg), *_pool_args(x_shape, dy.shape, k, stride, pad), dx))
    return dx


# ----- elementwise -----

def add_into(a, b):
    """a += b in place (a and b of one shape and dtype, C-contiguous), each sum computed in
    acc_dtype and rounded once, as the CPU's pass; returns a."""
    V = _pack(a.size, a, b)
    _kernel("add_into", a.dtype, pack=V)(_blocks(a.size // V), (THREADS,),
                                         (a, b, np.int64(a.size)))
    return a


def relu(x):
    """max(x, 0), a new array (NaN stays NaN)."""
    import cupy
    y = cupy.empty_like(x)
    V = _pack(x.size, x, y)
    _kernel("relu", x.dtype, pack=V)(_blocks(x.size // V), (THREADS,), (x, np.int64(x.size), y))
    return y


# ----- dropout -----

def dropout_threshold(p):
    """The 24-bit threshold t of drop probability p: keep where (word >> 8) >= t, which
    happens with probability 1 - t / 2^24 (t = ceil(p 2^24), so p itself when p 2^24
    is an integer)."""
    return math.ceil(p * (1 << 24))


def key_words(key):
    """The 64-bit key as the (2,) uint32 words that `dropout` reads: (key mod 2^32, key >> 32)."""
    key = int(key)
    return np.array([key & 0xFFFFFFFF, key >> 32], np.uint32)


def dropout(x, key, p):
    """x * keep / (1 - p) (1 / (1 - p) rounded to x's dtype, as on the CPU), keep drawn by
    Philox4x32-10 from the 64-bit key k0 + 2^32 k1 and each element's index
    (dropout_keep); key: the device array (k0, k1) uint32 (key_words), read when the
    kernel runs. The same call with the same key is the backward."""
    import cupy
    x = cupy.ascontiguousarray(x)
    y = cupy.empty_like(x)
    acc = acc_dtype(x.dtype)
    scale = acc.type(x.dtype.type(1 / (1 - p)))
    blocks = _blocks(-(-x.size // 4))
    _kernel("dropout", x.dtype)(blocks, (THREADS,),
                                (x, np.int64(x.size), key, np.uint32(dropout_threshold(p)),
                                 scale, y))
    return y


_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85


def philox4x32(counter, key):
    """NumPy Philox4x32-10: counter (n, 4) uint32, key (2,) uint32 -> (n, 4) uint32 words."""
    c = [np.asarray(counter, np.uint32)[:, j].astype(np.uint64) for j in range(4)]
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    mask = np.uint64(0xFFFFFFFF)
    for r in range(10):
        if r:
            k0, k1 = (k0 + np.uint64(_W0)) & mask, (k1 + np.uint64(_W1)) & mask
        p0, p1 = np.uint64(_M0) * c[0], np.uint64(_M1) * c[2]       # exact 64-bit products
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c[3] ^ k1,
             p0 & mask]
    return np.stack(c, axis=1).astype(np.uint32)


def dropout_keep(key, n, p):
    """The keep mask (n,) bool that `dropout` draws from the 64-bit key: element i keeps
    when word i mod 4 of philox4x32((i // 4, i // 4 >> 32, 0, 0), key) >> 8 >= threshold."""
    blocks = np.arange(-(-n // 4), dtype=np.uint64)
    counter = np.zeros((blocks.size, 4), np.uint32)
    counter[:, 0] = blocks & np.uint64(0xFFFFFFFF)
    counter[:, 1] = blocks >> np.uint64(32)
    words = philox4x32(counter, (key & 0xFFFFFFFF, key >> 32)).reshape(-1)[:n]
    return (words >> 8) >= dropout_threshold(p)
