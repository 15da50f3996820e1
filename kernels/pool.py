"""NHWC max and average pooling: the Cython kernels on NumPy, a generic version elsewhere.

Square window k, stride s, padding p; Ho = (H + 2p - k) // s + 1 (PyTorch's
ceil_mode=False). The window of output (oh, ow) covers input rows
oh*s - p + [0, k) and columns ow*s - p + [0, k).

    max:  y = max over the window, padding -inf; argmax = ih*W + iw (int32) of the
          first maximum in row-major window order, a NaN above every number (the
          first NaN, as NumPy's argmax). Backward: dx[n, ih, iw, c]
          = sum of dy[n, oh, ow, c] over the outputs whose argmax is (ih, iw).
    avg:  y = sum over the window / k^2, padding counted as zeros
          (count_include_pad=True, PyTorch's default). Backward: every input
          pixel receives dy / k^2 from each window that covers it.

PyTorch's rule p <= k // 2 is enforced, so no window lies wholly in the padding.
float16 runs through float32 on the CPU (exact for max). On CuPy arrays the fused
kernels of mpitrain.kernels.gpu run (one thread per output, or per input pixel
in backward; sums in fp32), their argmax the maximum's place i*k + j in its window
as a uint8 (a quarter of the bytes); the generic versions below are their reference.
"""
import numpy as np

from mpitrain.backend import array_module

from .im2col import _window, conv_output_size
from . import _pool, cast, gpu


def _geometry(x_shape, k, stride, pad):
    if pad > k // 2:
        raise ValueError(f"padding {pad} must be at most half the kernel size {k}")
    N, H, W, C = x_shape
    return N, conv_output_size(H, k, stride, pad), conv_output_size(W, k, stride, pad), C


def _work_dtype(dtype):
    return np.float32 if dtype == np.float16 else dtype


def max_pool_forward(x, k, stride, pad=0):
    """-> (y, argmax), both (N, Ho, Wo, C); argmax is int32, an index ih*W + iw into x's plane
    (on a GPU, kernels.gpu's uint8 place in the window: max_pool_backward takes either)."""
    N, Ho, Wo, C = _geometry(x.shape, k, stride, pad)
    if not isinstance(x, np.ndarray):
        if gpu.handles(x):
            return gpu.pool_forward(x, (N, Ho, Wo, C), k, stride, pad, avg=False)
        return max_pool_forward_generic(x, k, stride, pad)
    xw = np.ascontiguousarray(cast.astype(x, _work_dtype(x.dtype)))
    y = np.empty((N, Ho, Wo, C), xw.dtype)
    argmax = np.empty((N, Ho, Wo, C), np.int32)
    _pool.max_pool_forward(xw, k, stride, pad, y, argmax)
    return cast.astype(y, x.dtype), argmax


def max_pool_backward(dy, argmax, x_shape, k, stride, pad=0):
    """dx (N, H, W, C): each dy element added at its argmax."""
    _geometry(x_shape, k, stride, pad)
    if not isinstance(dy, np.ndarray):
        if gpu.handles(dy):
            return gpu.pool_backward(dy, argmax, x_shape, k, stride, pad)
        return max_pool_backward_generic(dy, argmax, x_shape, k, stride, pad)
    dyw = np.ascontiguousarray(cast.astype(dy, _work_dtype(dy.dtype)))
    dx = np.zeros(x_shape, dyw.dtype)
    _pool.max_pool_backward(dyw, np.ascontiguousarray(argmax, dtype=np.int32), dx)
    return cast.astype(dx, dy.dtype)


def avg_pool_forward(x, k, stride, pad=0):
    """y (N, Ho, Wo, C) = window sums / k^2."""
    N, Ho, Wo, C = _geometry(x.shape, k, stride, pad)
    if not isinstance(x, np.ndarray):
        if gpu.handles(x):
            return gpu.pool_forward(x, (N, Ho, Wo, C), k, stride, pad, avg=True)
        return avg_pool_forward_generic(x, k, stride, pad)
    xw = np.ascontiguousarray(cast.astype(x, _work_dtype(x.dtype)))
    y = np.empty((N, Ho, Wo, C), xw.dtype)
    _pool.avg_pool_forward(xw, k, stride, pad, y)
    return cast.astype(y, x.dtype)


