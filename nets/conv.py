"""2-D convolution on NHWC activations with OHWI weights.

With k x k kernels, stride s, zero padding p, Ho = (H + 2p - k) // s + 1:

    forward   y[n, oh, ow, o] = b[o] + sum_{i, j, c} W[o, i, j, c]
                                       * x[n, oh*s - p + i, ow*s - p + j, c]
              as a GEMM: y = col @ W.reshape(O, k*k*C).T, col = im2col(x)  (N*Ho*Wo, k*k*C)
    backward  dW = dy^T @ col,  db = sum over rows of dy,  dx = col2im(dy @ W.reshape(O, k*k*C))

where dy is reshaped to (N*Ho*Wo, O). A 1x1 convolution without padding and
stride needs no im2col: col is x itself, reshaped to (-1, C) (strided, im2col copies
x[:, ::s, ::s], and col2im scatters dx back). A residual block's first convolution
adds dx into the shortcut's gradient (backward's add_to): on the CPU inside the GEMM,
as its beta = 1, or inside col2im's sums, so that the block's add is no pass of its own.
On a GPU with the cuDNN frontend, forward and both gradients go to cuDNN instead;
dW lands in the fp32 gradient arena (from fp16 x and dy: cuDNN's fp16 result,
widened; where cuDNN cannot build a geometry, dW alone takes the GEMM above with
fp32 output). A network's first convolution (no dx) may run on its images and filter
zero-padded from 3 channels to 4 where cuDNN times that faster (kernels/cudnn.py,
padded_channels): y is the same sum, and dW's pad channel, dy^T @ zeros, is dropped.

Its plain counterpart, im2col plus one product and nothing else, is nets/plain.py's
Conv2d (tests/test_plain_layers.py checks one against the other on each CPU path above).
"""
import time

import numpy as np

from mpitrain.arena import aligned_offsets
from mpitrain.backend import array_module, synchronize
from mpitrain.kernels import cast, cudnn, elementwise, gemm, winograd
from mpitrain.kernels.im2col import col2im, conv_output_size, im2col

from .module import Module, Param, constant, he_normal


# Every GEMM of the layers goes through matmul or batched_matmul. `bench step --profile`
# sets GEMM_LOG to a list to record each call as (a.shape, b.shape, seconds, flops); None
# records nothing.
GEMM_LOG = None


def matmul(a, b, out=None, accumulate=False, fp16_product=False):
    """a @ b, into `out` when given, computed in out's dtype (or a's); accumulate: out +=
    a @ b, inside the GEMM (beta = 1) where out is a NumPy float32 array, else added after.

    NumPy has no fast fp16 GEMM, so on the CPU fp16 operands are multiplied in
    fp32 and the result rounded once; weight gradients (out in the fp32
    arena) are accumulated in fp32 on every device. fp16_product: on a GPU, fp16
    operands are multiplied on tensor cores (fp32 sums, rounded once to fp16)
    and widened into the fp32 `out`, as cuDNN's weight gradients are
    (kernels/cudnn.py; beyond 65504 a value is inf, for the overflow check): an
    fp32 product would first widen both operands and then run without tensor
    cores. On the CPU the products of
    a fully connected layer at a small batch go to kernels.gemm's kernels.
    GEMM_LOG counts its 2 m n k floating-point operations.
    """
    return _logged(_matmul, a, b, out, None, accumulate, fp16_product)


def batched_matmul(a, b, out, flops):
    """out[k] = a[k] @ b[k] for every k, on NumPy stacks of one float dtype (Winograd's
    16 GEMMs; kernels.gemm.batched_matmul). flops: the floating-point operations of the
    layer's arithmetic that the stack stands for, for GEMM_LOG (Winograd's stand for
    the direct form's)."""
    return _logged(gemm.batched_matmul, a, b, out, flops)


def _logged(product, a, b, out, flops, *options):
    if GEMM_LOG is None:
        return product(a, b, out, *options)
    synchronize()
    start = time.perf_counter()
    result = product(a, b, out, *options)
    synchronize()
    GEMM_LOG.append((a.shape, b.shape, time.perf_counter() - start,
                     2.0 * a.shape[0] * a.shape[1] * b.shape[1] if flops is None else flops))
    return result


