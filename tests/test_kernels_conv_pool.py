"""im2col/col2im and pooling kernels against their generic references; Conv2d and the
pooling layers against finite differences and PyTorch."""
import numpy as np
import pytest

from gradcheck import assert_close, check_layer
from mpitrain.kernels import cudnn, pool
from mpitrain.kernels.im2col import col2im, col2im_generic, im2col, im2col_generic
from mpitrain.nets import conv as conv_module
from mpitrain.nets.conv import Conv2d
from mpitrain.nets.pool import AdaptiveAvgPool2d, AvgPool2d, GlobalAvgPool2d, MaxPool2d

# (N, H, W, C, k, stride, pad): odd sizes, strides that do not divide, padding wider than needed
GEOMETRIES = [
    (2, 7, 9, 3, 3, 1, 1),
    (2, 9, 8, 3, 3, 2, 1),
    (1, 5, 6, 2, 5, 1, 2),
    (2, 9, 9, 3, 7, 2, 3),
    (2, 4, 5, 3, 3, 1, 2),
    (1, 6, 5, 3, 1, 2, 0),
    (2, 8, 8, 1, 2, 2, 0),
    (1, 3, 3, 2, 3, 3, 0),
]


def rand(shape, dtype=np.float64, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# ----- im2col / col2im -----
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("N,H,W,C,k,s,p", GEOMETRIES)
def test_im2col_matches_generic(N, H, W, C, k, s, p, dtype):
    x = rand((N, H, W, C), dtype)
    col = im2col(x, k, k, s, p)
    assert col.dtype == dtype
    np.testing.assert_array_equal(col, im2col_generic(x, k, k, s, p))


def test_im2col_rectangular_kernel_and_buffer_reuse():
    x = rand((2, 6, 7, 3))
    buf = np.full((2 * 4 * 5, 3 * 3 * 3), np.nan)
    col = im2col(x, 3, 3, 1, 0, out=buf)
    assert col is buf
    np.testing.assert_array_equal(col, im2col_generic(x, 3, 3, 1, 0))
    np.testing.assert_array_equal(im2col(x, 2, 4, 2, 1), im2col_generic(x, 2, 4, 2, 1))


def test_im2col_known_values():
    # one 3x3 image, 2x2 kernel, padding 1, stride 2 -> 2x2 output positions
    x = np.arange(1.0, 10.0).reshape(1, 3, 3, 1)
    col = im2col(x, 2, 2, 2, 1)
    np.testing.assert_array_equal(col, [[0, 0, 0, 1], [0, 0, 2, 3], [0, 4, 0, 7], [5, 6, 8, 9]])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N,H,W,C,k,s,p", GEOMETRIES)
def test_col2im_matches_generic(N, H, W, C, k, s, p, dtype):
    Ho, Wo = (H + 2 * p - k) // s + 1, (W + 2 * p - k) // s + 1
    col = rand((N * Ho * Wo, k * k * C), dtype, seed=1)
    dx = col2im(col, (N, H, W, C), k, k, s, p)
    assert dx.dtype == dtype and dx.shape == (N, H, W, C)
    np.testing.assert_allclose(dx, col2im_generic(col, (N, H, W, C), k, k, s, p),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("N,H,W,C,k,s,p", GEOMETRIES)
def test_col2im_is_the_adjoint_of_im2col(N, H, W, C, k, s, p):
    x = rand((N, H, W, C))
    col = im2col(x, k, k, s, p)
    c = rand(col.shape, seed=2)
    lhs = np.vdot(col, c)
    rhs = np.vdot(x, col2im(c, x.shape, k, k, s, p))
    assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs))


def test_col2im_float16_sums_in_float32_and_rounds_once():
    col = rand((2 * 3 * 3, 9 * 2), np.float16)
    dx = col2im(col, (2, 5, 5, 2), 3, 3, 2, 1)
    assert dx.dtype == np.float16
    ref = col2im_generic(col.astype(np.float32), (2, 5, 5, 2), 3, 3, 2, 1)
    np.testing.assert_array_equal(dx, ref.astype(np.float16))


def integers(shape, dtype, seed):
    """Small whole numbers: every sum of a few of them is exact in any float dtype, so
    sums taken in another order must agree to the bit."""
    return np.random.default_rng(seed).integers(-8, 9, shape).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("N,H,W,C,k,s,p", GEOMETRIES)
def test_col2im_adds_into_a_given_array(N, H, W, C, k, s, p, dtype):
    """add_to: col2im's sums added into it and it returned (float32 and float64: the
    kernel's sums start from it; float16: summed in float32, rounded, then added)."""
    Ho, Wo = (H + 2 * p - k) // s + 1, (W + 2 * p - k) // s + 1
    col = integers((N * Ho * Wo, k * k * C), dtype, seed=1)
    base = integers((N, H, W, C), dtype, seed=2)
    into = base.copy()
    assert col2im(col, base.shape, k, k, s, p, add_to=into) is into
    np.testing.assert_array_equal(into, base + col2im(col, base.shape, k, k, s, p))


