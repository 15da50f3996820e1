"""Every plain layer of nets/plain.py against its fast twin in nets/: the same inputs and
weights (copied from the fast layer), then the forward output, dx and every parameter
gradient, in float64 (relative error 1e-10) and float32 (1e-5; 5e-5 through whole
residual blocks and resnet_small), errors taken relative to the largest magnitude of the
plain result (gradcheck.assert_close). Convolutions run on each CPU path of the fast
layer (1x1, strided 1x1, im2col, Winograd, the add into a shortcut's gradient)."""
import numpy as np
import pytest

from gradcheck import assert_close
from mpitrain.nets import build_model, plain
from mpitrain.nets import conv as conv_module
from mpitrain.nets.activation import Dropout, ReLU
from mpitrain.nets.batchnorm import BatchNorm2d
from mpitrain.nets.conv import Conv2d
from mpitrain.nets.linear import Flatten, Linear
from mpitrain.nets.losses import softmax_cross_entropy
from mpitrain.nets.module import Sequential
from mpitrain.nets.plain import twin, twins
from mpitrain.nets.pool import AdaptiveAvgPool2d, AvgPool2d, GlobalAvgPool2d, MaxPool2d
from mpitrain.nets.resnet import BasicBlock, Bottleneck

DTYPES = [np.float64, np.float32]
RTOL = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-5}
# whole blocks and networks: float32's rounding compounds through several BatchNorms
CHAIN_RTOL = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 5e-5}