def avg_pool_backward(dy, x_shape, k, stride, pad=0):
    """dx (N, H, W, C) = the adjoint of avg_pool_forward applied to dy."""
    _geometry(x_shape, k, stride, pad)
    if not isinstance(dy, np.ndarray):
        if gpu.handles(dy):
            return gpu.pool_backward(dy, None, x_shape, k, stride, pad)
        return avg_pool_backward_generic(dy, x_shape, k, stride, pad)
    dyw = np.ascontiguousarray(cast.astype(dy, _work_dtype(dy.dtype)))
    dx = np.zeros(x_shape, dyw.dtype)
    _pool.avg_pool_backward(dyw, k, stride, pad, dx)
    return cast.astype(dx, dy.dtype)


# ----- generic versions (CuPy, and the reference for the Cython kernels) -----
def _taps(x, k, stride, Ho, Wo):
    """The k*k strided views x[:, i + s*oh, j + s*ow, :] of an already padded x, tap order
    (i, j)."""
    return [x[:, _window(i, Ho, stride), _window(j, Wo, stride), :]
            for i in range(k) for j in range(k)]


def max_pool_forward_generic(x, k, stride, pad=0):
    xp = array_module(x)
    N, Ho, Wo, C = _geometry(x.shape, k, stride, pad)
    W = x.shape[2]
    H = x.shape[1]
    xpad = xp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)), constant_values=-np.inf)
    taps = xp.stack(_taps(xpad, k, stride, Ho, Wo))      # (k*k, N, Ho, Wo, C)
    y = taps.max(axis=0)
    t = xp.arange(k * k).reshape(-1, 1, 1, 1, 1)
    row = xp.arange(Ho).reshape(1, 1, Ho, 1, 1) * stride - pad + t // k
    col = xp.arange(Wo).reshape(1, 1, 1, Wo, 1) * stride - pad + t % k
    inside = (row >= 0) & (row < H) & (col >= 0) & (col < W)    # (k*k, 1, Ho, Wo, 1)
    # the first tap inside the image that is the maximum or NaN: a window of -inf keeps
    # its argmax off the padding, as the kernels do
    tap = (((taps == y) | xp.isnan(taps)) & inside).argmax(axis=0)
    ih = xp.arange(Ho).reshape(1, Ho, 1, 1) * stride - pad + tap // k
    iw = xp.arange(Wo).reshape(1, 1, Wo, 1) * stride - pad + tap % k
    return y, (ih * W + iw).astype(np.int32)


def max_pool_backward_generic(dy, argmax, x_shape, k, stride, pad=0):
    xp = array_module(dy)
    N, Ho, Wo, C = _geometry(x_shape, k, stride, pad)
    H, W = x_shape[1], x_shape[2]
    # back from the input index to the tap (i, j) of each window, then one masked add per tap
    i = argmax // W - (xp.arange(Ho).reshape(1, Ho, 1, 1) * stride - pad)
    j = argmax % W - (xp.arange(Wo).reshape(1, 1, Wo, 1) * stride - pad)
    tap = i * k + j
    dx = xp.zeros((N, H + 2 * pad, W + 2 * pad, C), dy.dtype)
    for t, view in enumerate(_taps(dx, k, stride, Ho, Wo)):
        view += xp.where(tap == t, dy, 0)
    return xp.ascontiguousarray(dx[:, pad:pad + H, pad:pad + W, :])


def avg_pool_forward_generic(x, k, stride, pad=0):
    xp = array_module(x)
    N, Ho, Wo, C = _geometry(x.shape, k, stride, pad)
    xpad = xp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    y = xp.zeros((N, Ho, Wo, C), x.dtype)
    for view in _taps(xpad, k, stride, Ho, Wo):
        y += view
    return y / (k * k)


def avg_pool_backward_generic(dy, x_shape, k, stride, pad=0):
    xp = array_module(dy)
    N, Ho, Wo, C = _geometry(x_shape, k, stride, pad)
    H, W = x_shape[1], x_shape[2]
    dx = xp.zeros((N, H + 2 * pad, W + 2 * pad, C), dy.dtype)
    share = dy / (k * k)
    for view in _taps(dx, k, stride, Ho, Wo):
        view += share
    return xp.ascontiguousarray(dx[:, pad:pad + H, pad:pad + W, :])