@pytest.mark.parametrize("N,H,W,C,k,s,p", GEOMETRIES)
def test_col2im_kernel_zeroes_what_it_sums_into_or_adds_to_it(N, H, W, C, k, s, p):
    """The Cython kernel on its own: with zero, whatever dx held (NaN here) is gone,
    pixels no column reaches included; without, its sums are added to dx."""
    from mpitrain.kernels import _im2col
    Ho, Wo = (H + 2 * p - k) // s + 1, (W + 2 * p - k) // s + 1
    col = integers((N * Ho * Wo, k * k * C), np.float32, seed=1)
    dx = np.full((N, H, W, C), np.nan, np.float32)
    _im2col.col2im(col, k, k, s, p, dx, True)
    np.testing.assert_array_equal(dx, col2im_generic(col, dx.shape, k, k, s, p))
    base = integers(dx.shape, np.float32, seed=2)
    dx = base.copy()
    _im2col.col2im(col, k, k, s, p, dx, False)
    np.testing.assert_array_equal(dx, base + col2im_generic(col, dx.shape, k, k, s, p))


# ----- pooling kernels -----
POOLS = [(2, 7, 9, 3, 3, 2, 1), (2, 8, 8, 3, 2, 2, 0), (1, 5, 6, 2, 3, 1, 1), (2, 9, 9, 3, 5, 3, 2)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N,H,W,C,k,s,p", POOLS)
def test_pool_kernels_match_generic(N, H, W, C, k, s, p, dtype):
    x = rand((N, H, W, C), dtype)
    y, arg = pool.max_pool_forward(x, k, s, p)
    y_ref, arg_ref = pool.max_pool_forward_generic(x, k, s, p)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(arg, arg_ref)
    assert arg.dtype == np.int32 and y.dtype == dtype
    dy = rand(y.shape, dtype, seed=3)
    tol = dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pool.max_pool_backward(dy, arg, x.shape, k, s, p),
                               pool.max_pool_backward_generic(dy, arg, x.shape, k, s, p), **tol)
    np.testing.assert_allclose(pool.avg_pool_forward(x, k, s, p),
                               pool.avg_pool_forward_generic(x, k, s, p), **tol)
    np.testing.assert_allclose(pool.avg_pool_backward(dy, x.shape, k, s, p),
                               pool.avg_pool_backward_generic(dy, x.shape, k, s, p), **tol)


def test_max_pool_ties_pick_the_first_and_float16_is_exact():
    x = np.zeros((1, 4, 4, 1), np.float16)
    y, arg = pool.max_pool_forward(x, 2, 2)
    np.testing.assert_array_equal(arg[0, :, :, 0], [[0, 2], [8, 10]])
    x = rand((2, 6, 6, 3), np.float16)
    y, arg = pool.max_pool_forward(x, 3, 2, 1)
    assert y.dtype == np.float16
    np.testing.assert_array_equal(y, pool.max_pool_forward_generic(x, 3, 2, 1)[0])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_max_pool_takes_the_first_nan(dtype):
    """A NaN is above every number, and of two NaNs in a window the first is the argmax,
    as the generic version's argmax (and the plain layer) takes it."""
    x = rand((2, 6, 6, 3), dtype)
    x[0, 1, 1, 0] = x[0, 1, 2, 0] = x[0, 2, 1, 0] = np.nan    # several windows of 3 x 3
    x[1, 0, 0, 2] = np.nan                                    # a corner, under padding
    x[1, 4, 5, 1] = -np.inf
    for k, s, p in ((3, 1, 1), (3, 2, 1), (2, 2, 0)):
        y, arg = pool.max_pool_forward(x, k, s, p)
        y_ref, arg_ref = pool.max_pool_forward_generic(x, k, s, p)
        assert np.isnan(y).any()
        np.testing.assert_array_equal(y, y_ref)
        np.testing.assert_array_equal(arg, arg_ref)


