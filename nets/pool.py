"""Pooling layers on NHWC activations (formulas in each class; kernels in mpitrain.kernels.pool)."""
import numpy as np

from mpitrain.backend import array_module
from mpitrain.kernels import pool

from .module import Module


class MaxPool2d(Module):
    """y[n, oh, ow, c] = max of x over the k x k window at (oh*s - p, ow*s - p), padding -inf.

    backward: dy[n, oh, ow, c] flows to the window's (first) maximum; the rest get 0.
    stride defaults to kernel_size, as in PyTorch.
    """

    def __init__(self, kernel_size, stride=None, padding=0):
        self.k, self.stride, self.padding = kernel_size, stride or kernel_size, padding

    def forward(self, x, train=True):
        y, argmax = pool.max_pool_forward(x, self.k, self.stride, self.padding)
        if train:
            self.x_shape = x.shape
            self.argmax = argmax        # (N, Ho, Wo, C): where each maximum is (kernels/pool.py)
        return y

    def backward(self, dy):
        dx = pool.max_pool_backward(dy, self.argmax, self.x_shape, self.k, self.stride,
                                    self.padding)
        self.argmax = None
        return dx


class AvgPool2d(Module):
    """y[n, oh, ow, c] = (sum of x over the k x k window, padding as zeros) / k^2.

    backward: dx[n, ih, iw, c] = sum of dy / k^2 over the windows covering (ih, iw).
    (count_include_pad=True, PyTorch's default; stride defaults to kernel_size.)
    """

    def __init__(self, kernel_size, stride=None, padding=0):
        self.k, self.stride, self.padding = kernel_size, stride or kernel_size, padding

    def forward(self, x, train=True):
        self.x_shape = x.shape
        return pool.avg_pool_forward(x, self.k, self.stride, self.padding)

    def backward(self, dy):
        return pool.avg_pool_backward(dy, self.x_shape, self.k, self.stride, self.padding)


def _sum_dtype(dtype):
    """The dtype the averaging pools sum in: fp32 for fp16, so each output is rounded once."""
    return np.float32 if dtype == np.float16 else dtype


def adaptive_bins(n_in, n_out, xp=np, dtype=np.float64):
    """A (n_out, n_in): row o averages x[start:end], start = floor(o*In/Out),
    end = ceil((o+1)*In/Out).

    PyTorch's adaptive bins; they overlap when In is not a multiple of Out, and
    repeat inputs when Out > In.
    """
    A = np.zeros((n_out, n_in))
    for o in range(n_out):
        start, end = (o * n_in) // n_out, -(-((o + 1) * n_in) // n_out)
        A[o, start:end] = 1.0 / (end - start)
    return xp.asarray(A, dtype=dtype)


class AdaptiveAvgPool2d(Module):
    """y[n, oh, ow, c] = mean of x over rows bin(oh) and columns bin(ow) (PyTorch's adaptive bins).

    Written as y = A_h x A_w^T on each (n, c) plane with the bin matrices A of
    `adaptive_bins`; backward is dx = A_h^T dy A_w. When the input already has
    the output size every bin is one pixel and the layer is the identity. fp16 is
    averaged in fp32 and rounded once, as PyTorch's fp16 pooling does.
    """

    def __init__(self, output_size):
        self.output_size = ((output_size, output_size) if np.isscalar(output_size)
                            else tuple(output_size))

    def forward(self, x, train=True):
        N, H, W, C = x.shape
        self.identity = (H, W) == self.output_size
        if self.identity:
            return x
        xp = array_module(x)
        Oh, Ow = self.output_size
        wide = _sum_dtype(x.dtype)
        self.ah = adaptive_bins(H, Oh, xp, wide)          # (Oh, H)
        self.aw = adaptive_bins(W, Ow, xp, wide)          # (Ow, W)
        rows = xp.einsum("oh,nhwc->nowc", self.ah, x.astype(wide, copy=False))
        y = xp.einsum("pw,nowc->nopc", self.aw, rows)
        return y.astype(x.dtype, copy=False)

    def backward(self, dy):
        if self.identity:
            return dy
        xp = array_module(dy)
        cols = xp.einsum("pw,nopc->nowc", self.aw, dy.astype(self.ah.dtype, copy=False))
        dx = xp.einsum("oh,nowc->nhwc", self.ah, cols)
        return dx.astype(dy.dtype, copy=False)


class GlobalAvgPool2d(Module):
    """(N, H, W, C) -> (N, C): y[n, c] = mean over h, w of x[n, h, w, c]; dx = dy[n, c] / (H*W)
    everywhere."""

    def forward(self, x, train=True):
        self.x_shape = x.shape
        return x.mean(axis=(1, 2), dtype=_sum_dtype(x.dtype)).astype(x.dtype, copy=False)

    def backward(self, dy):
        xp = array_module(dy)
        N, H, W, C = self.x_shape
        dx = xp.empty(self.x_shape, dy.dtype)
        dx[...] = (dy / (H * W)).reshape(N, 1, 1, C)
        return dx
