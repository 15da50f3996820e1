"""fp32 <-> fp16 casts over flat arrays, and the scalar conversions the other kernels use.

    to_half:  dst_i = fp16(src_i)   IEEE round to nearest, ties to even; beyond the
                                    fp16 range -> +-inf; NaN stays NaN
    to_float: dst_i = fp32(src_i)   exact

These are what NumPy's astype does. Numba's CPU target has no float16 type, so
the CPU kernels see fp16 arrays as uint16 bit patterns and convert with LLVM's
own fptrunc/fpext to `half` (`float_to_half_bits`, `half_bits_to_float`): on
x86 with F16C (every x86-64 CPU since about 2012) and on ARMv8 these become the
hardware conversion instructions, eight values at a time. The CUDA kernels
store into fp16 arrays directly (cvt.rn.f16.f32, the same rounding).
"""
import numpy as np
from llvmlite import ir
from numba import cuda, njit, prange, types
from numba.extending import intrinsic

from mpitrain.backend import array_module

from .segments import cuda_shape, pick


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


def refresh_working(master, working):
    """working = cast(master) after an update that did not write it; the fp16 copy is cast
    from the fp32-rounded master, as the fused kernels do. Nothing when working is master."""
    if working is not master:
        working[...] = master.astype(np.float32, copy=False) if working.dtype == np.float16 \
            else master


def _check(src, dst, src_dtype, dst_dtype):
    if src.dtype != src_dtype or src.ndim != 1:
        raise TypeError(f"expected a flat {np.dtype(src_dtype)} array, got {src.dtype} {src.shape}")
    if dst is None:
        dst = array_module(src).empty(src.shape, dst_dtype)
    if dst.dtype != dst_dtype or dst.shape != src.shape:
        raise TypeError(f"dst must be {np.dtype(dst_dtype)} of shape {src.shape}, "
                        f"got {dst.dtype} {dst.shape}")
    return dst


def to_half(src, dst=None, impl=None):
    """fp16 copy of the flat fp32 array src (into dst if given); returns dst."""
    dst = _check(src, dst, np.float32, np.float16)
    _TO_HALF[pick(impl, src)](src, dst)
    return dst


def to_float(src, dst=None, impl=None):
    """fp32 copy of the flat fp16 array src (into dst if given); returns dst."""
    dst = _check(src, dst, np.float16, np.float32)
    _TO_FLOAT[pick(impl, src)](src, dst)
    return dst


def to_half_numpy(src, dst):
    """Reference: dst = fp16(src), round to nearest even (NumPy's cast)."""
    dst[...] = src


def to_float_numpy(src, dst):
    """Reference: dst = fp32(src), exact."""
    dst[...] = src


@njit(parallel=True, cache=True)
def _to_half_cpu(src, dst_bits):
    for i in prange(src.size):
        dst_bits[i] = float_to_half_bits(src[i])


@njit(parallel=True, cache=True)
def _to_float_cpu(src_bits, dst):
    for i in prange(dst.size):
        dst[i] = half_bits_to_float(src_bits[i])


def to_half_numba(src, dst):
    """Numba CPU version of to_half_numpy."""
    _to_half_cpu(src, dst.view(np.uint16))


def to_float_numba(src, dst):
    """Numba CPU version of to_float_numpy."""
    _to_float_cpu(src.view(np.uint16), dst)


@cuda.jit
def _copy_cast_cuda(src, dst):
    for i in range(cuda.grid(1), src.size, cuda.gridsize(1)):
        dst[i] = src[i]


def _copy_cast(src, dst):
    threads, _ = cuda_shape()
    if src.size:
        blocks = min((src.size + threads - 1) // threads, 4096)
        _copy_cast_cuda[blocks, threads](src, dst)


def to_half_cuda(src, dst):
    """Numba CUDA version of to_half_numpy (grid-stride loop, cvt.rn.f16.f32)."""
    _copy_cast(src, dst)


def to_float_cuda(src, dst):
    """Numba CUDA version of to_float_numpy (grid-stride loop)."""
    _copy_cast(src, dst)


_TO_HALF = {"numpy": to_half_numpy, "numba": to_half_numba, "cuda": to_half_cuda}
_TO_FLOAT = {"numpy": to_float_numpy, "numba": to_float_numba, "cuda": to_float_cuda}
