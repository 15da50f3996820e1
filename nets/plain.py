"""Plain NumPy versions of every layer in nets/: read these first.

The layers of nets/ are fast: Conv2d.backward alone has five paths (cuDNN, Winograd,
1x1, im2col with a thread team's GEMM, fp16 on the CPU), BatchNorm and ReLU are Numba
kernels, and a residual block folds its add and ReLU into other layers' passes. The
classes here compute the same numbers in the most direct way: NumPy only, no threads,
no shared workspace, no in-place tricks, any float dtype (float64 for checking).
tests/test_plain_layers.py runs each of them against its fast twin, forward outputs and
every gradient, so they stay the specification of what the fast layers compute.

The contract is the fast layers' (nets/module.py) without the arena: activations are
NHWC (N, H, W, C), `forward(x, train=True)` returns y and caches what backward needs,
`backward(dy)` returns dx. Parameters are plain arrays on the layer (W, b, gamma, beta)
and backward leaves their gradients beside them (dW, db, dgamma, dbeta).

The end of the file mirrors a fast network into these layers: `twins(model)` pairs each
fast layer with its plain twin, and `PlainNetwork(model)` runs a bound network's forward
and backward on the plain twins, in the network's own arena: `python -m mpitrain train
--layers plain` trains on it.
"""
import copy

import numpy as np

# the fast layers, only to mirror them (the last section)
from .activation import Dropout as FastDropout, ReLU as FastReLU
from .alexnet import AlexNet as FastAlexNet
from .batchnorm import BatchNorm2d as FastBatchNorm2d
from .conv import Conv2d as FastConv2d
from .linear import Flatten as FastFlatten, Linear as FastLinear
from .module import Sequential as FastSequential, check_backward, run_layer
from .pool import (AdaptiveAvgPool2d as FastAdaptiveAvgPool2d, AvgPool2d as FastAvgPool2d,
                   GlobalAvgPool2d as FastGlobalAvgPool2d, MaxPool2d as FastMaxPool2d)
from .resnet import BasicBlock, Bottleneck, ResNet


def output_size(size, k, s, p):
    """Positions of a k-wide window sliding with stride s over size + 2p values."""
    return (size + 2 * p - k) // s + 1


def im2col(x, k, s, p, pad_value=0.0):
    """(N, H, W, C) -> cols (N, Ho, Wo, k, k, C):
        cols[n, oh, ow, i, j, c] = xpad[n, oh*s + i, ow*s + j, c].

    Every window laid out as a row: a convolution becomes one matrix product. xpad is x
    with p rows and columns of pad_value on each side.
    """
    N, H, W, C = x.shape
    Ho, Wo = output_size(H, k, s, p), output_size(W, k, s, p)
    xpad = np.pad(x, ((0, 0), (p, p), (p, p), (0, 0)), constant_values=pad_value)
    cols = np.empty((N, Ho, Wo, k, k, C), x.dtype)
    for i in range(k):                  # one kernel position at a time: a strided slice
        for j in range(k):
            cols[:, :, :, i, j, :] = xpad[:, i:i + s * Ho:s, j:j + s * Wo:s, :]
    return cols


def col2im(dcols, x_shape, k, s, p):
    """The adjoint of im2col: (N, Ho, Wo, k, k, C) -> dx (N, H, W, C).

    Each window element is added back where im2col read it; a pixel inside several
    windows sums their contributions; what falls on the padding is dropped.
    """
    N, H, W, C = x_shape
    Ho, Wo = dcols.shape[1:3]
    dxpad = np.zeros((N, H + 2 * p, W + 2 * p, C), dcols.dtype)
    for i in range(k):
        for j in range(k):
            dxpad[:, i:i + s * Ho:s, j:j + s * Wo:s, :] += dcols[:, :, :, i, j, :]
    return dxpad[:, p:p + H, p:p + W, :]