@pytest.mark.parametrize("k,s,p", [(3, 2, 1), (3, 1, 1), (2, 2, 0)])
def test_a_max_pool_window_of_minus_infinity_takes_its_first_pixel_as_pytorch(k, s, p):
    """A window whose pixels are all -inf has its argmax on the first of them, as the
    kernels and PyTorch take it; the generic version's once lay in the padding, so its
    gradient went nowhere (or to another window's pixel)."""
    torch = pytest.importorskip("torch")
    x = np.full((1, 3, 3, 2), -np.inf, np.float64)
    x[0, 2, 2, 0] = 1.0
    x[0, 1, 0, 1] = np.nan
    y, arg = pool.max_pool_forward(x, k, s, p)
    y_ref, arg_ref = pool.max_pool_forward_generic(x, k, s, p)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(arg, arg_ref)
    dy = rand(y.shape, np.float64, seed=5)
    dx_ref = pool.max_pool_backward_generic(dy, arg_ref, x.shape, k, s, p)
    xt = torch.tensor(x[..., :1].transpose(0, 3, 1, 2), requires_grad=True)  # NaN-free
    torch.nn.functional.max_pool2d(xt, k, s, p).backward(
        torch.tensor(dy[..., :1].transpose(0, 3, 1, 2)))
    # the sums of overlapping windows' gradients may differ in their order: to rounding
    np.testing.assert_allclose(dx_ref[..., 0], xt.grad.numpy()[:, 0], rtol=1e-14, atol=0)
    np.testing.assert_allclose(pool.max_pool_backward(dy, arg, x.shape, k, s, p), dx_ref,
                               rtol=1e-14, atol=0)


def test_pool_rejects_padding_over_half_the_kernel():
    with pytest.raises(ValueError, match="padding"):
        pool.max_pool_forward(np.zeros((1, 4, 4, 1)), 2, 2, 2)


# ----- Conv2d -----
CONVS = [  # (N, H, W, Cin, Cout, k, stride, pad)
    (2, 5, 6, 3, 2, 3, 1, 1),
    (2, 7, 9, 2, 3, 3, 2, 1),
    (1, 6, 5, 2, 2, 5, 1, 2),
    (2, 4, 5, 3, 4, 1, 1, 0),
    (2, 7, 5, 3, 2, 1, 2, 0),
    (1, 9, 9, 3, 2, 7, 2, 3),
]


