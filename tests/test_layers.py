"""BatchNorm2d, ReLU, Dropout, Linear, Flatten and the loss: finite differences in
float64, PyTorch where it is installed, and the fp16 contracts."""
import numpy as np
import pytest

from gradcheck import assert_close, check_layer, numerical_grad
from mpitrain.nets.activation import Dropout, ReLU
from mpitrain.nets.batchnorm import BatchNorm2d
from mpitrain.nets.linear import Flatten, Linear
from mpitrain.nets.losses import accuracy_counts, nonfinite_rows, softmax_cross_entropy


def randn(*shape, seed=11):
    # not seed 0: check_layer draws its random cotangent r from seed 0, and an x
    # drawn from the same stream would make r an affine function of x per channel,
    # which batch norm's dx projects to exactly zero
    return np.random.default_rng(seed).standard_normal(shape)


def bn64(C, **kw):
    """A float64 BatchNorm2d with gamma and beta away from their initial 1 and 0."""
    bn = BatchNorm2d(C, **kw).bind(dtype=np.float64)
    bn.weight.master[...] = 1 + 0.5 * randn(C, seed=1)
    bn.bias.master[...] = randn(C, seed=2)
    return bn


# ----- BatchNorm2d -----
@pytest.mark.parametrize("shape", [(2, 3, 5, 3), (3, 1, 1, 4)])
def test_batchnorm_train_gradients(shape):
    check_layer(bn64(shape[3]), 2 + 3 * randn(*shape), train=True, rtol=1e-6)