class Conv2d:
    """y[n, oh, ow, o] = b[o] + sum_{i, j, c} W[o, i, j, c] * xpad[n, oh*s + i, ow*s + j, c]

    W is OHWI (O, k, k, C), xpad is x with p zeros on each side. With cols = im2col(x),
    forward is one product over (i, j, c) (np.tensordot, as Chainer writes it):
        y = cols . W + b,   dW = dy . cols (summed over n, oh, ow),   db = sum of dy,
        dx = col2im(dy . W).
    Reshaped to matrices, cols (N*Ho*Wo, k*k*C) and W (O, k*k*C): y = cols W^T,
    dW = dy^T cols, dcols = dy W: the three GEMMs of nets/conv.py's im2col path.
    input_grad=False: backward computes dW and db only and returns None (a network's
    first layer: the images need no gradient).
    """

    def __init__(self, W, b=None, stride=1, padding=0, input_grad=True):
        self.W, self.b, self.stride, self.padding = W, b, stride, padding
        self.k, self.input_grad = W.shape[1], input_grad

    def forward(self, x, train=True):
        self.x_shape = x.shape
        self.cols = im2col(x, self.k, self.stride, self.padding)      # (N, Ho, Wo, k, k, C)
        y = np.tensordot(self.cols, self.W, axes=([3, 4, 5], [1, 2, 3]))  # (N, Ho, Wo, O)
        return y if self.b is None else y + self.b

    def backward(self, dy):                                            # dy: (N, Ho, Wo, O)
        self.dW = np.tensordot(dy, self.cols, axes=([0, 1, 2], [0, 1, 2]))  # (O, k, k, C)
        self.db = None if self.b is None else dy.sum(axis=(0, 1, 2))   # (O,)
        if not self.input_grad:
            return None
        dcols = np.tensordot(dy, self.W, axes=([3], [0]))              # (N, Ho, Wo, k, k, C)
        return col2im(dcols, self.x_shape, self.k, self.stride, self.padding)


class BatchNorm2d:
    """y = gamma * xhat + beta,  xhat = (x - mean) / sqrt(var + eps), per channel c.

    With M = N*H*W values per channel. Train: mean and var are the batch's (biased,
    divided by M), and the running statistics move towards them as in PyTorch:
        running_mean <- (1 - momentum) running_mean + momentum mean
        running_var  <- (1 - momentum) running_var  + momentum var M / (M - 1)  (unbiased)
    Eval: mean and var are the running statistics, which stay as they are.
    The running statistics are updated in place ([...] =), so that arrays shared with a
    fast layer's buffers (PlainNetwork below) see the new values.
    Backward:
        dbeta = sum dy,   dgamma = sum dy * xhat   (sums over n, h, w)
        train: dx = gamma / sqrt(var + eps) * (dy - dbeta / M - xhat * dgamma / M)
        eval:  dx = gamma / sqrt(var + eps) * dy
    """

    def __init__(self, gamma, beta, running_mean, running_var, eps=1e-5, momentum=0.1):
        self.gamma, self.beta, self.eps, self.momentum = gamma, beta, eps, momentum
        self.running_mean, self.running_var = running_mean, running_var

    def forward(self, x, train=True):
        self.train = train
        if train:
            M = x.size // x.shape[3]
            mean, var = x.mean(axis=(0, 1, 2)), x.var(axis=(0, 1, 2))      # (C,) each
            m = self.momentum
            self.running_mean[...] = (1 - m) * self.running_mean + m * mean
            self.running_var[...] = (1 - m) * self.running_var + m * var * M / (M - 1)
        else:
            mean, var = self.running_mean, self.running_var
        self.invstd = 1 / np.sqrt(var + self.eps)                          # (C,)
        self.xhat = (x - mean) * self.invstd                               # (N, H, W, C)
        return self.gamma * self.xhat + self.beta

    def backward(self, dy):
        M = dy.size // dy.shape[3]
        self.dbeta = dy.sum(axis=(0, 1, 2))                                # (C,)
        self.dgamma = (dy * self.xhat).sum(axis=(0, 1, 2))                 # (C,)
        if not self.train:
            return self.gamma * self.invstd * dy
        return self.gamma * self.invstd * (dy - self.dbeta / M - self.xhat * self.dgamma / M)


class ReLU:
    """y = max(x, 0);  dx = dy where y > 0, else 0."""

    def forward(self, x, train=True):
        self.y = np.maximum(x, 0)          # x.shape
        return self.y

    def backward(self, dy):
        return dy * (self.y > 0)


class Dropout:
    """Inverted dropout. Train: y = x * mask, mask = [u >= p] / (1 - p), u ~ U(0, 1) drawn
    afresh each call (float32 uniforms from the layer's generator, as nets.Dropout's CPU
    path draws them); eval: y = x. Backward: dx = dy * mask."""

    def __init__(self, p=0.5, seed=0):
        self.p, self.rng = p, np.random.default_rng(seed)

    def forward(self, x, train=True):
        self.mask = np.ones(x.shape, x.dtype)
        if train and self.p > 0:
            u = self.rng.random(x.shape, dtype=np.float32)
            self.mask = np.where(u >= self.p, 1 / (1 - self.p), 0).astype(x.dtype)  # x.shape
        return x * self.mask

    def backward(self, dy):
        return dy * self.mask