def rand(shape, dtype=np.float64, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def close(fast, plain_value, what, rtol=RTOL):
    """The fast layer's result against the plain one: same shape and dtype, and close."""
    fast, plain_value = np.asarray(fast), np.asarray(plain_value)
    assert fast.dtype == plain_value.dtype, f"{what}: dtype {fast.dtype} != {plain_value.dtype}"
    assert_close(fast, plain_value, rtol[plain_value.dtype], 1e-12, what)


# ----- plain.twins(fast): the plain twins, with copies of the parameters and buffers -----
def parameter_pairs(pairs):
    """[(name, fast gradient, plain gradient)] of every parameter below `pairs`."""
    return [(param.name, param.grad, getattr(p, attr))
            for param, p, attr in plain.gradients(pairs)]


def run_both(fast, x, train=True, dy_seed=7, pairs=None, rtol=RTOL):
    """One forward and backward of the fast layer and of its plain twin on the same x and
    a random dy; compares y, dx and every parameter gradient; returns the pairs."""
    pairs = pairs or twins(fast)
    y = fast.forward(x.copy(), train)
    y_plain = x.copy()
    for _, p in pairs:
        y_plain = p.forward(y_plain, train)
    close(y, y_plain, "y", rtol)
    dy = rand(y.shape, x.dtype, seed=dy_seed)
    dx = fast.backward(dy.copy())
    dx_plain = dy.copy()
    for _, p in reversed(pairs):
        dx_plain = p.backward(dx_plain)
    assert (dx is None) == (dx_plain is None), \
        f"dx: fast {type(dx).__name__}, plain {type(dx_plain).__name__}"
    if dx is not None:
        close(dx, dx_plain, "dx", rtol)
    grads = parameter_pairs(pairs)
    if hasattr(fast, "num_params"):         # no parameter left out
        assert sum(g.size for _, g, _ in grads) == fast.num_params()
    for name, g, g_plain in grads:
        close(g, g_plain, name, rtol)
    return pairs


def bound(layer, dtype, seed=3):
    """layer bound in dtype, its biases and BatchNorm gamma and beta drawn away from 0 and 1."""
    layer.bind(dtype=dtype, seed=seed)
    for i, (name, p) in enumerate(layer.named_params()):
        if p.master.ndim == 1:          # a bias (0 + noise) or BatchNorm's gamma (1 + noise)
            p.master[...] = name.endswith("weight") + 0.5 * rand(p.shape, seed=100 + i)
    layer.arena.sync_working()
    return layer


# ----- Conv2d: every CPU path (pointwise, strided pointwise, im2col, Winograd) -----
# (k, stride, padding, Cin, Cout, H, W, bias)
CONVS = [
    (1, 1, 0, 16, 8, 5, 6, False),       # pointwise: a GEMM on x itself
    (1, 2, 0, 16, 8, 7, 6, True),        # strided pointwise: x[:, ::2, ::2]
    (1, 1, 1, 3, 16, 4, 5, False),       # 1x1 with padding: im2col
    (3, 1, 1, 3, 16, 6, 7, True),
    (3, 2, 1, 16, 16, 7, 6, False),
    (3, 1, 0, 16, 3, 6, 5, False),
    (3, 2, 0, 3, 16, 8, 9, False),
    (5, 1, 2, 16, 8, 5, 5, False),
    (7, 2, 3, 3, 16, 11, 10, False),     # ResNet's stem
]
WINOGRAD = [(3, 1, 1, 3, 16, 6, 7, True), (3, 1, 0, 16, 3, 6, 5, False),
            (3, 1, 1, 16, 16, 5, 5, False)]


def conv(geometry, dtype, **kw):
    k, s, p, C, O, H, W, bias = geometry
    layer = bound(Conv2d(C, O, k, stride=s, padding=p, bias=bias, **kw), dtype)
    return layer, rand((2, H, W, C), dtype, seed=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", CONVS)
def test_conv(geometry, dtype):
    layer, x = conv(geometry, dtype)
    layer.winograd = False
    run_both(layer, x)


@pytest.fixture
def always_winograd(monkeypatch):
    monkeypatch.setattr(conv_module, "WINOGRAD_MACS", 0)
    monkeypatch.setattr(conv_module, "WINOGRAD_TILES_PER_CHANNEL", 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", WINOGRAD)
def test_conv_winograd(geometry, dtype, always_winograd):
    layer, x = conv(geometry, dtype)
    assert layer._use_winograd(x, (2, 1, 1))
    run_both(layer, x)


@pytest.mark.parametrize("geometry", CONVS[:3] + WINOGRAD[2:] + CONVS[-1:])
def test_conv_backward_adds_into_the_shortcut_gradient(geometry, always_winograd):
    """backward(dy, add_to=r) (a block's first convolution) is r + dx, whichever path."""
    layer, x = conv(geometry, np.float64)
    p = twin(layer)
    dy = rand(layer.forward(x).shape, seed=7)
    p.forward(x)
    r = rand(x.shape, seed=8)
    close(layer.backward(dy, add_to=r.copy()), r + p.backward(dy), "add_to + dx")


def test_conv_without_input_grad_still_gives_the_weight_gradient():
    layer, x = conv(CONVS[-1], np.float64, input_grad=False)
    p = twin(layer)
    p.forward(x)
    dy = rand(layer.forward(x).shape, seed=7)
    assert layer.backward(dy) is None
    p.backward(dy)
    close(layer.weight.grad, p.dW, "dW")


# ----- BatchNorm2d -----
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("shape,momentum", [((2, 5, 6, 16), 0.1), ((3, 1, 1, 4), 0.25)])
def test_batchnorm(shape, momentum, train, dtype):
    bn = bound(BatchNorm2d(shape[3], momentum=momentum), dtype)
    bn.running_mean.data[...] = rand(shape[3], seed=4)
    bn.running_var.data[...] = 0.5 + rand(shape[3], seed=5) ** 2
    before = bn.running_mean.data.copy(), bn.running_var.data.copy()
    (_, p), = run_both(bn, 2 + 3 * rand(shape, dtype, seed=1), train)
    close(bn.running_mean.data, p.running_mean, "running_mean")
    close(bn.running_var.data, p.running_var, "running_var")
    buffers = bn.running_mean.data, bn.running_var.data
    moved = [not np.array_equal(a, b) for a, b in zip(buffers, before)]
    assert moved == [train, train]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("train", [True, False])
def test_batchnorm_with_its_relu_fused_is_batchnorm_then_relu(train, dtype):
    bn = bound(BatchNorm2d(8, relu=True), dtype)
    pairs = run_both(bn, 1 + 2 * rand((2, 4, 5, 8), dtype, seed=1), train)
    assert isinstance(pairs[1][1], plain.ReLU) and (pairs[1][1].y == 0).mean() > 0.1


# ----- elementwise, pooling, linear, flatten -----
@pytest.mark.parametrize("dtype", DTYPES)
def test_relu(dtype):
    x = rand((2, 4, 5, 3), dtype, seed=1)
    x[0, 0, 0] = 0
    run_both(ReLU(), x)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout(dtype, train):
    """The same float32 uniforms from the same seed: the same mask, exactly."""
    fast, p = Dropout(0.3, seed=(1, 2)), plain.Dropout(0.3, seed=(1, 2))
    pairs = [(fast, p)]
    for _ in range(2):                  # a fresh mask each call, the same in both
        run_both(fast, rand((2, 3, 4, 5), dtype, seed=1), train, pairs=pairs)
    assert (p.mask == 0).any() == train


POOLS = [(2, None, 0), (3, 2, 1), (3, 1, 1), (3, 2, 0), (2, 1, 0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels", [3, 16])
@pytest.mark.parametrize("k,s,p", POOLS)
def test_max_pool(k, s, p, channels, dtype):
    run_both(MaxPool2d(k, s, p), rand((2, 7, 6, channels), dtype, seed=1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,s,p", POOLS)
def test_max_pool_nans_go_to_the_first_nan(k, s, p, dtype):
    """A NaN is above every number; of several in a window both send dy to the first."""
    x = np.random.default_rng(1).integers(0, 3, (2, 7, 6, 16)).astype(dtype)
    x[np.random.default_rng(2).random(x.shape) < 0.2] = np.nan
    fast, plain_pool = MaxPool2d(k, s, p), plain.MaxPool2d(k, s, p)
    y, y_plain = fast.forward(x.copy()), plain_pool.forward(x.copy())
    assert np.isnan(y).any() and not np.isnan(y).all()
    np.testing.assert_array_equal(y, y_plain)
    dy = rand(y.shape, dtype, seed=7)
    close(fast.backward(dy.copy()), plain_pool.backward(dy.copy()), "dx")   # sums' order


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,s,p", POOLS)
def test_max_pool_ties_go_to_the_first_maximum(k, s, p, dtype):
    """Values from {0, 1, 2}: most windows hold their maximum more than once; both send dy
    to the first in row-major window order."""
    x = np.random.default_rng(1).integers(0, 3, (2, 7, 6, 16)).astype(dtype)
    run_both(MaxPool2d(k, s, p), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_max_pool_sends_a_window_of_minus_inf_its_gradient_inside_x(dtype):
    """A window whose values are all -inf ties with the -inf padding: its dy goes to its
    first tap inside x, as PyTorch's (not to the padding, where it would be dropped)."""
    x = np.full((1, 3, 3, 1), -np.inf, dtype)
    x[0, 2, 2, 0] = 1
    fast, plain_pool = MaxPool2d(3, 2, 1), plain.MaxPool2d(3, 2, 1)
    y = plain_pool.forward(x)
    np.testing.assert_array_equal(y.ravel(), [-np.inf, -np.inf, -np.inf, 1])
    np.testing.assert_array_equal(fast.forward(x), y)
    dy = np.ones(y.shape, dtype)
    expect = np.array([1, 1, 0, 1, 0, 0, 0, 0, 1], dtype).reshape(x.shape)  # F.max_pool2d's
    np.testing.assert_array_equal(plain_pool.backward(dy), expect)
    np.testing.assert_array_equal(fast.backward(dy), expect)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels", [3, 16])
@pytest.mark.parametrize("k,s,p", POOLS)
def test_avg_pool(k, s, p, channels, dtype):
    run_both(AvgPool2d(k, s, p), rand((2, 7, 6, channels), dtype, seed=1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_global_avg_pool(dtype):
    run_both(GlobalAvgPool2d(), rand((2, 5, 7, 16), dtype, seed=1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hw,out", [((7, 5), (3, 2)), ((13, 13), (6, 6)), ((2, 2), (3, 3)),
                                    ((6, 6), (6, 6))])
def test_adaptive_avg_pool(hw, out, dtype):
    fast = AdaptiveAvgPool2d(out)
    run_both(fast, rand((2, *hw, 4), dtype, seed=1), pairs=[(fast, plain.AdaptiveAvgPool2d(out))])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("N", [2, 33])
def test_linear(N, bias, dtype):
    run_both(bound(Linear(24, 10, bias=bias), dtype), rand((N, 24), dtype, seed=1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_flatten(dtype):
    run_both(Flatten(), rand((2, 3, 4, 5), dtype, seed=1))


# ----- the loss -----
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_softmax_cross_entropy(smoothing, dtype):
    logits = 4 * rand((9, 7), dtype, seed=1)
    labels = np.random.default_rng(2).integers(0, 7, 9)
    loss, dlogits = softmax_cross_entropy(logits, labels, smoothing)
    loss_plain, dlogits_plain = plain.softmax_cross_entropy(logits, labels, smoothing)
    close(loss, loss_plain, "loss")
    close(dlogits, dlogits_plain, "dlogits")


# ----- the residual add: whole blocks, and a whole network -----
BLOCKS = [
    lambda: BasicBlock(16, 16),
    lambda: BasicBlock(8, 16, 2, Sequential(Conv2d(8, 16, 1, stride=2), BatchNorm2d(16))),
    lambda: Bottleneck(16, 4),
    lambda: Bottleneck(8, 4, 2, Sequential(Conv2d(8, 16, 1, stride=2), BatchNorm2d(16))),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("make", BLOCKS,
                         ids=["basic", "basic-down", "bottleneck", "bottleneck-down"])
def test_residual_block(make, dtype, always_winograd):
    """A fast block (ReLUs fused into BatchNorm, the add and its ReLU into the last
    BatchNorm, the two branches' dx summed inside the first convolution) against
    plain.ResidualBlock of plain layers."""
    block = bound(make(), dtype)
    x = rand((2, 6, 6, block.conv1.in_channels), dtype, seed=1)
    (_, p), = run_both(block, x, rtol=CHAIN_RTOL)
    assert (p.y == 0).any() and (p.y > 0).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_resnet_small_through_the_loss(dtype):
    """resnet_small and its plain twin: logits, loss, and the gradient of every one of its
    78,042 parameters."""
    model = build_model("resnet_small", num_classes=10, seed=5, dtype=dtype)
    bound(model, dtype, seed=5)
    pairs = twins(model)
    x = rand((4, 32, 32, 3), dtype, seed=1)
    labels = np.arange(4)
    logits = model.forward(x.copy())
    z = x.copy()
    for _, p in pairs:
        z = p.forward(z)
    close(logits, z, "logits", CHAIN_RTOL)
    loss, dz = softmax_cross_entropy(logits, labels, 0.1)
    loss_plain, dz_plain = plain.softmax_cross_entropy(z, labels, 0.1)
    close(loss, loss_plain, "loss", CHAIN_RTOL)
    model.backward(dz)
    for _, p in reversed(pairs):
        dz_plain = p.backward(dz_plain)
    grads = parameter_pairs(pairs)
    assert sum(g.size for _, g, _ in grads) == model.num_params() == 78042
    for name, g, g_plain in grads:
        close(g, g_plain, name, CHAIN_RTOL)


def test_alexnet_bn_with_dropout_through_the_loss():
    """AlexNet-BN at 63x63 (its feature maps 1x1 before the adaptive pool to 6x6) with
    dropout: the twins copy the dropout generators, so they draw the masks the fast
    layers draw. Its plain network takes every parameter's gradient in arena order."""
    model = bound(build_model("alexnet_bn", num_classes=10, seed=5), np.float32, seed=5)
    pairs = twins(model)
    assert sum(isinstance(p, plain.Dropout) for _, p in pairs) == 2
    run_both(model, rand((2, 63, 63, 3), np.float32, seed=1), pairs=pairs, rtol=CHAIN_RTOL)
    assert len(plain.PlainNetwork(model).pairs) == len(pairs)


def test_the_comparisons_fail_on_a_wrong_plain_layer():
    """The checks can fail: a kernel flipped (convolution instead of correlation), ties sent
    to the last maximum, a biased running variance (no M / (M - 1))."""
    layer, x = conv(CONVS[3], np.float64)
    p = twin(layer)
    p.W = p.W[:, ::-1, ::-1].copy()
    with pytest.raises(AssertionError, match="y: relative error"):
        run_both(layer, x, pairs=[(layer, p)])

    class LastMaximum(plain.MaxPool2d):
        def forward(self, x, train=True):
            y = super().forward(x, train)
            win = plain.im2col(x, self.k, self.stride, self.padding, -np.inf)
            win = win.reshape(y.shape[:3] + (-1, x.shape[3]))[:, :, :, ::-1]
            self.arg = win.shape[3] - 1 - win.argmax(axis=3)
            return y
    pool = MaxPool2d(3, 2, 1)
    x = np.random.default_rng(1).integers(0, 3, (2, 7, 6, 16)).astype(np.float64)
    with pytest.raises(AssertionError, match="dx: relative error"):
        run_both(pool, x, pairs=[(pool, LastMaximum(3, 2, 1))])

    bn = bound(BatchNorm2d(4), np.float64)
    p = twin(bn)
    x = rand((2, 3, 3, 4), seed=1)
    bn.forward(x)
    p.forward(x)
    M = x.size // 4
    p.running_var = p.running_var - 0.1 * x.var(axis=(0, 1, 2)) * (M / (M - 1) - 1)
    with pytest.raises(AssertionError, match="running_var"):
        close(bn.running_var.data, p.running_var, "running_var")