def bound_conv(Cin, Cout, k, s, p, bias, seed=0, **kw):
    conv = Conv2d(Cin, Cout, k, stride=s, padding=p, bias=bias)
    conv.bind(dtype=np.float64, seed=seed, **kw)
    if bias:   # a zero bias would not test the forward's bias term
        conv.bias.master[...] = rand(Cout, seed=5)
    return conv


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("N,H,W,Cin,Cout,k,s,p", CONVS)
def test_conv2d_gradients(N, H, W, Cin, Cout, k, s, p, bias):
    conv = bound_conv(Cin, Cout, k, s, p, bias)
    y = check_layer(conv, rand((N, H, W, Cin)), rtol=1e-6)
    assert y.shape == (N, (H + 2 * p - k) // s + 1, (W + 2 * p - k) // s + 1, Cout)


def test_conv2d_parameters_init_and_macs():
    conv = Conv2d(4, 8, 3, padding=1, bias=True).bind(seed=1)
    names = [(n, p.shape, p.decay, p.lars) for n, p in conv.named_params()]
    assert names == [("weight", (8, 3, 3, 4), True, True), ("bias", (8,), False, False)]
    assert np.all(conv.bias.master == 0)
    big = Conv2d(64, 256, 3).bind(seed=0)
    assert abs(big.weight.master.std() / np.sqrt(2.0 / (256 * 9)) - 1) < 0.02
    assert conv.macs((2, 5, 5, 4), (2, 5, 5, 8)) == 2 * 5 * 5 * 8 * 9 * 4
    with pytest.raises(ValueError, match="expects"):
        conv.forward(np.zeros((1, 5, 5, 3), np.float32))


def test_conv2d_layers_share_one_workspace_and_stay_correct():
    """Two layers, their calls interleaved as in a network (forward a, forward b, backward
    b, backward a), both filling the one im2col workspace: each step equals fresh layers,
    and the workspace is allocated once."""
    a, b = bound_conv(3, 4, 3, 1, 1, False), bound_conv(4, 5, 3, 2, 1, False)
    for step in range(3):
        x, dz = rand((2, 7, 7, 3), seed=10 + step), rand((2, 4, 4, 5), seed=20 + step)
        fa, fb = bound_conv(3, 4, 3, 1, 1, False), bound_conv(4, 5, 3, 2, 1, False)
        z = b.forward(a.forward(x))
        dx = a.backward(b.backward(dz))
        assert a.x is None and b.x is None              # nothing held after backward
        np.testing.assert_array_equal(z, fb.forward(fa.forward(x)))
        np.testing.assert_array_equal(dx, fa.backward(fb.backward(dz)))
        for layer, fresh in ((a, fa), (b, fb)):
            np.testing.assert_array_equal(layer.weight.grad, fresh.weight.grad)
        buffer = conv_module._WORKSPACE["numpy"]
        if step:
            assert buffer is previous
        previous = buffer


@pytest.mark.parametrize("k,s,p", [(3, 1, 1), (3, 2, 1), (1, 2, 0)])
def test_conv2d_float16_is_the_float32_product_rounded_once(k, s, p):
    """fp16 working weights and activations on the CPU: every GEMM multiplies the fp16
    values in fp32 and rounds the product to fp16 once (the bias added in fp16; dx's
    product kept in fp32 through col2im, rounded once after it); the weight gradient is
    the fp32 product itself, in the fp32 arena."""
    N, H, W, Cin, Cout = 2, 6, 6, 3, 4
    half = Conv2d(Cin, Cout, k, stride=s, padding=p, bias=True).bind(
        dtype=np.float32, working_dtype=np.float16)
    x = rand((N, H, W, Cin)).astype(np.float16)
    y = half.forward(x)
    dy = rand(y.shape, seed=1).astype(np.float16)
    dx = half.backward(dy)
    assert y.dtype == dx.dtype == np.float16 and half.weight.grad.dtype == np.float32
    f32 = np.float32
    w = half.weight.data.reshape(Cout, -1).astype(f32)              # the fp16 weights, exactly
    col = im2col(x.astype(f32), k, k, s, p)
    dy2 = dy.reshape(-1, Cout).astype(f32)
    np.testing.assert_array_equal(
        y, (col @ w.T).astype(np.float16).reshape(y.shape) + half.bias.data)
    np.testing.assert_array_equal(half.weight.grad.reshape(Cout, -1), dy2.T @ col)
    np.testing.assert_allclose(half.bias.grad, dy2.sum(axis=0), rtol=1e-6)    # a sum, not a GEMM
    dcol = dy2 @ w                      # fp32 through col2im; dx rounded once
    np.testing.assert_array_equal(dx, col2im(dcol, x.shape, k, k, s, p).astype(np.float16))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("k,s,p", [(1, 1, 0), (1, 2, 0), (3, 1, 1), (3, 2, 1)])
def test_conv2d_adds_its_input_gradient_into_add_to(k, s, p, dtype):
    """backward(dy, add_to): add_to + dx, written into add_to and returned, the weight
    gradient unchanged. Whole-number inputs and weights make every sum exact, so the
    sums inside the GEMM (beta = 1) or col2im agree with a separate add to the bit; the
    1x1 layer of stride 1 has 2^21 multiply-adds, enough for the team's GEMM."""
    N, H, W, C, O = 2, 16, 16, 64, 64
    working = np.float16 if dtype == np.float16 else None
    layers = []
    for _ in range(2):
        conv = Conv2d(C, O, k, stride=s, padding=p).bind(
            dtype=np.float32 if working else dtype, working_dtype=working, seed=0)
        conv.weight.master[...] = integers(conv.weight.shape, np.float32, seed=3) / 8
        conv.arena.sync_working()
        layers.append(conv)
    x = integers((N, H, W, C), dtype, seed=4) / 4
    dy = integers(layers[0].forward(x).shape, dtype, seed=5) / 4
    layers[1].forward(x)
    dx = layers[0].backward(dy)
    base = integers(x.shape, dtype, seed=6)
    into = base.copy()
    assert layers[1].backward(dy, add_to=into) is into
    np.testing.assert_array_equal(into, base + dx)
    np.testing.assert_array_equal(layers[1].weight.grad, layers[0].weight.grad)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("k,s,p,H,winograd", [(7, 2, 3, 11, False), (3, 1, 1, 12, True),
                                              (3, 2, 1, 9, False), (1, 1, 0, 6, False),
                                              (1, 2, 0, 7, False)])
def test_a_first_convolution_on_zero_padded_channels_gives_the_same_bits(
        k, s, p, H, winograd, dtype, monkeypatch):
    """pad_to=4 on a layer without input gradient (a network's first convolution): x and W
    zero-padded from 3 channels to 4, y the same sum with zero terms, and the arena's dW
    (3 channels) the padded dW's first 3. Whole numbers make every sum exact, so the bits
    are those of the unpadded layer, on every CPU path (im2col, Winograd, pointwise)."""
    from mpitrain.kernels.elementwise import zero_padded
    if winograd:
        monkeypatch.setattr(conv_module, "WINOGRAD_MACS", 0)
        monkeypatch.setattr(conv_module, "WINOGRAD_TILES_PER_CHANNEL", 0)
    working = np.float16 if dtype == np.float16 else None
    layers = []
    for pad_to in (None, 4):
        conv = Conv2d(3, 8, k, stride=s, padding=p, bias=True, input_grad=False).bind(
            dtype=np.float32 if working else dtype, working_dtype=working, seed=0)
        conv.weight.master[...] = integers(conv.weight.shape, np.float32, seed=3) / 8
        conv.bias.master[...] = integers(8, np.float32, seed=7)
        conv.arena.sync_working()
        conv.pad_to = pad_to
        layers.append(conv)
    plain, padded = layers
    assert plain._use_winograd(np.empty(0), (2, H, H)) == winograd
    x = integers((2, H, H + 1, 3), dtype, seed=4) / 4
    y = plain.forward(x)
    np.testing.assert_array_equal(padded.forward(x), y)
    assert (plain.channels, padded.channels) == (3, 4)
    dy = integers(y.shape, dtype, seed=5) / 4
    assert plain.backward(dy) is None and padded.backward(dy) is None
    assert padded.weight.grad.shape == (8, k, k, 3)
    np.testing.assert_array_equal(padded.weight.grad, plain.weight.grad)
    np.testing.assert_array_equal(padded.bias.grad, plain.bias.grad)
    assert zero_padded(x, 3) is x
    np.testing.assert_array_equal(zero_padded(x, 5)[..., 3:], 0)
    inner = Conv2d(3, 8, k, stride=s, padding=p).bind(seed=0)    # dx wanted: never padded
    inner.pad_to = 4
    inner.forward(x.astype(np.float64))
    assert inner.channels == 3


# ----- pooling layers -----
@pytest.mark.parametrize("k,s,p,shape", [(3, 2, 1, (2, 7, 9, 3)), (2, None, 0, (2, 6, 8, 2)),
                                         (3, 1, 1, (1, 5, 5, 2))])
def test_max_pool_gradients(k, s, p, shape):
    check_layer(MaxPool2d(k, s, p), rand(shape))


@pytest.mark.parametrize("k,s,p,shape", [(3, 2, 1, (2, 7, 9, 3)), (2, None, 0, (2, 6, 8, 2))])
def test_avg_pool_gradients(k, s, p, shape):
    check_layer(AvgPool2d(k, s, p), rand(shape))


@pytest.mark.parametrize("shape,out", [((2, 7, 5, 3), (3, 2)), ((2, 1, 1, 3), 6),
                                       ((1, 2, 3, 2), (5, 4)), ((2, 4, 4, 2), 4)])
def test_adaptive_avg_pool_gradients(shape, out):
    layer = AdaptiveAvgPool2d(out)
    y = check_layer(layer, rand(shape))
    assert y.shape[1:3] == ((out, out) if np.isscalar(out) else out)


def test_adaptive_avg_pool_bins_and_identity():
    x = rand((1, 1, 1, 2))
    y = AdaptiveAvgPool2d(6).forward(x)
    np.testing.assert_array_equal(y, np.broadcast_to(x, (1, 6, 6, 2)))   # 1x1 -> 6x6 repeats
    x = rand((1, 4, 4, 2))
    np.testing.assert_allclose(AdaptiveAvgPool2d(2).forward(x), pool.avg_pool_forward(x, 2, 2))
    assert AdaptiveAvgPool2d((4, 4)).forward(x) is x


def within_half_ulp(fp16, exact):
    """Each fp16 value within half a unit in the last place of the float64 result (plus the
    fp32 sum's own rounding): the result rounded once."""
    ulp = np.spacing(np.abs(exact).astype(np.float16)).astype(np.float64)
    return np.abs(fp16.astype(np.float64) - exact) <= 0.5 * ulp + 1e-6 * np.abs(exact)


@pytest.mark.parametrize("hw,out", [((13, 13), (6, 6)), ((100, 7), (6, 3))])
def test_adaptive_avg_pool_rounds_fp16_once(hw, out):
    """fp16 averaged through fp16 bin weights (1/3 as 0.3333) and fp16 partial sums was off by
    several units in the last place; summed in fp32, forward and backward are rounded once."""
    x = rand((2, *hw, 3), np.float16, seed=2)
    exact = AdaptiveAvgPool2d(out)
    y64 = exact.forward(x.astype(np.float64))
    layer = AdaptiveAvgPool2d(out)
    y = layer.forward(x)
    assert y.dtype == np.float16 and within_half_ulp(y, y64).all()
    dy = rand(y.shape, np.float16, seed=3)
    dx = layer.backward(dy)
    assert dx.dtype == np.float16
    assert within_half_ulp(dx, exact.backward(dy.astype(np.float64))).all()


def test_global_avg_pool_gradients():
    y = check_layer(GlobalAvgPool2d(), rand((2, 3, 5, 3)))
    assert y.shape == (2, 3)


# ----- PyTorch -----
def nchw(a):
    import torch
    return torch.tensor(np.ascontiguousarray(a.transpose(0, 3, 1, 2)), requires_grad=True)


def nhwc(t):
    return t.detach().numpy().transpose(0, 2, 3, 1)


@pytest.mark.torch
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("N,H,W,Cin,Cout,k,s,p", CONVS)
def test_conv2d_matches_torch(N, H, W, Cin, Cout, k, s, p, bias):
    import torch
    conv = bound_conv(Cin, Cout, k, s, p, bias)
    x = rand((N, H, W, Cin))
    y = conv.forward(x)
    dy = rand(y.shape, seed=1)
    dx = conv.backward(dy)
    xt, wt = nchw(x), nchw(conv.weight.master)     # OHWI -> OIHW is the same permutation
    bt = torch.tensor(conv.bias.master, requires_grad=True) if bias else None
    yt = torch.nn.functional.conv2d(xt, wt, bt, stride=s, padding=p)
    yt.backward(torch.tensor(np.ascontiguousarray(dy.transpose(0, 3, 1, 2))))
    np.testing.assert_allclose(y, nhwc(yt), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx, nhwc(xt.grad), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(conv.weight.grad, nhwc(wt.grad), rtol=1e-12, atol=1e-12)
    if bias:
        np.testing.assert_allclose(conv.bias.grad, bt.grad.numpy(), rtol=1e-12, atol=1e-12)


def _torch_pool_case(layer, torch_fn, x):
    import torch
    y = layer.forward(x)
    dy = rand(y.shape, seed=1)
    dx = layer.backward(dy)
    xt = nchw(x)
    yt = torch_fn(xt)
    yt.backward(torch.tensor(np.ascontiguousarray(dy.transpose(0, 3, 1, 2))))
    np.testing.assert_allclose(y, nhwc(yt), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx, nhwc(xt.grad), rtol=1e-12, atol=1e-12)


@pytest.mark.torch
@pytest.mark.parametrize("k,s,p", [(3, 2, 1), (2, 2, 0), (3, 1, 1), (5, 3, 2)])
def test_pools_match_torch(k, s, p):
    import torch.nn.functional as F
    x = rand((2, 9, 8, 3))
    _torch_pool_case(MaxPool2d(k, s, p), lambda t: F.max_pool2d(t, k, s, p), x)
    _torch_pool_case(AvgPool2d(k, s, p), lambda t: F.avg_pool2d(t, k, s, p), x)


@pytest.mark.torch
@pytest.mark.parametrize("shape,out", [((2, 7, 5, 3), (3, 2)), ((2, 1, 1, 3), (6, 6)),
                                       ((1, 5, 7, 2), (6, 6)), ((2, 6, 6, 2), (6, 6))])
def test_adaptive_avg_pool_matches_torch(shape, out):
    import torch.nn.functional as F
    _torch_pool_case(AdaptiveAvgPool2d(out), lambda t: F.adaptive_avg_pool2d(t, out), rand(shape))


# ----- GPU -----
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("k,s,p", [(3, 1, 1), (3, 2, 1), (1, 1, 0), (1, 2, 0), (7, 2, 3)])
def test_conv2d_on_cupy_matches_numpy(k, s, p, dtype, monkeypatch):
    """float64 takes the generic im2col + cuBLAS path; float32 takes cuDNN where it is
    available, without TF32 here, so both sides compute in fp32."""
    import cupy
    monkeypatch.setattr(cudnn, "TF32", False)
    cpu = Conv2d(3, 8, k, stride=s, padding=p, bias=True).bind(dtype=dtype, seed=3)
    gpu = Conv2d(3, 8, k, stride=s, padding=p, bias=True).bind(dtype=dtype, seed=3, xp=cupy)
    x = rand((2, 11, 10, 3), dtype)
    y = cpu.forward(x)
    dy = rand(y.shape, dtype, seed=1)
    dx = cpu.backward(dy)
    y_g = gpu.forward(cupy.asarray(x))
    dx_g = gpu.backward(cupy.asarray(dy))
    tol = 1e-12 if dtype == np.float64 else 1e-5
    assert_close(cupy.asnumpy(y_g), y, tol, 1e-8, "y")
    assert_close(cupy.asnumpy(dx_g), dx, tol, 1e-8, "dx")
    assert_close(cupy.asnumpy(gpu.weight.grad), cpu.weight.grad, tol, 1e-8, "dW")
    assert_close(cupy.asnumpy(gpu.bias.grad), cpu.bias.grad, tol, 1e-8, "db")


# ----- cuDNN: availability is probed; fp16 weight gradients in the fp32 arena -----
def probe_case_conv(x, w, stride, pad):
    """What cuDNN's fprop computes, on NumPy arrays in their own dtype (for a fake)."""
    N, H, W, C = x.shape
    O, k = w.shape[0], w.shape[1]
    col = im2col_generic(x.astype(np.float64), k, k, stride, pad)
    return (col @ w.reshape(O, -1).astype(np.float64).T).reshape(N, H, W, O).astype(x.dtype)


@pytest.fixture
def fresh_probe(monkeypatch):
    """The cuDNN adapter with its probe not yet run and its convolutions computed on the
    host; returns fake(gpu=..., cc=..., frontend=...), which installs host stand-ins for
    CuPy and the frontend (frontend=False: the frontend does not import)."""
    import sys
    import types
    monkeypatch.setattr(cudnn, "_probe", None)
    monkeypatch.setattr(cudnn, "conv_forward", probe_case_conv)

    def fake(gpu=True, cc="90", frontend=True):
        device = types.SimpleNamespace(compute_capability=cc)
        monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
            is_available=lambda: gpu, asarray=lambda a, dtype=None: np.asarray(a, dtype),
            asnumpy=np.asarray, empty=np.empty, cuda=types.SimpleNamespace(Device=lambda: device)))
        monkeypatch.setitem(sys.modules, "cudnn", types.SimpleNamespace(
            __version__="1.23.0", backend_version=lambda: 91300) if frontend else None)
    return fake