class MaxPool2d:
    """y[n, oh, ow, c] = max of the k x k window at (oh*s - p, ow*s - p), padding -inf.

    Backward routes dy to the window's argmax, the first maximum in row-major window
    order among the taps inside x (a tie goes to the upper, then the left, element, and
    a NaN, above every number, to the first NaN, as in nets/pool.py's kernels; PyTorch's
    takes the last); the others get 0. A window of -inf values keeps its gradient: the padding,
    -inf too, never takes it.
    """

    def __init__(self, k, stride=None, padding=0):
        self.k, self.stride, self.padding = k, stride or k, padding

    def forward(self, x, train=True):
        k, s, p = self.k, self.stride, self.padding
        N, H, W, C = self.x_shape = x.shape
        win = im2col(x, k, s, p, pad_value=-np.inf)              # (N, Ho, Wo, k, k, C)
        win = win.reshape(win.shape[:3] + (k * k, C))            # (N, Ho, Wo, k*k, C)
        inside = im2col(np.ones((1, H, W, 1), bool), k, s, p, pad_value=False)
        inside = inside.reshape(inside.shape[:3] + (k * k, 1))   # (1, Ho, Wo, k*k, 1)
        y = win.max(axis=3)                                      # NaN where a tap is NaN
        top = (win == y[:, :, :, None]) | np.isnan(win)          # NaN: every NaN is a top
        self.arg = (top & inside).argmax(axis=3)                 # (N, Ho, Wo, C): i*k + j
        return y

    def backward(self, dy):
        k, C = self.k, dy.shape[3]
        dwin = np.zeros(dy.shape[:3] + (k * k, C), dy.dtype)      # (N, Ho, Wo, k*k, C)
        np.put_along_axis(dwin, self.arg[:, :, :, None, :], dy[:, :, :, None, :], axis=3)
        dwin = dwin.reshape(dy.shape[:3] + (k, k, C))
        return col2im(dwin, self.x_shape, k, self.stride, self.padding)


class AvgPool2d:
    """y[n, oh, ow, c] = sum of the k x k window (padding as zeros) / k^2.

    Backward: each window element receives dy / k^2 (PyTorch's count_include_pad=True).
    """

    def __init__(self, k, stride=None, padding=0):
        self.k, self.stride, self.padding = k, stride or k, padding

    def forward(self, x, train=True):
        self.x_shape = x.shape
        return im2col(x, self.k, self.stride, self.padding).mean(axis=(3, 4))

    def backward(self, dy):
        N, Ho, Wo, C = dy.shape
        k = self.k
        dwin = np.broadcast_to(dy[:, :, :, None, None, :] / (k * k), (N, Ho, Wo, k, k, C))
        return col2im(dwin, self.x_shape, k, self.stride, self.padding)


class GlobalAvgPool2d:
    """(N, H, W, C) -> (N, C): y[n, c] = mean over h, w of x[n, h, w, c];  dx = dy[n, c] / (H*W)."""

    def forward(self, x, train=True):
        self.x_shape = x.shape
        return x.mean(axis=(1, 2))

    def backward(self, dy):
        N, H, W, C = self.x_shape
        return np.broadcast_to(dy[:, None, None, :] / (H * W), self.x_shape).copy()


