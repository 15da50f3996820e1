"""im2col and col2im for NHWC tensors: the Cython kernels on NumPy, a generic version elsewhere.

With Ho = (H + 2p - kh) // s + 1 and Wo likewise,

    im2col(x)[(n*Ho + oh)*Wo + ow, (i*kw + j)*C + c] = x[n, oh*s - p + i, ow*s - p + j, c]

(zero where the index falls in the padding), so a convolution with OHWI weights
W is `im2col(x) @ W.reshape(O, kh*kw*C).T`. col2im is its adjoint: it sums each
column entry back onto the input pixel it came from, which makes
`col2im(dy @ W.reshape(O, -1))` the input gradient of that convolution.

The generic version is kh*kw strided slices of the zero-padded input; it runs on
CuPy and is the reference the Cython kernels are tested against.
"""
import numpy as np

from mpitrain.backend import array_module

from . import _im2col, cast, elementwise


class WindowTooWide(ValueError):
    """A sliding window wider than its padded input: a network's feature maps shrank to
    nothing before that layer (checks.check_image_size names the image size)."""


def conv_output_size(size, k, stride, pad):
    """Output length of a k-wide window sliding with `stride` over `size` + 2*pad elements."""
    out = (size + 2 * pad - k) // stride + 1
    if out < 1:
        raise WindowTooWide(f"a {k}-wide window with padding {pad} does not fit an input of "
                            f"size {size}")
    return out


def im2col(x, kh, kw, stride=1, pad=0, out=None):
    """(N, H, W, C) -> (N*Ho*Wo, kh*kw*C) columns ordered (i, j, c).

    out: an optional C-contiguous buffer of that shape and x's dtype to fill
    (a layer reuses it between steps); otherwise one is allocated.
    """
    N, H, W, C = x.shape
    Ho, Wo = conv_output_size(H, kh, stride, pad), conv_output_size(W, kw, stride, pad)
    if not isinstance(x, np.ndarray):
        return im2col_generic(x, kh, kw, stride, pad, out)
    if out is None:
        out = np.empty((N * Ho * Wo, kh * kw * C), x.dtype)
    return _im2col.im2col(np.ascontiguousarray(x), kh, kw, stride, pad, out)


def col2im(col, x_shape, kh, kw, stride=1, pad=0, add_to=None):
    """The adjoint of im2col: (N*Ho*Wo, kh*kw*C) -> a new (N, H, W, C) array of col's dtype;
    with add_to (an array of that shape and dtype) added into add_to, which it returns.
    A float32 or float64 add_to on the CPU is the kernel's own sum, which starts from it
    (no pass of its own)."""
    if not isinstance(col, np.ndarray):
        dx = col2im_generic(col, x_shape, kh, kw, stride, pad)
        return dx if add_to is None else elementwise.add_into(add_to, dx)
    # the kernel sums in float32 or float64; float16 gradients are summed in float32
    work = np.float32 if col.dtype == np.float16 else col.dtype
    into = add_to is not None and add_to.dtype == col.dtype == work and add_to.flags.c_contiguous
    dx = add_to if into else np.empty(x_shape, work)
    _im2col.col2im(np.ascontiguousarray(cast.astype(col, work)), kh, kw, stride, pad, dx,
                   not into)
    dx = cast.astype(dx, col.dtype)
    return dx if into or add_to is None else elementwise.add_into(add_to, dx)


def _window(start, count, stride):
    """The slice start, start + stride, ..., taking `count` elements."""
    return slice(start, start + stride * (count - 1) + 1, stride)


def im2col_generic(x, kh, kw, stride=1, pad=0, out=None):
    """im2col on any array module, from kh*kw strided slices of the zero-padded input."""
    xp = array_module(x)
    N, H, W, C = x.shape
    Ho, Wo = conv_output_size(H, kh, stride, pad), conv_output_size(W, kw, stride, pad)
    if pad:
        x = xp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    if out is None:
        out = xp.empty((N * Ho * Wo, kh * kw * C), x.dtype)
    col = out.reshape(N, Ho, Wo, kh, kw, C)
    for i in range(kh):
        for j in range(kw):
            col[:, :, :, i, j, :] = x[:, _window(i, Ho, stride), _window(j, Wo, stride), :]
    return out


def col2im_generic(col, x_shape, kh, kw, stride=1, pad=0):
    """col2im on any array module: each tap (i, j) adds its columns onto a strided slice."""
    xp = array_module(col)
    N, H, W, C = x_shape
    Ho, Wo = conv_output_size(H, kh, stride, pad), conv_output_size(W, kw, stride, pad)
    dx = xp.zeros((N, H + 2 * pad, W + 2 * pad, C), col.dtype)
    col = col.reshape(N, Ho, Wo, kh, kw, C)
    for i in range(kh):
        for j in range(kw):
            dx[:, _window(i, Ho, stride), _window(j, Wo, stride), :] += col[:, :, :, i, j, :]
    return xp.ascontiguousarray(dx[:, pad:pad + H, pad:pad + W, :])