def test_cudnn_probe_reasons_when_something_is_missing(fresh_probe, monkeypatch):
    import sys
    fake = fresh_probe
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert not cudnn.available() and not cudnn.available(np.float16)
    assert cudnn.reason().startswith("not installed: CuPy")
    rep = cudnn.report()
    assert rep["available"] is False and rep["reason"] == cudnn.reason()
    for setup, start in [(dict(gpu=False), "no GPU:"),
                         (dict(frontend=False), "not installed: nvidia-cudnn-frontend")]:
        cudnn._probe = None
        fake(**setup)
        assert not cudnn.available() and cudnn.reason().startswith(start), cudnn.reason()
    assert cudnn.version() == {"cudnn": None, "cudnn_frontend": None}


@pytest.mark.parametrize("failure,start", [
    ("build", "graph build failed: float32 convolution"),
    ("run", "failed to run: float32 convolution: RuntimeError"),
    ("wrong", "wrong result: float32 convolution")])
def test_cudnn_probe_reasons_when_the_tiny_convolution_fails(fresh_probe, monkeypatch, failure,
                                                             start):
    fake = fresh_probe
    fake()

    def broken(x, w, stride, pad):
        if failure == "build":
            raise cudnn.Unsupported("no engine")
        if failure == "run":
            raise RuntimeError("launch failed")
        return probe_case_conv(x, w, stride, pad) + 1
    monkeypatch.setattr(cudnn, "conv_forward", broken)
    assert not cudnn.available()
    assert cudnn.reason().startswith(start), cudnn.reason()
    assert not cudnn.available(np.float16) and cudnn.report()["float16_reason"] == cudnn.reason()


