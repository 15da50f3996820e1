"""Conv2d's Winograd F(2x2, 3x3) path (kernels/winograd.py) against the direct form
(im2col and one GEMM) in float64, finite differences, PyTorch, fp16, the bits at any
thread count, and when the layer takes it."""
import numba
import numpy as np
import pytest

from gradcheck import check_layer
from mpitrain.kernels import team
from mpitrain.nets import conv as conv_module
from mpitrain.nets.conv import Conv2d

# (N, H, W, Cin, Cout, pad): odd and even outputs, a 1x1 input, padding 0 and 2
GEOMETRIES = [
    (2, 5, 7, 3, 4, 1),
    (1, 6, 6, 5, 2, 0),
    (3, 8, 8, 16, 8, 1),
    (1, 1, 1, 2, 3, 1),
    (2, 4, 3, 3, 3, 2),
    (2, 13, 13, 4, 5, 1),
]


def rand(shape, dtype=np.float64, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.fixture
def always_winograd(monkeypatch):
    """Every 3x3 stride-1 convolution on Winograd's path, however small its GEMMs."""
    monkeypatch.setattr(conv_module, "WINOGRAD_MACS", 0)
    monkeypatch.setattr(conv_module, "WINOGRAD_TILES_PER_CHANNEL", 0)


def twins(Cin, Cout, p, dtype=np.float64, working_dtype=None, input_grad=True, bias=False):
    """(Winograd, direct): two 3x3 layers with the same weights (and a nonzero bias)."""
    layers = []
    for winograd in (True, False):
        layer = Conv2d(Cin, Cout, 3, padding=p, bias=bias, input_grad=input_grad)
        layer.bind(dtype=dtype, working_dtype=working_dtype, seed=3)
        if bias:
            layer.bias.master[...] = rand(Cout, seed=5)
        layer.winograd = winograd
        layers.append(layer)
    return layers


def step(layer, x, dy_seed=1):
    """(y, dx, dW) of one forward and backward with a random dy."""
    y = layer.forward(x)
    dx = layer.backward(rand(y.shape, x.dtype, seed=dy_seed))
    return y, dx, layer.weight.grad.copy()


def relative(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-300)


@pytest.mark.parametrize("N,H,W,Cin,Cout,p", GEOMETRIES)
def test_winograd_matches_the_direct_form_in_float64(N, H, W, Cin, Cout, p, always_winograd):
    fast, direct = twins(Cin, Cout, p)
    x = rand((N, H, W, Cin))
    for a, b, what in zip(step(fast, x), step(direct, x), ("y", "dx", "dW")):
        assert a.shape == b.shape, what
        assert relative(a, b) < 1e-13, what


@pytest.mark.parametrize("N,H,W,Cin,Cout,p", GEOMETRIES[:3])
def test_winograd_gradients(N, H, W, Cin, Cout, p, always_winograd):
    layer, _ = twins(Cin, Cout, p)
    check_layer(layer, rand((N, H, W, Cin), seed=4))


@pytest.mark.parametrize("N,H,W,Cin,Cout,p", GEOMETRIES)
def test_winograd_float32_and_fp16_against_float64(N, H, W, Cin, Cout, p, always_winograd):
    """float32 within float32's rounding of the float64 result; fp16 activations with
    fp32 master weights (training's mixed precision) within fp16's."""
    _, exact = twins(Cin, Cout, p)
    x = rand((N, H, W, Cin))
    for dtype, working, tol in ((np.float32, None, 2e-6), (np.float32, np.float16, 4e-3)):
        layer, _ = twins(Cin, Cout, p, dtype, working)
        layer.weight.data[...] = exact.weight.master          # rounded to the working dtype
        xd = x.astype(working or dtype)
        y, dx, dw = step(layer, xd)
        assert y.dtype == dx.dtype == xd.dtype and dw.dtype == np.float32
        expect = step(exact, xd.astype(np.float64))          # the same rounded input and dy
        for a, b, what in zip((y, dx, dw), expect, ("y", "dx", "dW")):
            assert relative(a, b) < tol, (dtype, working, what)


def test_winograd_layers_share_the_workspaces_and_stay_correct(always_winograd):
    """Two Winograd layers, their calls interleaved as in a network, both laying out their
    tiles, padded input and products on the shared scratch buffer: each step equals fresh
    layers'."""
    def pair():
        return twins(3, 4, 1)[0], twins(4, 5, 1)[0]
    a, b = pair()
    for i in range(2):
        x, dz = rand((2, 7, 7, 3), seed=10 + i), rand((2, 7, 7, 5), seed=20 + i)
        fa, fb = pair()
        z = b.forward(a.forward(x))
        dx = a.backward(b.backward(dz))
        np.testing.assert_array_equal(z, fb.forward(fa.forward(x)))
        np.testing.assert_array_equal(dx, fa.backward(fb.backward(dz)))
        for layer, fresh in ((a, fa), (b, fb)):
            np.testing.assert_array_equal(layer.weight.grad, fresh.weight.grad)


@pytest.mark.parametrize("working", [None, np.float16])
def test_convolutions_share_one_workspace_and_stay_correct(always_winograd, working):
    """A Winograd layer, an im2col layer (stride 2) and a Winograd layer again, their calls
    interleaved as in a network (forwards, then backwards in reverse), all on the one
    scratch buffer: each layer's y, dx and dW equal those of the same layer run alone on
    the same x and dy (forward then backward at once, nothing in between), and the buffer
    is not grown after the first step. fp16 adds im2col's fp32 dcol over its columns."""
    specs = ((3, 6, 1, True), (6, 5, 2, False), (5, 4, 1, True))     # Cin, Cout, stride, Winograd
    master = np.float64 if working is None else np.float32
    dtype = working or np.float64

    def layers():
        made = []
        for Cin, Cout, s, winograd in specs:
            layer = Conv2d(Cin, Cout, 3, stride=s, padding=1).bind(master, working, seed=Cin)
            layer.winograd = winograd
            made.append(layer)
        return made
    net, alone = layers(), layers()
    for i in range(3):
        xs = [rand((2, 9, 9, 3), dtype, seed=10 + i)]
        for layer in net:
            xs.append(layer.forward(xs[-1]))
        dys = [rand(xs[-1].shape, dtype, seed=20 + i)]
        for layer in reversed(net):
            dys.insert(0, layer.backward(dys[0]))
        for k, (layer, single) in enumerate(zip(net, alone)):
            np.testing.assert_array_equal(xs[k + 1], single.forward(xs[k]))
            np.testing.assert_array_equal(dys[k], single.backward(dys[k + 1]))
            np.testing.assert_array_equal(layer.weight.grad, single.weight.grad)
        buffer = conv_module._WORKSPACE["numpy"]
        if i:
            assert buffer is previous
        previous = buffer


@pytest.mark.parametrize("working", [None, np.float16])
def test_what_a_training_winograd_layer_keeps_for_backward(always_winograd, working):
    """Where its tiles have x's dtype, a layer in training keeps them (16, T, C), and its
    filter's tiles (O, 16, C), for backward, and not x; fp16 activations keep x in fp16
    instead, since its tiles are fp32 (activations are held once, in the working dtype).
    An eval forward keeps nothing, and backward lets go of everything."""
    layer = Conv2d(3, 4, 3, padding=1).bind(dtype=np.float32, working_dtype=working, seed=3)
    x = rand((2, 6, 6, 3), working or np.float32)
    layer.forward(x)
    if working is None:
        assert layer.x is None and layer.V.shape == (16, 2 * 3 * 3, 3)
        assert layer.V.dtype == np.float32
    else:
        assert layer.x is x and layer.V is None
    assert layer.U.shape == (4, 16, 3)
    layer.backward(rand((2, 6, 6, 4), x.dtype, seed=1))
    assert layer.x is None and layer.V is None and layer.U is None
    layer.forward(x, train=False)
    assert layer.x is None and layer.V is None and layer.U is None


def test_winograd_adds_its_input_gradient_into_add_to(always_winograd):
    """backward(dy, add_to): add_to + dx, in add_to, which it returns."""
    layer, again = twins(3, 4, 1, np.float32)[0], twins(3, 4, 1, np.float32)[0]
    x = rand((2, 5, 7, 3), np.float32)
    dy = rand(layer.forward(x).shape, np.float32, seed=1)
    again.forward(x)
    base = rand(x.shape, np.float32, seed=2)
    into = base.copy()
    assert again.backward(dy, add_to=into) is into
    np.testing.assert_array_equal(into, base + layer.backward(dy))


def test_winograd_with_a_bias(always_winograd):
    fast, direct = twins(3, 4, 1, bias=True)
    x = rand((2, 5, 6, 3))
    for a, b, what in zip(step(fast, x), step(direct, x), ("y", "dx", "dW")):
        assert relative(a, b) < 1e-13, what
    assert np.abs(fast.bias.grad).max() > 0
    np.testing.assert_allclose(fast.bias.grad, direct.bias.grad, rtol=1e-13)


def test_winograd_without_input_gradient(always_winograd):
    fast, direct = twins(3, 4, 1, input_grad=False)
    x = rand((2, 6, 6, 3))
    for layer in (fast, direct):
        layer.forward(x)
        assert layer.backward(rand((2, 6, 6, 4), seed=1)) is None
    assert relative(fast.weight.grad, direct.weight.grad) < 1e-13


def test_winograd_bits_do_not_depend_on_the_thread_count(always_winograd, monkeypatch):
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one Numba thread (NUMBA_NUM_THREADS=1): no second count to compare")
    monkeypatch.setattr(team, "PARALLEL_MIN_BYTES", 0)     # the team even on a small input
    x = rand((3, 10, 9, 8), np.float32)
    threads = numba.get_num_threads()
    results = []
    try:
        for n in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(n)
            layer, _ = twins(8, 6, 1, np.float32)
            results.append(step(layer, x))
    finally:
        numba.set_num_threads(threads)
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


@pytest.mark.torch
@pytest.mark.parametrize("N,H,W,Cin,Cout,p", GEOMETRIES[:3])
def test_winograd_matches_torch_in_float32(N, H, W, Cin, Cout, p, always_winograd):
    import torch
    layer, _ = twins(Cin, Cout, p, np.float32)
    x = rand((N, H, W, Cin), np.float32)
    y, dx, dw = step(layer, x)
    xt = torch.tensor(np.ascontiguousarray(x.transpose(0, 3, 1, 2)), requires_grad=True)
    wt = torch.tensor(np.ascontiguousarray(layer.weight.master.transpose(0, 3, 1, 2)),
                      requires_grad=True)
    yt = torch.nn.functional.conv2d(xt, wt, padding=p)
    dy = rand(y.shape, np.float32, seed=1)
    yt.backward(torch.tensor(np.ascontiguousarray(dy.transpose(0, 3, 1, 2))))
    for a, t in ((y, yt), (dx, xt.grad), (dw, wt.grad)):
        assert relative(a, t.detach().numpy().transpose(0, 2, 3, 1)) < 2e-6


def test_a_winograd_layer_logs_one_batched_gemm_per_product_at_the_direct_forms_flops(monkeypatch):
    """Forward, the filter gradient and dx are each one call over the 16 products
    (nets/conv.py batched_matmul), logged with their shapes and with the direct form's
    2 N Ho Wo O 9 C operations, as bench step's GFLOP/s count them."""
    monkeypatch.setattr(conv_module, "GEMM_LOG", [])
    monkeypatch.setattr(conv_module, "WINOGRAD_MACS", 0)
    monkeypatch.setattr(conv_module, "WINOGRAD_TILES_PER_CHANNEL", 0)
    N, H, C, O = 2, 8, 3, 5
    T = N * 4 * 4
    layer = Conv2d(C, O, 3, padding=1).bind(dtype=np.float32)
    x = rand((N, H, H, C), np.float32)
    y = layer.forward(x)
    layer.backward(rand(y.shape, np.float32, seed=1))
    log = conv_module.GEMM_LOG
    assert [(a, b) for a, b, _, _ in log] == [((16, T, C), (16, C, O)), ((16, O, T), (16, T, C)),
                                              ((16, T, O), (16, O, C))]
    assert [flops for _, _, _, flops in log] == [2.0 * layer.macs(x.shape, y.shape)] * 3


def test_the_layer_takes_winograd_where_its_gemms_are_large_and_its_tiles_many(monkeypatch):
    """16 GEMMs of (tiles, Cin) @ (Cin, Cout) with WINOGRAD_MACS multiply-adds each and
    WINOGRAD_TILES_PER_CHANNEL tiles per channel of the wider side, else the direct form's
    one GEMM on im2col's columns; never at stride 2."""
    monkeypatch.setattr(conv_module, "GEMM_LOG", [])
    N, H, C, O = 2, 8, 4, 6                      # 2 * 4 * 4 = 32 tiles
    direct = [(N * H * H, 9 * C)]
    cases = [(1, 32 * C * O, 32 / O, [(16, 32, C)]),
             (2, 32 * C * O, 32 / O, [(N * 4 * 4, 9 * C)]),
             (1, 32 * C * O + 1, 32 / O, direct),
             (1, 32 * C * O, 32 / O + 0.01, direct)]
    for stride, macs, per_channel, expect in cases:
        monkeypatch.setattr(conv_module, "WINOGRAD_MACS", macs)
        monkeypatch.setattr(conv_module, "WINOGRAD_TILES_PER_CHANNEL", per_channel)
        layer = Conv2d(C, O, 3, stride=stride, padding=1).bind(dtype=np.float32)
        layer.forward(rand((N, H, H, C), np.float32))
        assert [a for a, _, _, _ in conv_module.GEMM_LOG] == expect, (stride, macs, per_channel)
        conv_module.GEMM_LOG.clear()
    monkeypatch.setattr(conv_module, "WINOGRAD_MACS", 0)
    monkeypatch.setattr(conv_module, "WINOGRAD_TILES_PER_CHANNEL", 0)
    layer = Conv2d(C, O, 3, padding=1).bind(dtype=np.float32)
    layer.winograd = False
    layer.forward(rand((N, H, H, C), np.float32))
    assert [a for a, _, _, _ in conv_module.GEMM_LOG] == direct