def _matmul(a, b, out, accumulate, fp16_product=False):
    xp = array_module(a)
    dtype = out.dtype if out is not None else a.dtype
    if xp is np:                    # NumPy has no fast fp16 GEMM
        compute, product = (np.float32 if dtype == np.float16 else dtype), gemm.matmul
    else:
        tensor_cores = fp16_product and a.dtype == b.dtype == np.float16
        compute, product = (np.float16 if tensor_cores else dtype), _device_matmul
    a, b = cast.astype(a, compute), cast.astype(b, compute)
    if accumulate:
        if xp is np and out.dtype == compute:
            return gemm.matmul(a, b, out=out, accumulate=True)
        return elementwise.add_into(out, cast.astype(product(a, b), out.dtype))
    if out is None:
        return cast.astype(product(a, b), dtype)
    if out.dtype == compute:
        return product(a, b, out=out)
    out[...] = cast.astype(product(a, b), out.dtype)
    return out


def _device_matmul(a, b, out=None):
    """a @ b of two CuPy arrays of one dtype: fp16 through cuDNN's product where it builds
    one (a CUDA graph can capture it; CuPy refuses its own cuBLAS calls during a capture),
    else CuPy's (cuBLAS; cuDNN's fp32 products run on TF32 tensor cores)."""
    if a.dtype == np.float16 and cudnn.available(a.dtype) and (out is None or out.dtype == a.dtype):
        try:
            return cudnn.matmul(a, b, out)
        except cudnn.Unsupported:
            pass
    return array_module(a).matmul(a, b, out=out)


# One scratch buffer per array module, shared by every convolution of the process: a
# layer lays out what it needs there (im2col's columns, or Winograd's padded input and
# products) from its input in forward and again in backward (keeping x, not the larger
# columns, between the two), and nothing holds a view of it from one layer call to the
# next. So the buffer is as large as the largest layer's needs, not as the sum of every
# kind's largest. A Winograd layer in training keeps its tiles (four times x) and its
# filter's tiles from forward instead, where they have x's dtype: both of its gradients
# multiply the same ones, which saves transforming them again (docs/benchmarks-record.md).
_WORKSPACE = {}


def workspace(xp, *parts):
    """C-contiguous views on the shared scratch buffer of xp, one per (shape, dtype) in
    `parts`, laid end to end from the buffer's start, each part on a multiple of
    arena.ALIGN bytes (grown to fit).

    The views of one call never overlap. A later call starts again at the start, so it
    overwrites earlier views, except where its leading parts repeat theirs: Winograd
    asks for (tiles, padded input), then for (tiles, products), to keep its tiles while
    the products take the padded input's place."""
    nbytes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in parts]
    offsets, total = aligned_offsets(nbytes)
    buf = _WORKSPACE.get(xp.__name__)
    if buf is None or buf.size < total:
        buf = _WORKSPACE[xp.__name__] = xp.empty(total, np.uint8)
    return [buf[o:o + n].view(dtype).reshape(shape)
            for (shape, dtype), o, n in zip(parts, offsets, nbytes)]


def _added(add_to, dx):
    """dx, or add_to += dx (add_to returned) where add_to is given."""
    return dx if add_to is None else elementwise.add_into(add_to, dx)


# Winograd pays where its 16 GEMMs (T, C) @ (C, O) are large enough to run near the
# BLAS's peak (WINOGRAD_MACS multiply-adds each) and there are enough tiles for the
# GEMMs' savings to outweigh the filters' transforms, which cost C O each: T at least
# WINOGRAD_TILES_PER_CHANNEL times the wider of C and O
WINOGRAD_MACS = 1 << 22
WINOGRAD_TILES_PER_CHANNEL = 0.5