class AdaptiveAvgPool2d:
    """y[n, oh, ow, c] = mean of x over rows bin(oh) and columns bin(ow), where output o of
    In inputs averages [floor(o In / Out), ceil((o + 1) In / Out)) (PyTorch's bins).

    Backward: every pixel of a bin receives dy / (the bin's area)."""

    def __init__(self, output_size):
        self.Oh, self.Ow = output_size

    @staticmethod
    def bins(n_in, n_out):
        return [((o * n_in) // n_out, -(-((o + 1) * n_in) // n_out)) for o in range(n_out)]

    def forward(self, x, train=True):
        N, H, W, C = self.x_shape = x.shape
        y = np.empty((N, self.Oh, self.Ow, C), x.dtype)
        for oh, (h0, h1) in enumerate(self.bins(H, self.Oh)):
            for ow, (w0, w1) in enumerate(self.bins(W, self.Ow)):
                y[:, oh, ow, :] = x[:, h0:h1, w0:w1, :].mean(axis=(1, 2))
        return y

    def backward(self, dy):
        N, H, W, C = self.x_shape
        dx = np.zeros(self.x_shape, dy.dtype)
        for oh, (h0, h1) in enumerate(self.bins(H, self.Oh)):
            for ow, (w0, w1) in enumerate(self.bins(W, self.Ow)):
                dx[:, h0:h1, w0:w1, :] += dy[:, oh, ow, None, None, :] / ((h1 - h0) * (w1 - w0))
        return dx


class Flatten:
    """(N, H, W, C) -> (N, H*W*C) in (h, w, c) order; backward reshapes dy back."""

    def forward(self, x, train=True):
        self.x_shape = x.shape
        return x.reshape(x.shape[0], -1)

    def backward(self, dy):
        return dy.reshape(self.x_shape)


class Linear:
    """y = x W^T + b, W (out, in), x (N, in).  dW = dy^T x,  db = sum_n dy,  dx = dy W."""

    def __init__(self, W, b=None):
        self.W, self.b = W, b

    def forward(self, x, train=True):
        self.x = x                                  # (N, in)
        y = x @ self.W.T                            # (N, out)
        return y if self.b is None else y + self.b

    def backward(self, dy):                         # dy: (N, out)
        self.dW = dy.T @ self.x                     # (out, in)
        self.db = None if self.b is None else dy.sum(axis=0)
        return dy @ self.W


class ResidualBlock:
    """y = relu(main(x) + shortcut(x)): a ResNet block, its add written out.

    main and shortcut are lists of layers run in order (an empty shortcut is the
    identity). Backward: g = dy where y > 0, else 0; the add hands g to both branches,
    and x, used by both, receives the sum: dx = main'(g) + shortcut'(g).
    """

    def __init__(self, main, shortcut=()):
        self.main, self.shortcut = list(main), list(shortcut)

    def forward(self, x, train=True):
        a, b = x, x
        for layer in self.main:
            a = layer.forward(a, train)
        for layer in self.shortcut:
            b = layer.forward(b, train)
        self.y = np.maximum(a + b, 0)                # (N, H, W, C)
        return self.y

    def backward(self, dy):
        g = dy * (self.y > 0)
        da, db = g, g
        for layer in reversed(self.main):
            da = layer.backward(da)
        for layer in reversed(self.shortcut):
            db = layer.backward(db)
        return da + db


def softmax_cross_entropy(logits, labels, label_smoothing=0.0):
    """Mean cross-entropy of softmax(logits) (N, K) against smoothed one-hot targets.

        t[n, k]  = (1 - eps) [k == labels[n]] + eps / K       (eps = label_smoothing)
        log p    = z - log sum_k exp(z),  z = logits - max_k logits  (the same p, no overflow)
        loss     = -(1/N) sum_n sum_k t[n, k] log p[n, k]
        dlogits  = (p - t) / N
    Returns (loss, dlogits).
    """
    N, K = logits.shape
    t = np.full((N, K), label_smoothing / K, logits.dtype)
    t[np.arange(N), labels] += 1 - label_smoothing
    z = logits - logits.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))     # (N, K)
    loss = -(t * log_p).sum() / N
    return loss, (np.exp(log_p) - t) / N


# ----- a fast network mirrored into plain layers -----
def twin(layer, share=False):
    """The plain twin of one fast layer (not a block or a container: see twins).

    share=False: its parameters and BatchNorm statistics are copies of the fast layer's
    (a Dropout's generator too: the same masks from here on), so the two can be run side
    by side and compared. share=True: they are the fast layer's own arrays (the working
    weights param.data, the buffers' views, the generator itself): the twin computes with
    whatever the optimizer, a checkpoint or an all-reduce put there, and its BatchNorm
    moves the fast layer's running statistics.
    A fused ReLU (BatchNorm2d(relu=True)) is left out: twins() adds a plain.ReLU after it.
    """
    own = (lambda a: a) if share else (lambda a: a.copy())
    param = lambda p: None if p is None else own(p.data)
    if isinstance(layer, FastConv2d):
        return Conv2d(param(layer.weight), param(layer.bias), layer.stride, layer.padding,
                      layer.input_grad)
    if isinstance(layer, FastBatchNorm2d):
        return BatchNorm2d(param(layer.weight), param(layer.bias), own(layer.running_mean.data),
                           own(layer.running_var.data), layer.eps, layer.momentum)
    if isinstance(layer, FastLinear):
        return Linear(param(layer.weight), param(layer.bias))
    if isinstance(layer, FastDropout):
        plain = Dropout(layer.p)
        plain.rng = layer.rng if share else copy.deepcopy(layer.rng)
        return plain
    if isinstance(layer, (FastMaxPool2d, FastAvgPool2d)):
        cls = MaxPool2d if isinstance(layer, FastMaxPool2d) else AvgPool2d
        return cls(layer.k, layer.stride, layer.padding)
    if isinstance(layer, FastAdaptiveAvgPool2d):
        return AdaptiveAvgPool2d(layer.output_size)
    simple = {FastReLU: ReLU, FastFlatten: Flatten, FastGlobalAvgPool2d: GlobalAvgPool2d}
    if type(layer) in simple:
        return simple[type(layer)]()
    raise TypeError(f"{type(layer).__name__} has no plain twin in nets/plain.py")


