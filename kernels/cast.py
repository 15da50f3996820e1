"""fp32 <-> fp16 casts over flat arrays, and the scalar conversions the other kernels use.

    to_half:  dst_i = fp16(fp32(src_i * scale))   an fp32 multiply by fp32(scale), rounded
                                                  to nearest, then IEEE round to nearest,
                                                  ties to even; beyond the fp16 range ->
                                                  +-inf; NaN stays NaN
    to_float: dst_i = fp32(src_i)                 exact

With scale 1.0 (the default) to_half is NumPy's astype; with another scale it is
NumPy's `(src * np.float32(scale)).astype(np.float16)`: two roundings, the
product to fp32, then to fp16. The communication code sends scaled fp16
gradients this way without a separate pass over the buffer. Bit for bit, the
one difference from NumPy is a signalling NaN: it comes out as the same NaN,
quiet, as IEEE 754 conversions do (NumPy's own fp16 conversions keep it
signalling); arithmetic never makes one.

Numba's CPU target has no float16 type, so the CPU kernels see fp16 arrays as
uint16 bit patterns and convert with LLVM's own fptrunc/fpext to `half`
(`float_to_half_bits`, `half_bits_to_float`, exported for use inside other
njit kernels, and `load` / `store`, which read and write an element of any
float array, float16 bits included, so that one kernel body serves every
dtype): on x86 with F16C (nearly every x86-64 CPU in use) and on
ARMv8 these become the hardware conversion instructions, eight values at a
time. The CUDA kernels store into fp16 arrays directly (cvt.rn.f16.f32, the
same rounding).

The CPU casts run on Numba's thread pool (parallel=True; arrays under 64 KiB on
the calling thread, kernels/team.py), or with parallel=False on the calling
thread alone: the same loop compiled without threads (`njit(nogil=True)`), for
callers in a background thread (with some threading layers Numba's parallel
regions must not be entered from two threads at once).
"""
import numpy as np
from llvmlite import ir
from numba import cuda, njit, prange, types
from numba.extending import intrinsic, overload

from mpitrain.backend import array_module

from . import team
from .segments import cuda_shape, launch, pick

__all__ = ["to_half", "to_float", "astype", "float_to_half_bits", "half_bits_to_float", "bits",
           "load", "store", "rounded", "ZERO", "refresh_working"]


@intrinsic
def float_to_half_bits(typingctx, x):
    """fp32 -> the uint16 bits of the nearest fp16 (ties to even)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@intrinsic
def half_bits_to_float(typingctx, h):
    """The uint16 bits of an fp16 -> that value as fp32 (exact)."""
    if h != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


def bits(a):
    """A NumPy array as the CPU kernels take it: float16 as its uint16 bits (a view)."""
    return a.view(np.uint16) if a.dtype == np.float16 else a


def load(a, i):
    """a[i] as a number to compute with: float16 bits (uint16) widened to float32 exactly,
    any float as it is. For Numba kernels (the overloads below)."""
    return a[i]


def store(a, i, v):
    """a[i] = v, rounding to the nearest float16 (ties to even) where a holds float16 bits."""
    a[i] = v


@overload(load)
def _load(a, i):
    if a.dtype == types.uint16:
        return lambda a, i: half_bits_to_float(a[i])
    return lambda a, i: a[i]


@overload(store)
def _store_element(a, i, v):
    if a.dtype == types.uint16:
        def store_half(a, i, v):
            a[i] = float_to_half_bits(np.float32(v))
        return store_half

    def store_as_is(a, i, v):
        a[i] = v
    return store_as_is


# The kernels' zero in `max(v, ZERO)` and `v if ... else ZERO`: a float32, so that it keeps
# float32 arithmetic float32 (and float64 float64). Python's 0.0 is a float64, and Numba
# would widen the whole expression, and the loop's vectors, to it.
ZERO = np.float32(0)


def rounded(a, v):
    """v as a's elements would hold it: rounded to float16 where a holds float16 bits,
    cast to a's dtype otherwise (what store(a, i, v) then load(a, i) would give)."""
    return a.dtype.type(v)


@overload(rounded)
def _rounded(a, v):
    if a.dtype == types.uint16:
        return lambda a, v: half_bits_to_float(float_to_half_bits(np.float32(v)))
    dtype = a.dtype
    return lambda a, v: dtype(v)


def refresh_working(master, working, segments=None):
    """working = cast(master) after an update that did not write it; the fp16 copy is cast
    from the fp32-rounded master, as the fused kernels do. Nothing when working is master.

    With a segment table, only the parameters' elements are written (one slice per
    segment), never the padding between them. Without one the whole array is copied,
    padding included: the arena's padding is zero in master and in working, so that
    writes zeros over zeros."""
    if working is master:
        return
    if segments is None:
        _store(working, master)
        return
    for offset, size in zip(segments["offset"].tolist(), segments["size"].tolist()):
        _store(working[offset:offset + size], master[offset:offset + size])


def _store(dst, src):
    """dst = cast(src) for flat arrays; into fp16 through fp32 and to_half (NumPy's own
    cast is a scalar loop)."""
    if dst.dtype == np.float16:
        to_half(src.astype(np.float32, copy=False), dst)
    else:
        dst[...] = src