@pytest.mark.parametrize("train", [True, False])
def test_batchnorm_with_its_relu_fused(train):
    """relu=True: the same as the layer followed by a ReLU, outputs and every gradient
    (finite differences, float64); no value sits at the ReLU's kink."""
    fused, plain = bn64(3), bn64(3)
    fused.relu = True
    for a, b in ((fused.weight, plain.weight), (fused.bias, plain.bias)):
        a.master[...] = b.master[...] = [0.8, -1.2, 1.5]
    x = 2 + 3 * randn(2, 3, 4, 3)
    y = fused.forward(x, train)
    expect = np.maximum(plain.forward(x, train), 0)
    np.testing.assert_allclose(y, expect, rtol=1e-12, atol=1e-12)
    assert (y == 0).any() and (y > 0).any()
    dy = randn(*y.shape, seed=4)
    np.testing.assert_allclose(fused.backward(dy), plain.backward(dy * (expect > 0)), rtol=1e-10)
    fused.relu = True
    check_layer(fused, x, train=train, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("relu", [False, True])
def test_batchnorm_backward_sums_against_float64(dtype, relu):
    """The backward sums (sum dy, sum dy (x - mean)), taken two rows a pass with a row
    left over in blocks of an odd row count, equal float64 sums of the same values,
    with dy zeroed where forward's fused ReLU output 0."""
    from mpitrain.kernels import batchnorm as kernels
    M, C = 2 * kernels.ROWS + 3, 5
    assert kernels.block_rows(M) % 2 == 1
    x = (0.5 + randn(M, C, seed=1)).astype(dtype)
    dy = randn(M, C, seed=2).astype(dtype)
    mean, scale, beta = (randn(C, seed=s).astype(np.float32) for s in (3, 4, 5))
    sums = kernels.batchnorm_sums(x, dy, mean, (scale, beta) if relu else None)
    d = dy.astype(np.float64)
    if relu:
        y = ((x.astype(np.float32) - mean) * scale + beta).astype(dtype)   # as forward stored it
        assert (y <= 0).any() and (y > 0).any()
        d = np.where(y > 0, d, 0.0)
    expect = [d.sum(axis=0), (d * (x.astype(np.float64) - mean.astype(np.float64))).sum(axis=0)]
    np.testing.assert_allclose(sums, expect, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("M", [128, 2 * 256 + 3, 4 * 256 + 7])
def test_batchnorm_sums_at_few_rows_keep_their_bits_on_any_thread_count(M):
    """A pass over few rows takes smaller blocks (block_rows: 16 rows at M = 128), so that
    every thread has some. The blocks depend on M alone: forward's and backward's sums
    come out with the same bits on one thread and on the team, and equal float64 sums of
    the same values."""
    import numba
    from mpitrain.kernels import batchnorm as kernels
    rows = kernels.block_rows(M)
    assert kernels.MIN_ROWS <= rows <= kernels.ROWS
    assert -(-M // rows) >= min(kernels.MIN_BLOCKS, M // kernels.MIN_ROWS)
    C = 600                                  # (M, C) float32 above team.PARALLEL_MIN_BYTES
    x = (3 + randn(M, C, seed=1)).astype(np.float32)
    dy = randn(M, C, seed=2).astype(np.float32)
    mean = randn(C, seed=3).astype(np.float32)
    threads, results = numba.get_num_threads(), []
    try:
        for n in (1, threads):
            numba.set_num_threads(n)
            results.append((kernels.batchnorm_sums(x), kernels.batchnorm_sums(x, dy, mean)))
    finally:
        numba.set_num_threads(threads)
    for one, team in zip(*results):
        assert one.tobytes() == team.tobytes()
    shifted = x.astype(np.float64) - x[0].astype(np.float64)
    d, centred = dy.astype(np.float64), x.astype(np.float64) - mean.astype(np.float64)
    np.testing.assert_allclose(results[0][0], [shifted.sum(0), (shifted ** 2).sum(0)],
                               rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(results[0][1], [d.sum(0), (d * centred).sum(0)],
                               rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_batchnorm_with_a_residual_gives_add_relu_of_its_output(dtype, train):
    """forward(x, residual=r), a residual block's last BN, is max(forward(x) + r, 0) bit
    for bit (float16 added as NumPy adds it: in float32, rounded once), in one pass;
    rejected on a layer with relu or a residual of another shape or dtype."""
    work = {np.float16: {"dtype": np.float32, "working_dtype": np.float16}}.get(
        dtype, {"dtype": dtype})
    bn = BatchNorm2d(7).bind(**work)
    bn.weight.master[...] = 1 + 0.5 * randn(7, seed=1)
    bn.bias.master[...] = randn(7, seed=2)
    bn.running_var.data[...] = 2.0
    x = (1 + 2 * randn(3, 5, 9, 7, seed=3)).astype(dtype)
    r = randn(3, 5, 9, 7, seed=4).astype(dtype)
    y = bn.forward(x, train, residual=r)
    expect = np.maximum(bn.forward(x, train) + r, 0)
    assert y.dtype == dtype and (y == 0).any() and (y > 0).any()
    np.testing.assert_array_equal(y, expect)
    with pytest.raises(ValueError, match="residual"):
        bn.forward(x, train, residual=r[:, :4])
    with pytest.raises(ValueError, match="residual"):
        BatchNorm2d(7, relu=True).bind(**work).forward(x, train, residual=r)


def test_batchnorm_eval_gradients():
    bn = bn64(3)
    bn.running_mean.data[...] = [0.5, -1.0, 2.0]
    bn.running_var.data[...] = [0.3, 2.0, 1.5]
    check_layer(bn, randn(2, 3, 4, 3), train=False)


def test_batchnorm_train_output_is_normalised_and_eval_uses_running_stats():
    bn = BatchNorm2d(4).bind(dtype=np.float64)
    x = 5 + 3 * randn(4, 3, 3, 4)
    y = bn.forward(x, train=True)
    assert np.allclose(y.reshape(-1, 4).mean(0), 0, atol=1e-12)
    assert np.allclose(y.reshape(-1, 4).var(0), 1, rtol=1e-4)   # var / (var + eps)
    bn.running_mean.data[...] = 1.0
    bn.running_var.data[...] = 4.0
    assert np.allclose(bn.forward(x, train=False), (x - 1) / np.sqrt(4 + 1e-5))


def test_batchnorm_zero_init_and_flags():
    bn = BatchNorm2d(5, zero_init=True).bind()
    assert np.all(bn.weight.master == 0) and np.all(bn.bias.master == 0)
    assert np.all(BatchNorm2d(5).bind().weight.master == 1)
    assert [n for n, _ in bn.named_params()] == ["weight", "bias"]
    assert [n for n, _ in bn.named_buffers()] == ["running_mean", "running_var"]
    assert not any(p.decay or p.lars for _, p in bn.named_params())
    assert np.all(bn.running_mean.data == 0) and np.all(bn.running_var.data == 1)


def test_batchnorm_float16_input_uses_fp32_statistics():
    x32 = (3 + 2 * randn(4, 6, 6, 8)).astype(np.float32)
    x16 = x32.astype(np.float16)
    dy16 = randn(4, 6, 6, 8, seed=3).astype(np.float16)
    half = BatchNorm2d(8).bind(dtype=np.float32, working_dtype=np.float16)
    ref = BatchNorm2d(8).bind(dtype=np.float32)
    for bn in (half, ref):
        bn.weight.master[...] = 1 + 0.5 * randn(8, seed=1)
        bn.arena.sync_working()

    y16 = half.forward(x16, train=True)
    y32 = ref.forward(x16.astype(np.float32), train=True)
    assert y16.dtype == np.float16
    # the statistics are exactly those of the fp32 computation on the same values
    np.testing.assert_array_equal(half.running_mean.data, ref.running_mean.data)
    np.testing.assert_array_equal(half.running_var.data, ref.running_var.data)
    np.testing.assert_allclose(y16, y32, rtol=1e-3, atol=2e-3)

    dx16 = half.backward(dy16)
    dx32 = ref.backward(dy16.astype(np.float32))
    assert dx16.dtype == np.float16
    np.testing.assert_allclose(dx16, dx32, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(half.weight.grad, ref.weight.grad, rtol=1e-5)
    np.testing.assert_allclose(half.bias.grad, ref.bias.grad, rtol=1e-5)


def test_batchnorm_rejects_bad_input():
    bn = BatchNorm2d(3).bind()
    with pytest.raises(ValueError, match=r"\(N, H, W, 3\)"):
        bn.forward(np.zeros((2, 3, 4, 4), np.float32))
    with pytest.raises(ValueError, match="more than one value per channel"):
        bn.forward(np.zeros((1, 1, 1, 3), np.float32), train=True)


@pytest.mark.torch
def test_batchnorm_matches_torch():
    import torch
    C = 5
    bn = bn64(C, momentum=0.2)
    tbn = torch.nn.BatchNorm2d(C, momentum=0.2).double()
    with torch.no_grad():
        tbn.weight.copy_(torch.from_numpy(bn.weight.master))
        tbn.bias.copy_(torch.from_numpy(bn.bias.master))
    for step in range(2):
        x = 1 + 2 * randn(3, 4, 5, C, seed=10 + step)
        dy = randn(3, 4, 5, C, seed=20 + step)
        xt = torch.from_numpy(x.transpose(0, 3, 1, 2).copy()).requires_grad_()
        yt = tbn(xt)
        yt.backward(torch.from_numpy(dy.transpose(0, 3, 1, 2).copy()))
        y = bn.forward(x, train=True)
        dx = bn.backward(dy)
        np.testing.assert_allclose(y, yt.detach().numpy().transpose(0, 2, 3, 1),
                                   rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(dx, xt.grad.numpy().transpose(0, 2, 3, 1),
                                   rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(bn.weight.grad, tbn.weight.grad.numpy(), rtol=1e-10)
        np.testing.assert_allclose(bn.bias.grad, tbn.bias.grad.numpy(), rtol=1e-10)
        tbn.weight.grad = tbn.bias.grad = None
    np.testing.assert_allclose(bn.running_mean.data, tbn.running_mean.numpy(), rtol=1e-12)
    np.testing.assert_allclose(bn.running_var.data, tbn.running_var.numpy(), rtol=1e-12)

    tbn.eval()
    x = randn(2, 3, 3, C, seed=30)
    yt = tbn(torch.from_numpy(x.transpose(0, 3, 1, 2).copy())).detach().numpy()
    yt = yt.transpose(0, 2, 3, 1)
    np.testing.assert_allclose(bn.forward(x, train=False), yt, rtol=1e-10, atol=1e-12)


# ----- ReLU, Dropout, Flatten -----
def test_relu():
    x = randn(2, 3, 4, 5)
    x += np.sign(x) * 0.1        # keep finite differences away from the kink at 0
    y = check_layer(ReLU(), x)
    np.testing.assert_array_equal(y, np.maximum(x, 0))


def test_dropout_gradients_and_scaling():
    d = Dropout(p=0.3, seed=7)
    x = randn(3, 2, 2, 4)
    y = check_layer(d, x, reseed=lambda: d.seed(7))
    kept = y != 0
    assert 0 < kept.sum() < x.size
    np.testing.assert_allclose(y[kept], x[kept] / 0.7)


def test_dropout_rate_eval_and_reseed():
    d = Dropout(p=0.25, seed=1)
    x = np.ones((200, 500), np.float32)
    y = d.forward(x, train=True)
    assert y.dtype == np.float32
    assert abs((y != 0).mean() - 0.75) < 0.01
    assert abs(y.mean() - 1) < 0.02                     # inverted dropout keeps the mean
    assert not np.array_equal(y, d.forward(x, train=True))   # a fresh mask each call
    d.seed(1)
    np.testing.assert_array_equal(y, d.forward(x, train=True))
    assert d.forward(x, train=False) is x
    assert d.backward(x) is x
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        Dropout(p=1.0)


def test_flatten():
    x = randn(2, 3, 4, 5)
    y = check_layer(Flatten(), x)
    np.testing.assert_array_equal(y[1], x[1].reshape(-1))   # (H, W, C) order


# ----- Linear -----
@pytest.mark.parametrize("bias", [True, False])
def test_linear_gradients(bias):
    lin = Linear(7, 4, bias=bias).bind(dtype=np.float64)
    assert [n for n, _ in lin.named_params()] == (["weight", "bias"] if bias else ["weight"])
    check_layer(lin, randn(3, 7))


def test_linear_init_flags_and_macs():
    lin = Linear(100, 30).bind(seed=1)
    assert lin.weight.shape == (30, 100)
    assert 0.08 < np.abs(lin.weight.master).max() <= 0.1        # U(-1/sqrt(in), 1/sqrt(in))
    assert np.abs(lin.bias.master).max() <= 0.1
    assert lin.weight.decay and lin.weight.lars
    assert not lin.bias.decay and not lin.bias.lars
    assert lin.macs((8, 100), (8, 30)) == 8 * 100 * 30
    with pytest.raises(ValueError, match=r"\(N, 100\)"):
        lin.forward(np.zeros((8, 99), np.float32))


def test_linear_float16_is_the_float32_product_rounded_once():
    """fp16 operands are multiplied in fp32 and the product rounded to fp16 once (the bias
    is then added in fp16); the weight gradient is the fp32 product itself, in the arena."""
    lin = Linear(16, 8).bind(dtype=np.float32, working_dtype=np.float16)
    x = randn(4, 16).astype(np.float16)
    y = lin.forward(x)
    assert y.dtype == np.float16
    w = lin.weight.data.astype(np.float32)
    np.testing.assert_array_equal(y, (x.astype(np.float32) @ w.T).astype(np.float16)
                                  + lin.bias.data)
    dy = randn(4, 8, seed=1).astype(np.float16)
    dx = lin.backward(dy)
    assert dx.dtype == np.float16 and lin.weight.grad.dtype == np.float32
    np.testing.assert_array_equal(dx, (dy.astype(np.float32) @ w).astype(np.float16))
    np.testing.assert_array_equal(lin.weight.grad, dy.astype(np.float32).T @ x.astype(np.float32))


@pytest.mark.torch
def test_linear_matches_torch():
    import torch
    lin = Linear(6, 3).bind(dtype=np.float64, seed=4)
    tl = torch.nn.Linear(6, 3).double()
    with torch.no_grad():
        tl.weight.copy_(torch.from_numpy(lin.weight.master))
        tl.bias.copy_(torch.from_numpy(lin.bias.master))
    x, dy = randn(5, 6), randn(5, 3, seed=1)
    xt = torch.from_numpy(x).requires_grad_()
    yt = tl(xt)
    yt.backward(torch.from_numpy(dy))
    np.testing.assert_allclose(lin.forward(x), yt.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(lin.backward(dy), xt.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(lin.weight.grad, tl.weight.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(lin.bias.grad, tl.bias.grad.numpy(), rtol=1e-12)


# ----- loss and accuracy -----
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_loss_gradient(smoothing):
    logits = 3 * randn(4, 6)
    labels = np.array([0, 5, 2, 2])
    _, dlogits = softmax_cross_entropy(logits, labels, smoothing)
    numeric = numerical_grad(lambda: softmax_cross_entropy(logits, labels, smoothing)[0], logits)
    assert_close(dlogits, numeric, 1e-6, 1e-8, "dlogits")


def test_loss_value_stability_and_dtype():
    logits = np.array([[1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0]])
    loss, d = softmax_cross_entropy(logits, np.array([0, 1]))
    assert np.isfinite(loss) and abs(loss - np.log(3) / 2) < 1e-12
    loss16, d16 = softmax_cross_entropy(logits.astype(np.float16), np.array([0, 1]))
    # the loss is a 0-d fp32 array (on a GPU it stays on the device until read)
    assert loss16.shape == () and loss16.dtype == np.float32
    assert d16.dtype == np.float16 and np.all(np.isfinite(d16))
    np.testing.assert_allclose(d16, d, atol=1e-3)


@pytest.mark.torch
def test_loss_matches_torch():
    import torch
    logits = 2 * randn(8, 10)
    labels = np.random.default_rng(1).integers(0, 10, 8)
    lt = torch.from_numpy(logits).requires_grad_()
    ref = torch.nn.functional.cross_entropy(lt, torch.from_numpy(labels), label_smoothing=0.1)
    ref.backward()
    loss, d = softmax_cross_entropy(logits, labels, label_smoothing=0.1)
    assert abs(loss - ref.item()) < 1e-12
    np.testing.assert_allclose(d, lt.grad.numpy(), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("labels, message", [
    (np.array([0.0, 1.0, 2.0]), "integers"),
    (np.array([[0, 1, 2]]), "1-D"),
    (np.array([0, 1]), "one entry per row"),
    (np.array([0, 1, 4]), r"\[0, 4\)"),
    (np.array([0, -1, 2]), r"\[0, 4\)"),
])
def test_bad_labels_raise(labels, message):
    logits = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match=message):
        softmax_cross_entropy(logits, labels)
    with pytest.raises(ValueError, match=message):
        accuracy_counts(logits, labels)


def test_accuracy_counts():
    logits = np.array([[0.1, 0.5, 0.2, 0.9],     # label 3: top-1
                       [0.9, 0.5, 0.2, 0.1],     # label 1: second
                       [0.9, 0.5, 0.2, 0.1]])    # label 3: last
    labels = np.array([3, 1, 3])
    assert accuracy_counts(logits, labels, topk=(1, 2, 5)).tolist() == [1, 2, 3]   # k = 5: 4


def test_tied_logits_go_to_the_lower_class_as_argmax_does():
    """A model whose logits are all equal is right only where the label is class 0 (top-1)
    or one of the first k classes (top-k), not on every row; a tie elsewhere likewise."""
    labels = np.arange(10)
    assert accuracy_counts(np.zeros((10, 10), np.float32), labels, topk=(1, 5)).tolist() == [1, 5]
    logits = np.array([[0.5, 0.9, 0.9, 0.1],     # label 2 ties with 1: second
                       [0.5, 0.9, 0.9, 0.1],     # label 1 ties with 2: first
                       [0.9, 0.9, 0.9, 0.9]])    # label 3, all tied: last
    ranks = [1, 0, 3]
    for k in (1, 2, 3, 4):
        assert accuracy_counts(logits, np.array([2, 1, 3]), topk=(k,)).tolist() == \
            [sum(r < k for r in ranks)]
    assert np.argmax(logits, axis=1).tolist() == [1, 1, 0]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_row_with_a_non_finite_logit_is_never_correct(bad):
    """No logit is larger than a NaN: without the check a NaN row would score at every k."""
    logits = np.array([[0.1, 0.5, 0.2, 0.9],     # label 3: top-1
                       [np.nan] * 4,              # all NaN
                       [0.9, bad, 0.2, 0.1]])     # one bad logit, label 0
    labels = np.array([3, 2, 0])
    assert accuracy_counts(logits, labels, topk=(1, 4)).tolist() == [1, 1]
    assert int(nonfinite_rows(logits)) == 2
    assert int(nonfinite_rows(logits[:1])) == 0


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_elementwise_kernels_match_numpy_bitwise(dtype):
    """relu, relu_grad and add_into (mpitrain.kernels.elementwise) against NumPy
    on a size that spans several blocks and ends in a partial one; float16 rounded once,
    as NumPy's float16 arithmetic."""
    from mpitrain.kernels import elementwise as ew
    n = 3 * ew.BLOCK + 17
    a, b, d = (randn(n, seed=s).astype(dtype).reshape(-1, 1) for s in (1, 2, 3))
    with np.errstate(all="ignore"):
        expect = [np.maximum(a, 0), d * (a > 0), a + b]
    got = [ew.relu(a), ew.relu_grad(d, a), ew.add_into(a.copy(), b)]
    for g, e in zip(got, expect):
        assert g.dtype == dtype and g.shape == a.shape
        np.testing.assert_array_equal(g, e)


def test_fused_relu_in_fp16_follows_the_stored_output():
    """fp16: an output v > 0 too small for fp16 is stored as 0, and the fused ReLU's
    gradient must stop there as a separate ReLU's would (backward recomputes y's sign
    as forward rounded it)."""
    def layer(relu):
        bn = BatchNorm2d(4, relu=relu).bind(dtype=np.float32, working_dtype=np.float16)
        bn.weight.master[...] = [0.0, 1.0, 0.0, 1.0]        # channels 0, 2: y = beta alone
        bn.bias.master[...] = [1e-9, 0.5, -1e-9, 0.0]       # rounds to +0 and -0 in fp16
        return bn
    x = randn(2, 3, 3, 4).astype(np.float16)
    dy = randn(2, 3, 3, 4, seed=5).astype(np.float16)
    fused, plain = layer(True), layer(False)
    y = fused.forward(x, train=True)
    y_plain = plain.forward(x, train=True)
    np.testing.assert_array_equal(y, np.maximum(y_plain, 0))
    assert (y[..., 0] == 0).all()                           # stored as 0: no gradient
    np.testing.assert_array_equal(fused.backward(dy), plain.backward(dy * (y > 0)))
    for a, b in ((fused.weight, plain.weight), (fused.bias, plain.bias)):
        np.testing.assert_array_equal(a.grad, b.grad)       # channel 0's dbeta: 0


def test_linear_fp16_weight_gradient_on_the_cpu_is_an_fp32_product():
    """fp16_product asks for tensor cores on a GPU; on the CPU the fp16 operands are still
    multiplied in fp32 into the fp32 arena, the bits of the product without it."""
    from mpitrain.nets.conv import matmul
    dy, x = randn(64, 10).astype(np.float16), randn(64, 30, seed=3).astype(np.float16)
    plain, tensor = np.empty((10, 30), np.float32), np.empty((10, 30), np.float32)
    matmul(dy.T, x, out=plain)
    matmul(dy.T, x, out=tensor, fp16_product=True)
    np.testing.assert_array_equal(tensor, plain)
    np.testing.assert_array_equal(plain, dy.T.astype(np.float32) @ x.astype(np.float32))


@pytest.mark.gpu
def test_linear_fp16_weight_gradient_on_a_gpu_is_rounded_once_and_overflows_to_inf():
    """On a GPU the fp16 product (fp32 sums on tensor cores, rounded once) is widened into
    the fp32 arena: within one fp16 rounding of float64, and inf beyond 65504 for the
    overflow check, as cuDNN's convolution weight gradients."""
    import cupy
    layer = Linear(40, 12).bind(dtype=np.float32, working_dtype=np.float16, xp=cupy)
    x = randn(256, 40).astype(np.float16)
    layer.forward(cupy.asarray(x))
    dy = (2.0 ** 12 * randn(256, 12, seed=5)).astype(np.float16)
    layer.backward(cupy.asarray(dy))
    ref = dy.astype(np.float64).T @ x.astype(np.float64)
    got = cupy.asnumpy(layer.weight.grad)
    big = np.abs(ref) > 65504
    assert big.any() and not big.all()
    assert np.isinf(got[big]).all()
    assert_close(got[~big].astype(np.float64), ref[~big], 2e-3, 1e-2, "dW")