def twins(layer, share=False):
    """[(fast layer or None, plain layer)] in forward order: a fused ReLU made a layer of its
    own (its fast layer None), a residual block one ResidualBlock (whose `pairs` are its
    layers' own), a network or a Sequential the twins of what it runs in turn.
    share: as twin's."""
    if isinstance(layer, (ResNet, FastAlexNet, FastSequential)):
        parts = (layer.sequence if isinstance(layer, ResNet) else
                 layer.stages if isinstance(layer, FastAlexNet) else layer.layers)
        return [t for sub in parts for t in twins(sub, share)]
    if isinstance(layer, (BasicBlock, Bottleneck)):
        main = [t for sub in layer.main for t in twins(sub, share)]
        short = twins(layer.downsample, share) if layer.downsample is not None else []
        block = ResidualBlock([p for _, p in main], [p for _, p in short])
        block.pairs = main + short
        return [(layer, block)]
    pair = [(layer, twin(layer, share))]
    return pair + [(None, ReLU())] if getattr(layer, "relu", False) else pair


def gradients(pairs):
    """[(fast Param, plain layer, name of its gradient there)] of every parameter below
    `pairs` (from twins), in forward (registration) order: after the plain layer's
    backward, getattr(plain layer, name) is the parameter's gradient."""
    out = []
    for fast, plain in pairs:
        if isinstance(plain, ResidualBlock):
            out += gradients(plain.pairs)
            continue
        if fast is None:
            continue
        names = ({"weight": "dgamma", "bias": "dbeta"} if isinstance(plain, BatchNorm2d)
                 else {"weight": "dW", "bias": "db"})
        out += [(param, plain, names[name]) for name, param in fast.named_params()]
    return out


class PlainNetwork:
    """A bound fast network (nets/) whose forward and backward the plain layers compute,
    in the fast network's own memory: `python -m mpitrain train --layers plain`.

    The plain twins share the fast layers' arrays (twins(model, share=True)): their
    weights are the arena's working views, which the optimizer updates in place; their
    BatchNorm running statistics are the buffer arena's views, moved in place; a Dropout
    draws from the fast layer's generator, which checkpoints save. So the arena, the
    optimizer, the gradient Reducer, checkpoints, the averaging of the statistics over
    the ranks and evaluation all work as with the fast layers: only the arithmetic of
    forward and backward changes (NumPy, the float dtype of the arena, on the CPU).

    backward hands each gradient over as the fast layers do: once a plain layer (a whole
    residual block at a time) has run backward, each of its parameters' gradients is
    written into the arena (param.grad[...] = ...) and announced (param.grad_ready(),
    which counts it off its Reducer bucket), in arena order, the order of the fast
    layers' backward.
    """

    def __init__(self, model):
        arena = model.arena
        if arena.xp is not np or arena.working_dtype != arena.dtype:
            raise ValueError("the plain layers compute in NumPy in the master dtype: a model on "
                             "a GPU or with fp16 working weights has no plain twin")
        self.model = model
        # what a training step reads of a network besides forward and backward: the model's
        self.arena, self.buffer_arena, self.dtype = arena, model.buffer_arena, model.dtype
        self.pairs = twins(model, share=True)        # [(fast layer or None, plain layer)]
        # each plain layer's gradients, in arena order (backward's: the last parameter first)
        self.grads = [gradients([pair])[::-1] for pair in self.pairs]
        handed = [param for grads in reversed(self.grads) for param, _, _ in grads]
        if [id(p) for p in handed] != [id(p) for p in arena.params]:
            raise TypeError(f"the plain twins of {type(model).__name__} do not compute the "
                            f"gradients of its parameters in arena order")

    run_layer = staticmethod(run_layer)     # the fast networks' hook (nets/module.py)
    backward_ready = False

    def forward(self, x, train=True):
        self.backward_ready = train
        for _, layer in self.pairs:
            x = self.run_layer(layer, "forward", x, train)
        return x

    def backward(self, dy):
        check_backward(self)
        for (_, layer), grads in zip(reversed(self.pairs), reversed(self.grads)):
            dy = self.run_layer(layer, "backward", dy)
            for param, plain, name in grads:
                param.grad[...] = getattr(plain, name)
                param.grad_ready()
        return dy
