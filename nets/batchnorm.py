"""Batch normalisation over NHWC activations (Ioffe & Szegedy 2015)."""
import numpy as np

from mpitrain.arena import Buffer, Param
from mpitrain.backend import array_module
from mpitrain.kernels import gpu

from .module import Module, constant

# Elementwise passes run on a "wide" view of the (M, C) activations, (M/k, k*C),
# with each per-channel vector tiled k times. On the plain (M, C) view NumPy
# calls its inner loop once per row of only C elements when broadcasting a (C,)
# vector, and that per-call overhead made every pass slower than on the wide
# view (the measurements: docs/benchmarks.md, "Layers"). k*C is kept near
# WIDE elements (64 KiB of fp32), so the tiled vectors stay in cache.
WIDE = 16384


class BatchNorm2d(Module):
    """y = gamma * xhat + beta per channel, xhat = (x - mean) / sqrt(var + eps).

    x is NHWC; with M = N*H*W each channel c has M values x_mc.

    Train mode: mean and var are the batch's (biased) statistics over (N, H, W),
        mean_c = sum_m x_mc / M,   var_c = sum_m (x_mc - mean_c)^2 / M,
    and the running statistics move towards them as in PyTorch:
        running_mean <- (1 - momentum) * running_mean + momentum * mean
        running_var  <- (1 - momentum) * running_var  + momentum * var * M / (M - 1)
    Eval mode: mean and var are running_mean and running_var.

    Backward, with invstd = 1 / sqrt(var + eps) and xhat as above:
        dbeta_c  = sum_m dy_mc
        dgamma_c = sum_m dy_mc * xhat_mc
        train:  dx = gamma * invstd * (dy - dbeta / M - xhat * dgamma / M)
        eval:   dx = gamma * invstd * dy     (the statistics are constants)

    Statistics, gamma, beta and the arithmetic are fp32 (float64 for float64
    input) whatever x's dtype: fp16 input is cast up, and y and dx are returned
    in the dtype of x and dy. For backward an fp16 layer keeps its fp16 input
    (not the fp32 x - mean), so that the activations it holds stay fp16.
    gamma and beta are read from the fp32 master copy, which the fp16 working
    copy would round.

    zero_init: start gamma at 0 (Goyal et al.: the last BN of each residual
    block, so that every block starts as the identity).

    Distributed BN (Ying et al.): with `group` set (mpitrain.comm.syncbn.attach),
    the train-mode statistics are those of the group's ranks' batches together:
    M, the per-channel sum of x and then of (x - mean)^2 are summed over the
    group in forward, and dbeta and dgamma (for dx only) in backward. Each
    rank's weight.grad and bias.grad stay its own share; the gradient all-reduce
    sums them.

    On a GPU (CuPy input) the same formulas run as a few fused kernels
    (mpitrain.kernels.gpu): forward, per-channel sums, then one kernel for the
    statistics and running averages, then one elementwise pass; backward, the
    sums of dy and dy * (x - mean), one kernel for dgamma, dbeta and dx's
    coefficients, one elementwise pass for dx. The forward sums are taken about a
    per-channel shift (x[0]), so that one pass over x gives an accurate variance;
    with a group, the ranks' (sum, centred sum of squares) are combined by Chan et
    al.'s formula through the same two group sums as above, between the sums
    kernel and the statistics kernel.
    """

    group = None    # ranks whose batches share statistics: an object with .size and .sum(v)

    def __init__(self, num_features, eps=1e-5, momentum=0.1, zero_init=False):
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.weight = Param((num_features,), constant(0.0 if zero_init else 1.0),
                            decay=False, lars=False)
        self.bias = Param((num_features,), constant(0.0), decay=False, lars=False)
        self.running_mean = Buffer((num_features,), 0.0)
        self.running_var = Buffer((num_features,), 1.0)

    def forward(self, x, train=True):
        xp = array_module(x)
        C = self.num_features
        if x.ndim != 4 or x.shape[3] != C:
            raise ValueError(f"BatchNorm2d({C}) expects an NHWC batch (N, H, W, {C}), got shape {x.shape}")
        stat = np.float64 if x.dtype == np.float64 else np.float32
        M = x.size // C
        if train and M < 2:
            raise ValueError(f"BatchNorm2d needs more than one value per channel in train mode, got shape {x.shape}")
        if gpu.handles(x):
            return self._forward_gpu(x, train)
        k = _wide_factor(M, C)
        xw = x.reshape(M // k, k * C).astype(stat, copy=False)

        gamma = self.weight.master.astype(stat, copy=False)
        beta = self.bias.master.astype(stat, copy=False)
        if train:
            group_sum = self.group.sum if self.group is not None else (lambda v: v)
            Mg = M * (self.group.size if self.group is not None else 1)   # values per channel
            mean = group_sum(_fold(_colsum(xw), k, C)) / Mg
            xc = xw - xp.tile(mean, k)
            # two passes (centre, then square) keep var accurate when |mean| >> std
            var = group_sum(_fold(xp.einsum("ij,ij->j", xc, xc), k, C)) / Mg
            m = self.momentum
            self.running_mean.data[...] = (1 - m) * self.running_mean.data + m * mean
            self.running_var.data[...] = (1 - m) * self.running_var.data + m * var * (Mg / (Mg - 1))
            invstd = 1.0 / xp.sqrt(var + self.eps)
            y = xc * xp.tile(gamma * invstd, k)
            y += xp.tile(beta, k)
            if x.dtype == stat:
                self.xc, self.x = xc, None  # (M/k, k*C): x - mean in the wide layout
            else:
                # fp16 input: keep the fp16 x (half the bytes of an fp32 x - mean) and
                # recompute x - mean in fp32 in backward
                self.xc, self.mean = None, mean
                self.x = x.reshape(M // k, k * C)   # (M/k, k*C) fp16 wide layout; mean: (C,)
        else:
            # a pure affine map y = x * s + (beta - mean * s): two passes, and x - mean
            # is formed only if backward is called
            mean = self.running_mean.data.astype(stat, copy=False)
            invstd = 1.0 / xp.sqrt(self.running_var.data.astype(stat, copy=False) + self.eps)
            s = gamma * invstd
            y = xw * xp.tile(s, k)
            y += xp.tile(beta - mean * s, k)
            self.xc, self.x, self.mean = None, xw, mean     # x: (M/k, k*C) wide layout; mean: (C,)

        self.train, self.k = train, k
        self.invstd = invstd    # (C,)
        return y.reshape(x.shape).astype(x.dtype, copy=False)

    def backward(self, dy):
        if gpu.handles(dy):
            return self._backward_gpu(dy)
        xp = array_module(dy)
        C, k, invstd = self.num_features, self.k, self.invstd
        xc = self.xc if self.xc is not None else self.x - xp.tile(self.mean, k)   # in fp32
        M = dy.size // C
        dyw = dy.reshape(M // k, k * C).astype(xc.dtype, copy=False)

        dbeta = _fold(_colsum(dyw), k, C)
        dgamma = _fold(xp.einsum("ij,ij->j", dyw, xc), k, C) * invstd
        self.weight.grad[...] = dgamma
        self.bias.grad[...] = dbeta
        self.bias.grad_ready()                  # in arena order: bias, then weight
        self.weight.grad_ready()
        if self.train and self.group is not None:     # dx sees the whole group's statistics
            both = self.group.sum(xp.concatenate([dbeta, dgamma]))
            dbeta, dgamma, M = both[:C], both[C:], M * self.group.size

        scale = self.weight.master.astype(xc.dtype, copy=False) * invstd
        dx = dyw * xp.tile(scale, k)
        if self.train:
            # dx += -scale*invstd*dgamma/M * xc - scale*dbeta/M, built in the cached
            # xc (not needed after this) so that no further temporary is allocated
            xc *= xp.tile(-scale * invstd * dgamma / M, k)
            xc += xp.tile(-scale * dbeta / M, k)
            dx += xc
        self.xc = self.x = None
        return dx.reshape(dy.shape).astype(dy.dtype, copy=False)

    # ----- the GPU branch: fused kernels (formulas in the class docstring) -----
    def _forward_gpu(self, x, train):
        C = self.num_features
        x2 = array_module(x).ascontiguousarray(x).reshape(-1, C)     # (M, C)
        stat = gpu.acc_dtype(x.dtype)
        gamma = self.weight.master.astype(stat, copy=False)
        running = [b.data.astype(stat, copy=False) for b in (self.running_mean, self.running_var)]
        sums, count, mode = None, 0, "eval"
        if train:
            sums, count, mode = gpu.batchnorm_sums(x2), x2.shape[0], "shifted"
            if self.group is not None:
                sums, count, mode = self._group_moments(sums, x2), count * self.group.size, "group"
        mean, invstd, scale = gpu.batchnorm_finalize(sums, x2, count, mode, gamma, self.eps,
                                                     self.momentum, *running)
        for b, r in zip((self.running_mean, self.running_var), running):
            if r is not b.data:               # buffers of another dtype than the statistics
                b.data[...] = r
        y = gpu.batchnorm_affine(x2, mean, scale, self.bias.master.astype(stat, copy=False))
        self.train, self.x, self.xc = train, x2, None   # x: (M, C) as given (fp16 stays fp16)
        self.mean, self.invstd = mean, invstd            # (C,) each, in stat
        return y.reshape(x.shape)

    def _group_moments(self, sums, x2):
        """This rank's sums about k = x[0] -> (sum of x, sum of (x - mean)^2) over the
        group's batches, mean being the group's: the group sums s_r = M k + sums[0], then
        q_r + M (s_r / M - mean)^2, where q_r = sums[1] - sums[0]^2 / M is rank r's sum of
        squares about its own mean (Chan et al.'s combination)."""
        M = x2.shape[0]
        local = M * x2[0].astype(sums.dtype) + sums[0]
        total = self.group.sum(local)
        mean = total / (M * self.group.size)
        q = sums[1] - sums[0] * sums[0] / M + M * (local / M - mean) ** 2
        return array_module(x2).stack([total, self.group.sum(q)])

    def _backward_gpu(self, dy):
        C = self.num_features
        dy2 = array_module(dy).ascontiguousarray(dy, dtype=self.x.dtype).reshape(-1, C)  # (M, C)
        local = gpu.batchnorm_sums(self.x, dy2, self.mean)    # (2, C): sum dy, sum dy (x - mean)
        group, count = local, dy2.shape[0]
        if self.train and self.group is not None:             # dx sees the whole group's statistics
            group, count = self.group.sum(local.reshape(-1)).reshape(2, C), count * self.group.size
        gamma = self.weight.master.astype(local.dtype, copy=False)
        grads = [p.grad if p.grad.dtype == local.dtype else p.grad.astype(local.dtype)
                 for p in (self.weight, self.bias)]
        coef = gpu.batchnorm_backward_coefficients(local, group, gamma, self.invstd, count,
                                                   self.train, *grads)
        for p, g in zip((self.weight, self.bias), grads):
            if g is not p.grad:
                p.grad[...] = g
        self.bias.grad_ready()                  # in arena order: bias, then weight
        self.weight.grad_ready()
        dx = gpu.batchnorm_dx(dy2, self.x, self.mean, coef)
        self.x = self.mean = None
        return dx.reshape(dy.shape)


def _wide_factor(M, C):
    """The largest k that divides M with k*C <= WIDE (at least 1)."""
    k = max(1, min(M, WIDE // C))
    while M % k:
        k -= 1
    return k


def _colsum(a):
    """Column sums as a GEMV with a ones vector: BLAS runs it on every core, and on
    the wide view it is several times faster than a.sum(0)."""
    xp = array_module(a)
    return xp.ones(a.shape[0], a.dtype) @ a


def _fold(v, k, C):
    """(k*C,) per-column results of the wide view -> (C,) per-channel sums."""
    return v.reshape(k, C).sum(0)
