"""Batch normalisation over NHWC activations (Ioffe & Szegedy 2015)."""

from mpitrain.arena import Buffer, Param
from mpitrain.backend import array_module
from mpitrain.kernels import batchnorm as cpu
from mpitrain.kernels import gpu

from .module import Module, constant


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

    relu: the ReLU that follows, fused: y = max(gamma * xhat + beta, 0), and
    backward takes dy where y > 0, 0 elsewhere, as it reads dy, recomputing y's sign
    from x (which it keeps anyway): no mask, y not kept, and two passes fewer than a
    separate ReLU layer.

    residual (forward's argument, a layer without relu): a residual block's shortcut,
    added after the affine map and clamped at 0, y = max(gamma * xhat + beta + residual,
    0): the block's output, in the same pass. Backward is BatchNorm's own; the block
    takes dy through that ReLU first.

    Distributed BN (Ying et al.): with `group` set (mpitrain.comm.syncbn.attach),
    the train-mode statistics are those of the group's ranks' batches together:
    M, the per-channel sum of x and then of (x - mean)^2 are summed over the
    group in forward, and dbeta and dgamma (for dx only) in backward. Each
    rank's weight.grad and bias.grad stay its own share; the gradient all-reduce
    sums them.

    The formulas run as a few fused kernels, with the same functions on either
    device: mpitrain.kernels.batchnorm on the CPU (Numba, threads over blocks of
    rows, sums in float64), mpitrain.kernels.gpu on a GPU. Forward: per-channel
    sums, then the statistics and running averages, then one elementwise pass;
    backward: the sums of dy and dy * (x - mean), then dgamma, dbeta and dx's
    coefficients, then one elementwise pass for dx. The forward sums are taken about a
    per-channel shift (x[0]), so that one pass over x gives an accurate variance;
    with a group, the ranks' (sum, centred sum of squares) are combined by Chan et
    al.'s formula through the same two group sums as above, between the sums
    kernel and the statistics kernel.
    """

    group = None    # ranks whose batches share statistics: an object with .size and .sum(v)

    def __init__(self, num_features, eps=1e-5, momentum=0.1, zero_init=False, relu=False):
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.relu = relu
        self.weight = Param((num_features,), constant(0.0 if zero_init else 1.0),
                            decay=False, lars=False)
        self.bias = Param((num_features,), constant(0.0), decay=False, lars=False)
        self.running_mean = Buffer((num_features,), 0.0)
        self.running_var = Buffer((num_features,), 1.0)

    def forward(self, x, train=True, residual=None):
        xp = array_module(x)
        C = self.num_features
        if x.ndim != 4 or x.shape[3] != C:
            raise ValueError(f"BatchNorm2d({C}) expects an NHWC batch (N, H, W, {C}), got shape "
                             f"{x.shape}")
        if residual is not None and (self.relu or residual.shape != x.shape
                                     or residual.dtype != x.dtype):
            raise ValueError(f"BatchNorm2d({C}): a residual needs a layer without relu and "
                             f"x's shape and dtype {x.shape} {x.dtype}, got "
                             f"relu={self.relu}, {residual.shape} {residual.dtype}")
        ranks = 1 if self.group is None else self.group.size    # whose values the statistics take
        if train and x.size // C * ranks < 2:
            raise ValueError(f"BatchNorm2d needs more than one value per channel in train mode, "
                             f"got shape {x.shape}"
                             + (f" on each of {ranks} ranks" if ranks > 1 else ""))
        kernels = self._kernels(x)
        x2 = xp.ascontiguousarray(x).reshape(-1, C)     # (M, C)
        stat = kernels.acc_dtype(x.dtype)
        gamma = self.weight.master.astype(stat, copy=False)
        running = [b.data.astype(stat, copy=False) for b in (self.running_mean, self.running_var)]
        sums, count, mode = None, 0, "eval"
        if train:
            sums, count, mode = kernels.batchnorm_sums(x2), x2.shape[0], "shifted"
            if self.group is not None:
                sums, count, mode = self._group_moments(sums, x2), count * self.group.size, "group"
        mean, invstd, scale = kernels.batchnorm_finalize(sums, x2, count, mode, gamma, self.eps,
                                                         self.momentum, *running)
        for b, r in zip((self.running_mean, self.running_var), running):
            if r is not b.data:               # buffers of another dtype than the statistics
                b.data[...] = r
        beta = self.bias.master.astype(stat, copy=False)
        y = kernels.batchnorm_affine(x2, mean, scale, beta, self.relu,
                                     None if residual is None else residual.reshape(-1, C))
        self.train, self.x, self.kernels = train, x2, kernels   # x: (M, C) as given
        self.mean, self.invstd = mean, invstd                    # (C,) each, in stat
        self.affine = (scale, beta) if self.relu else None       # to recompute where y > 0
        return y.reshape(x.shape)

    def _kernels(self, x):
        """The kernel set for x: the CUDA kernels for CuPy arrays, else the CPU ones."""
        return gpu if gpu.handles(x) else cpu

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

    def backward(self, dy):
        C, kernels = self.num_features, self.kernels
        dy2 = array_module(dy).ascontiguousarray(dy, dtype=self.x.dtype).reshape(-1, C)  # (M, C)
        # (2, C): sum dy, sum dy (x - mean)
        local = kernels.batchnorm_sums(self.x, dy2, self.mean, self.affine)
        group, count = local, dy2.shape[0]
        if self.train and self.group is not None:             # dx sees the whole group's statistics
            group, count = self.group.sum(local.reshape(-1)).reshape(2, C), count * self.group.size
        gamma = self.weight.master.astype(self.invstd.dtype, copy=False)
        grads = [p.grad if p.grad.dtype == self.invstd.dtype else p.grad.astype(self.invstd.dtype)
                 for p in (self.weight, self.bias)]
        coef = kernels.batchnorm_backward_coefficients(local, group, gamma, self.invstd, count,
                                                       self.train, *grads)
        for p, g in zip((self.weight, self.bias), grads):
            if g is not p.grad:
                p.grad[...] = g
        self.bias.grad_ready()                  # in arena order: bias, then weight
        self.weight.grad_ready()
        dx = kernels.batchnorm_dx(dy2, self.x, self.mean, coef, self.affine)
        self.x = self.mean = self.affine = None
        return dx.reshape(dy.shape)