class Conv2d(Module):
    """torchvision's Conv2d (square kernel, no dilation or groups) with an OHWI `weight`.

    Weights are drawn from N(0, 2 / (out_channels * k * k)) (He, fan_out), as
    torchvision's ResNet initialises them; the optional bias starts at zero
    and takes neither weight decay nor LARS.

    input_grad=False: backward computes the weight gradients only and returns None
    (a network's first convolution: the images need no gradient, and dx would cost
    a GEMM and a col2im). Such a layer may run on x and W zero-padded to `pad_to`
    channels: None (the default) lets cuDNN's timing decide on a GPU and pads nothing
    on the CPU; a number pads to it on every device.

    On the CPU a 3x3 convolution of stride 1 runs as Winograd's F(2x2, 3x3)
    (kernels/winograd.py) where its 16 GEMMs are large enough and its tiles many
    enough (WINOGRAD_MACS, WINOGRAD_TILES_PER_CHANNEL): 4/9 of the direct form's
    multiply-adds in all, on tiles that take the place of im2col's columns.
    `winograd = False` on a layer keeps it on im2col and one GEMM. cuDNN picks its
    own algorithm on a GPU.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, bias=False,
                 input_grad=True):
        self.input_grad = input_grad
        self.in_channels, self.out_channels = in_channels, out_channels
        self.k, self.stride, self.padding = kernel_size, stride, padding
        self.weight = Param((out_channels, kernel_size, kernel_size, in_channels),
                            he_normal(out_channels * kernel_size * kernel_size))
        self.bias = Param((out_channels,), constant(0.0), decay=False, lars=False) if bias else None
        self.pointwise = kernel_size == 1 and padding == 0   # a GEMM on x itself, no im2col
        self.pad_to = None
        self.channels = in_channels     # those the kernels ran on in the last forward
        self.winograd = kernel_size == 3 and stride == 1      # F(2x2, 3x3) on the CPU
        self.x = self.col = self.V = self.U = None

    def __repr__(self):
        return (f"Conv2d({self.in_channels}, {self.out_channels}, kernel_size={self.k}, "
                f"stride={self.stride}, padding={self.padding}, bias={self.bias is not None})")

    def _use_cudnn(self, x):
        return array_module(x) is not np and cudnn.available(x.dtype)

    def _kernel_channels(self, x):
        """The input channels forward runs on: in_channels, or more, zero-padded, for a
        layer without input gradient where pad_to says so or cuDNN times it faster."""
        if self.input_grad:
            return self.in_channels
        if self.pad_to is not None:
            return max(self.pad_to, self.in_channels)
        if self._use_cudnn(x):
            return cudnn.padded_channels(x, self.weight.data, self.stride, self.padding)
        return self.in_channels

    def _weight_grad_done(self, gw):
        """Announce the weight gradient, computed into gw: the arena view itself, or the
        padded channels' (O, k, k, channels), whose first in_channels go to the arena."""
        if gw is not self.weight.grad:
            self.weight.grad[...] = gw[..., :self.in_channels]
        self.weight.grad_ready()                                # its bucket may be summed now

    def _use_winograd(self, x, y_shape):
        N, Ho, Wo = y_shape[:3]
        tiles, C, O = N * -(-Ho // 2) * -(-Wo // 2), self.in_channels, self.out_channels
        return (self.winograd and array_module(x) is np and tiles * C * O >= WINOGRAD_MACS
                and tiles >= WINOGRAD_TILES_PER_CHANNEL * max(C, O))

    def _columns(self, x, out=None):
        """col (N*Ho*Wo, k*k*C) of the GEMM form (module docstring): x itself for a
        pointwise convolution of stride 1, else im2col(x) (into `out` when given; for a
        strided pointwise one, x[:, ::s, ::s])."""
        k, s, p = self.k, self.stride, self.padding
        if self.pointwise and s == 1:
            return array_module(x).ascontiguousarray(x).reshape(-1, x.shape[3])
        return im2col(x, k, k, s, p, out=out)

    def forward(self, x, train=True):
        if x.ndim != 4 or x.shape[3] != self.in_channels:
            raise ValueError(f"Conv2d expects (N, H, W, {self.in_channels}), got {x.shape}")
        self.x_shape = x.shape
        self.channels = self._kernel_channels(x)
        x = elementwise.zero_padded(x, self.channels)           # (N, H, W, C), C = channels
        w = elementwise.zero_padded(self.weight.data, self.channels)    # (O, k, k, C)
        N, H, W, C = x.shape
        k, s, p, O = self.k, self.stride, self.padding, self.out_channels
        Ho, Wo = conv_output_size(H, k, s, p), conv_output_size(W, k, s, p)
        if self._use_cudnn(x):
            y = cudnn.conv_forward(x, w, s, p)
            self.x = x if train else None                       # (N, H, W, C)
        elif self._use_winograd(x, (N, Ho, Wo)):
            # training keeps the tiles where they have x's dtype, else x (fp16's are fp32)
            keep = train and winograd.compute_dtype(x.dtype) == x.dtype
            y, V, U = self._winograd_forward(x, w, keep)
            self.x = x if train and not keep else None          # (N, H, W, C)
            self.V = V if keep else None                        # (16, T, C), for dW and dx
            self.U = U if train and self.input_grad else None   # (O, 16, C), for dx
        else:
            if self.pointwise:
                col = self._columns(x)
                self.col = col if train else None               # (N*Ho*Wo, C)
            else:
                col, = workspace(array_module(x), ((N * Ho * Wo, k * k * C), x.dtype))
                col = self._columns(x, out=col)
                self.x = x if train else None                   # (N, H, W, C)
            y = matmul(col, w.reshape(O, -1).T).reshape(N, Ho, Wo, O)
        if self.bias is not None:
            y += self.bias.data
        return y

    def backward(self, dy, add_to=None):
        """dx (None without input_grad). add_to: an array of x's shape and dy's dtype, which
        it overwrites with add_to + dx and returns: a residual block's first layer adds its
        dx to the shortcut's gradient inside the GEMM (beta = 1) or col2im that makes it,
        where those can, else after."""
        k, s, p, O = self.k, self.stride, self.padding, self.out_channels
        w = self.weight.data                                    # (O, k, k, C); dx: unpadded
        gw = self.weight.grad                                   # (O, k, k, C) arena view
        if self.channels != self.in_channels:                   # padded: the pad's dW too
            gw = array_module(dy).empty((O, k, k, self.channels), gw.dtype)
        if self.bias is not None:
            elementwise.column_sums(dy.reshape(-1, O), self.bias.grad)
            self.bias.grad_ready()
        if self._use_cudnn(dy):
            x, self.x = self.x, None
            try:
                # into the arena view (fp32; fp16 x and dy: cuDNN's fp16 dW, widened)
                cudnn.conv_backward_filter(x, dy, gw.shape, s, p, out=gw)
            except cudnn.Unsupported:
                dy2 = dy.reshape(-1, O)                         # (N*Ho*Wo, O), contiguous
                matmul(dy2.T, self._columns(x), out=gw.reshape(O, -1))
            self._weight_grad_done(gw)
            if not self.input_grad:
                return None
            return _added(add_to, cudnn.conv_backward_data(dy, w, self.x_shape, s, p))
        if self._use_winograd(dy, dy.shape):
            return _added(add_to, self._winograd_backward(dy, w, gw))
        xp = array_module(dy)
        dy2 = xp.ascontiguousarray(dy).reshape(-1, O)           # (N*Ho*Wo, O)
        if self.pointwise:
            col, self.col = self.col, None                      # (N*Ho*Wo, C)
        else:
            x, self.x = self.x, None                            # the columns again, from x
            col, = workspace(xp, ((dy2.shape[0], k * k * x.shape[3]), x.dtype))
            col = self._columns(x, out=col)
        matmul(dy2.T, col, out=gw.reshape(O, -1))
        self._weight_grad_done(gw)
        if not self.input_grad:
            return None
        w2 = w.reshape(O, -1)                                   # (O, k*k*C)
        if self.pointwise and s == 1:                           # dx = dy @ W, no col2im
            if add_to is None:
                return matmul(dy2, w2).reshape(self.x_shape)
            matmul(dy2, w2, out=add_to.reshape(dy2.shape[0], -1), accumulate=True)
            return add_to
        if self.pointwise:                                      # scattered to every s-th pixel
            return col2im(matmul(dy2, w2), self.x_shape, 1, 1, s, 0, add_to)
        if xp is np and col.dtype == np.float16:
            # fp16 on the CPU: the product stays fp32 through col2im, which sums in fp32
            # anyway, and dx is rounded once; col is not needed any more: dcol takes its place
            dcol = matmul(dy2, w2, out=workspace(np, (col.shape, np.float32))[0])
            return _added(add_to, cast.astype(col2im(dcol, self.x_shape, k, k, s, p), dy.dtype))
        # col is not needed any more: dcol overwrites the workspace in place
        dcol = matmul(dy2, w2, out=col)                         # (N*Ho*Wo, k*k*C)
        return col2im(dcol, self.x_shape, k, k, s, p, add_to)

    def _tiles(self, x, keep):
        """V (16, T, C), the Winograd tiles of x (kernels/winograd.py), and room for the
        products (16, T, O) on the shared workspace; V is a new array with `keep`
        (training: backward multiplies the same tiles), else on the workspace too. Also
        the tile grid (th, tw) and the compute dtype."""
        N, H, W, C = x.shape
        _, _, th, tw = winograd.tile_grid(H, W, self.padding)
        dtype = winograd.compute_dtype(x.dtype)
        tiles, padded = ((16, N * th * tw, C), dtype), ((N, 2 * th + 2, 2 * tw + 2, C), dtype)
        products = ((16, N * th * tw, self.out_channels), dtype)
        if keep:
            V, (xpad,) = np.empty(*tiles), workspace(np, padded)
        else:
            V, xpad = workspace(np, tiles, padded)
        V = winograd.input_tiles(winograd.padded(x, self.padding, xpad), th, tw, V)
        # the products over the padded input, which is done with
        M = workspace(np, products)[0] if keep else workspace(np, tiles, products)[1]
        return V, M, th, tw, dtype

    def _winograd_flops(self, N, Ho, Wo):
        """The direct form's floating-point operations that the 16 GEMMs stand for."""
        return 2.0 * N * Ho * Wo * self.out_channels * 9 * self.in_channels

    def _winograd_forward(self, x, w, keep):
        N, H, W, C = x.shape
        O = self.out_channels
        Ho, Wo, _, _ = winograd.tile_grid(H, W, self.padding)
        V, M, th, tw, dtype = self._tiles(x, keep)             # (16, T, C), (16, T, O)
        U = winograd.filter_tiles(w, dtype)                     # (O, 16, C)
        flops = self._winograd_flops(N, Ho, Wo)
        batched_matmul(V, U.transpose(1, 2, 0), M, flops)      # M[k] = V[k] @ U[:, k].T
        return winograd.output_tiles(M, th, tw, np.empty((N, Ho, Wo, O), x.dtype)), V, U

    def _winograd_backward(self, dy, w, gw):
        x, V, U = self.x, self.V, self.U                        # from forward
        self.x = self.V = self.U = None
        N, Ho, Wo, O = dy.shape
        _, _, th, tw = winograd.tile_grid(*self.x_shape[1:3], self.padding)
        if V is None:                                           # the tiles again, from x
            V, dM, _, _, _ = self._tiles(x, keep=False)
        else:
            dM, = workspace(np, ((16, V.shape[1], O), V.dtype))
        dM = winograd.output_tiles_grad(dy, th, tw, dM)        # (16, T, O)
        dU = np.empty((O, 16, V.shape[2]), V.dtype)             # (O, 16, C)
        flops = self._winograd_flops(N, Ho, Wo)
        # dU[:, k] = dM[k].T @ V[k]
        batched_matmul(dM.transpose(0, 2, 1), V, dU.transpose(1, 0, 2), flops)
        winograd.filter_tiles_grad(dU, gw)
        self._weight_grad_done(gw)
        if not self.input_grad:
            return None
        # dV[k] = dM[k] @ U[:, k], written over the tiles, which are done with
        batched_matmul(dM, U.transpose(1, 0, 2), V, flops)
        return winograd.input_tiles_grad(V, th, tw, self.padding, self.x_shape, dy.dtype)

    def macs(self, x_shape, y_shape):
        N, Ho, Wo, O = y_shape
        return N * Ho * Wo * O * self.k * self.k * x_shape[3]