def test_cudnn_probe_passes_once_and_reports_versions(fresh_probe, monkeypatch):
    fake = fresh_probe
    fake()
    calls = []
    monkeypatch.setattr(cudnn, "conv_forward",
                        lambda x, *a: calls.append(x.dtype) or probe_case_conv(x, *a))
    for _ in range(3):
        assert cudnn.available() and cudnn.available(np.float16) and cudnn.reason() is None
    assert calls == [np.float32, np.float16]            # built and run once per dtype
    assert not cudnn.available(np.float64)
    assert cudnn.report() == dict(available=True, reason=None, float16=True, float16_reason=None,
                                  cudnn=91300, cudnn_frontend="1.23.0")


def test_cudnn_probe_without_fp16(fresh_probe):
    fresh_probe(cc="52")
    assert cudnn.available() and not cudnn.available(np.float16)
    assert cudnn.report()["float16_reason"].startswith("no GPU: the device has no fp16")


def test_cudnn_weight_gradient_is_written_in_its_dtype_or_fp32_only():
    x, dy = np.zeros((1, 5, 5, 3), np.float16), np.zeros((1, 5, 5, 4), np.float16)
    with pytest.raises(cudnn.Unsupported, match="only an fp32 output"):
        cudnn.conv_backward_filter(x, dy, (4, 3, 3, 3), 1, 1,
                                   out=np.empty((4, 3, 3, 3), np.float64))