def _check(src, dst, src_dtype, dst_dtype):
    if src.dtype != src_dtype or src.ndim != 1:
        raise TypeError(f"expected a flat {np.dtype(src_dtype)} array, got {src.dtype} {src.shape}")
    if dst is None:
        dst = array_module(src).empty(src.shape, dst_dtype)
    if dst.dtype != dst_dtype or dst.shape != src.shape:
        raise TypeError(f"dst must be {np.dtype(dst_dtype)} of shape {src.shape}, "
                        f"got {dst.dtype} {dst.shape}")
    return dst


def to_half(src, dst=None, impl=None, scale=1.0, parallel=True):
    """fp16 copy of the flat fp32 array src times scale (into dst if given); returns dst.

    parallel=False: the numba version runs on the calling thread only (see the module
    docstring); the other versions ignore it."""
    dst = _check(src, dst, np.float32, np.float16)
    _TO_HALF[pick(impl, src)](src, dst, np.float32(scale), parallel)
    return dst


def to_float(src, dst=None, impl=None, parallel=True):
    """fp32 copy of the flat fp16 array src (into dst if given); returns dst.

    parallel: as for to_half."""
    dst = _check(src, dst, np.float16, np.float32)
    _TO_FLOAT[pick(impl, src)](src, dst, parallel)
    return dst


def astype(a, dtype):
    """`a` in `dtype` (a itself when it has it): between float32 and float16 through the
    kernels above on NumPy arrays of any shape (NumPy's own casts between them are scalar
    loops, many times slower), through the array's own astype otherwise. The result keeps
    a's memory order where a is C- or Fortran-contiguous (a transposed view stays one)."""
    dtype = np.dtype(dtype)
    if a.dtype == dtype:
        return a
    pair = (a.dtype, dtype)
    if array_module(a) is not np or pair not in ((np.float32, np.float16),
                                                 (np.float16, np.float32)):
        return a.astype(dtype)
    if not a.flags.c_contiguous and a.flags.f_contiguous:
        return astype(a.T, dtype).T
    src = np.ascontiguousarray(a).reshape(-1)
    out = (to_half if dtype == np.float16 else to_float)(src)
    return out.reshape(a.shape)


def to_half_numpy(src, dst, scale, parallel=True):
    """Reference: dst = fp16(fp32(src * fp32(scale))), round to nearest even (NumPy's casts)."""
    dst[...] = src if scale == 1 else src * scale


def to_float_numpy(src, dst, parallel=True):
    """Reference: dst = fp32(src), exact."""
    dst[...] = src


def _to_half_loop(src, dst_bits, scale):
    """dst_bits_i = the fp16 bits of fp32(src_i * scale)."""
    for i in prange(src.size):
        dst_bits[i] = float_to_half_bits(src[i] * scale)


def _to_float_loop(src_bits, dst):
    """dst_i = fp32 of the fp16 with bits src_bits_i (exact)."""
    for i in prange(dst.size):
        dst[i] = half_bits_to_float(src_bits[i])


# Each loop compiled twice: for the thread pool, and for the calling thread alone (prange
# is range there)
_to_half_cpu = {True: team.by_size(njit(parallel=True, cache=True)(_to_half_loop)),
                False: team.serial(_to_half_loop)}
_to_float_cpu = {True: team.by_size(njit(parallel=True, cache=True)(_to_float_loop)),
                 False: team.serial(_to_float_loop)}


def to_half_numba(src, dst, scale, parallel=True):
    """Numba CPU version of to_half_numpy."""
    _to_half_cpu[bool(parallel)](src, dst.view(np.uint16), scale)


def to_float_numba(src, dst, parallel=True):
    """Numba CPU version of to_float_numpy."""
    _to_float_cpu[bool(parallel)](src.view(np.uint16), dst)


@cuda.jit
def _copy_cast_cuda(src, dst):
    """dst_i = src_i in dst's dtype (grid-stride loop)."""
    for i in range(cuda.grid(1), src.size, cuda.gridsize(1)):
        dst[i] = src[i]


@cuda.jit
def _scale_cast_cuda(src, dst, scale):
    """dst_i = src_i * scale, rounded to src's dtype, then to dst's (grid-stride loop)."""
    for i in range(cuda.grid(1), src.size, cuda.gridsize(1)):
        dst[i] = src[i] * scale


def _grid(n):
    threads, _ = cuda_shape()
    return min((n + threads - 1) // threads, 4096), threads


def to_half_cuda(src, dst, scale, parallel=True):
    """Numba CUDA version of to_half_numpy (grid-stride loop: an fp32 multiply, then
    cvt.rn.f16.f32)."""
    if src.size:
        launch(_scale_cast_cuda, *_grid(src.size), src, dst, scale)


def to_float_cuda(src, dst, parallel=True):
    """Numba CUDA version of to_float_numpy (grid-stride loop)."""
    if src.size:
        launch(_copy_cast_cuda, *_grid(src.size), src, dst)


_TO_HALF = {"numpy": to_half_numpy, "numba": to_half_numba, "cuda": to_half_cuda}
_TO_FLOAT = {"numpy": to_float_numpy, "numba": to_float_numba, "cuda": to_float_cuda}
