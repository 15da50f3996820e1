"""im2col/col2im and pooling kernels against their generic references; Conv2d and the
pooling layers against finite differences and PyTorch."""
import numpy as np
import pytest

from gradcheck import assert_close, check_layer
from mpitrain.kernels import pool
from mpitrain.kernels.im2col import col2im, col2im_generic, im2col, im2col_generic
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


def test_conv2d_repeated_steps_reuse_the_buffer_and_stay_correct():
    conv = bound_conv(3, 4, 3, 1, 1, False)
    ref = bound_conv(3, 4, 3, 1, 1, False)
    for step in range(3):
        x, dy = rand((2, 5, 5, 3), seed=10 + step), rand((2, 5, 5, 4), seed=20 + step)
        y = conv.forward(x)
        buffer = conv.col
        dx = conv.backward(dy)
        ref.col = None            # a fresh layer state each step
        np.testing.assert_allclose(y, ref.forward(x), rtol=1e-13)
        np.testing.assert_allclose(dx, ref.backward(dy), rtol=1e-13)
        np.testing.assert_allclose(conv.weight.grad, ref.weight.grad, rtol=1e-13)
        if step:
            assert buffer is previous
        previous = buffer


@pytest.mark.parametrize("k,s,p", [(3, 1, 1), (3, 2, 1), (1, 2, 0)])
def test_conv2d_float16_is_the_float32_product_rounded_once(k, s, p):
    """fp16 working weights and activations on the CPU: every GEMM multiplies the fp16
    values in fp32 and rounds the product to fp16 once (the bias added in fp16, col2im
    summing in fp32); the weight gradient is the fp32 product itself, in the fp32 arena."""
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
    dcol = (dy2 @ w).astype(np.float16).astype(f32)
    np.testing.assert_array_equal(dx, col2im(dcol, x.shape, k, k, s, p).astype(np.float16))


# ----- pooling layers -----
@pytest.mark.parametrize("k,s,p,shape", [(3, 2, 1, (2, 7, 9, 3)), (2, None, 0, (2, 6, 8, 2)),
                                         (3, 1, 1, (1, 5, 5, 2))])
def test_max_pool_gradients(k, s, p, shape):
    check_layer(MaxPool2d(k, s, p), rand(shape))


@pytest.mark.parametrize("k,s,p,shape", [(3, 2, 1, (2, 7, 9, 3)), (2, None, 0, (2, 6, 8, 2))])
def test_avg_pool_gradients(k, s, p, shape):
    check_layer(AvgPool2d(k, s, p), rand(shape))


@pytest.mark.parametrize("shape,out", [((2, 7, 5, 3), (3, 2)), ((2, 1, 1, 3), 6), ((1, 2, 3, 2), (5, 4)),
                                       ((2, 4, 4, 2), 4)])
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
def test_conv2d_on_cupy_matches_numpy(k, s, p, dtype):
    """float64 takes the generic im2col + cuBLAS path; float32 takes cuDNN where it is available."""
    import cupy
    cpu = Conv2d(3, 8, k, stride=s, padding=p, bias=True).bind(dtype=dtype, seed=3)
    gpu = Conv2d(3, 8, k, stride=s, padding=p, bias=True).bind(dtype=dtype, seed=3, xp=cupy)
    x = rand((2, 11, 10, 3), dtype)
    y = cpu.forward(x)
    dy = rand(y.shape, dtype, seed=1)
    dx = cpu.backward(dy)
    y_g = gpu.forward(cupy.asarray(x))
    dx_g = gpu.backward(cupy.asarray(dy))
    tol = 1e-12 if dtype == np.float64 else 1e-2     # cuDNN may use TF32 in fp32
    assert_close(cupy.asnumpy(y_g), y, tol, 1e-8, "y")
    assert_close(cupy.asnumpy(dx_g), dx, tol, 1e-8, "dx")
    assert_close(cupy.asnumpy(gpu.weight.grad), cpu.weight.grad, tol, 1e-8, "dW")
    assert_close(cupy.asnumpy(gpu.bias.grad), cpu.bias.grad, tol, 1e-8, "db")