@pytest.mark.gpu
def test_cudnn_probe_on_the_gpu():
    rep = cudnn.report()
    if rep["reason"] and rep["reason"].startswith("not installed"):
        pytest.skip(rep["reason"])
    assert rep["available"] and rep["reason"] is None and rep["float16"], rep
    assert isinstance(rep["cudnn"], int) and isinstance(rep["cudnn_frontend"], str)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["cudnn", "cudnn forward, GEMM wgrad", "generic"])
def test_conv2d_fp16_weight_gradient_at_loss_scale_2_16(path, monkeypatch):
    """dW of fp16 x and dy (scaled by 2^16) in the fp32 arena. cuDNN computes it in fp16
    (fp32 sums, rounded once): what exceeds 65504 is inf, for the overflow check to see;
    the GEMM paths sum into fp32 and stay finite. Both equal the float64 product."""
    import cupy
    if path != "generic" and not cudnn.available(np.float16):
        pytest.skip(f"cuDNN fp16: {cudnn.report()['float16_reason']}")
    if path == "generic":
        monkeypatch.setattr(cudnn, "available", lambda dtype=np.float32: False)
    elif path != "cudnn":
        def unsupported(*a, **k):
            raise cudnn.Unsupported("as if cuDNN had no engine for this geometry")
        monkeypatch.setattr(cudnn, "conv_backward_filter", unsupported)
    conv = Conv2d(16, 32, 3, padding=1).bind(dtype=np.float32, working_dtype=np.float16, xp=cupy)
    x = rand((8, 16, 16, 16), np.float16)
    y = conv.forward(cupy.asarray(x))
    dy = (2.0 ** 16 * 0.01 * rand(y.shape, seed=1)).astype(np.float16)
    dx = conv.backward(cupy.asarray(dy))
    ref = (dy.reshape(-1, 32).astype(np.float64).T
           @ im2col(x.astype(np.float64), 3, 3, 1, 1)).reshape(32, 3, 3, 16)
    big = np.abs(ref) > 65504
    assert big.any() and not big.all()
    gw = cupy.asnumpy(conv.weight.grad)
    assert gw.dtype == np.float32
    if path == "cudnn":
        assert np.isinf(gw[big]).all() and np.isfinite(gw[~big]).all()
        assert_close(gw[~big].astype(np.float64), ref[~big], 2e-3, 1e-2, "dW")
    else:
        assert np.isfinite(gw).all()
        assert_close(gw.astype(np.float64), ref, 1e-4, 1e-6, "dW")
    assert dx.dtype == np.float16 and bool(cupy.isfinite(dx).all())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_a_first_convolution_on_the_gpu_pads_its_input_where_cudnn_times_it_faster(
        dtype, monkeypatch, tmp_path):
    """pad_to None on a GPU: cudnn.padded_channels times the convolution on 3 and on 4
    channels once, reports both and keeps the faster (on disk too); whichever it is, and
    pad_to=4, gives the unpadded layer's bits (whole numbers: exact sums)."""
    import cupy
    if not cudnn.available(dtype):
        pytest.skip(f"cuDNN {np.dtype(dtype).name}: {cudnn.report()}")
    monkeypatch.setattr(cudnn, "PLAN_CACHE", str(tmp_path / "plans.json"))
    monkeypatch.setattr(cudnn, "TF32", False)
    monkeypatch.setattr(cudnn, "_padding", {})
    x = cupy.asarray(integers((16, 32, 32, 3), dtype, seed=4) / 4)
    dy = cupy.asarray(integers((16, 16, 16, 16), dtype, seed=5) / 4)
    got = {}
    for pad_to in (3, None, 4):
        conv = Conv2d(3, 16, 7, stride=2, padding=3, input_grad=False).bind(
            dtype=np.float32, working_dtype=dtype if dtype == np.float16 else None, seed=0,
            xp=cupy)
        conv.weight.master[...] = cupy.asarray(integers(conv.weight.shape, np.float32, 3) / 8)
        conv.arena.sync_working()
        conv.pad_to = pad_to
        y = conv.forward(x)
        conv.backward(dy)
        got[pad_to] = conv.channels, cupy.asnumpy(y), cupy.asnumpy(conv.weight.grad)
    report, = cudnn.padding_report()
    assert report["x"] == [16, 32, 32, 3] and set(report["ms"]) == {3, 4}, report
    assert report["channels"] == got[None][0] == min(report["ms"], key=report["ms"].get)
    kept = [v for k, v in cudnn.load_plans().items() if k.startswith("pad|")]
    assert kept == [str(got[None][0])]
    assert got[3][0] == 3 and got[4][0] == 4
    for pad_to in (None, 4):
        np.testing.assert_array_equal(got[pad_to][1], got[3][1])
        np.testing.assert_array_equal(got[pad_to][2], got[3][2])


@pytest.mark.parametrize("k,s,p", [(3, 1, 1), (7, 2, 3), (1, 2, 0)])
def test_conv2d_without_input_gradient(k, s, p):
    """input_grad=False (a network's first convolution): the same weight and bias
    gradients, and no dx."""
    full = bound_conv(3, 4, k, s, p, True)
    first = bound_conv(3, 4, k, s, p, True)
    first.input_grad = False
    x = rand((2, 9, 9, 3))
    y = full.forward(x)
    np.testing.assert_array_equal(first.forward(x), y)
    dy = rand(y.shape, seed=1)
    assert full.backward(dy) is not None and first.backward(dy) is None
    np.testing.assert_array_equal(first.weight.grad, full.weight.grad)
    np.testing.assert_array_equal(first.bias.grad, full.bias.grad)
