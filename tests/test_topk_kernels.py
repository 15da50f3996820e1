"""The top-k selection and scatter-sum kernels (mpitrain.kernels.topk) against a float64
sort of the definition: the numba CPU kernels here, the CUDA kernels under the numba-cuda
simulator in a subprocess (NUMBA_ENABLE_CUDASIM must be set before numba is imported) and,
marked gpu, on a GPU's CuPy arrays (the simulator neither type-checks a kernel for the
device nor runs buckets of more than a few hundred elements)."""

import numpy as np
import pytest

from mpitrain.backend import to_numpy
from mpitrain.kernels import topk


def reference(grad, residual, k, scale):
    """(values, indices, new residual) by the definition, in float64: acc = grad + scale *
    residual (rounded to float32, as the kernels compute it), the k largest |acc| with ties
    by index, the rest / scale. NaN counts above inf, inf above any finite value."""
    acc = (grad.astype(np.float64) + np.float64(np.float32(scale)) * residual).astype(np.float32)
    magnitude = np.abs(acc.astype(np.float64))
    magnitude[np.isnan(acc)] = np.inf
    rank = np.isnan(acc).astype(np.int64)                 # NaN first, then by magnitude
    order = np.lexsort((np.arange(acc.size), -magnitude, -rank))
    chosen = np.sort(order[:k])
    rest = acc.astype(np.float64) / np.float64(np.float32(scale))
    rest[chosen] = 0
    return acc[chosen], chosen.astype(np.int32), rest.astype(np.float32)


def cases():
    """(grad, residual, k, scale): random, ties across chunk boundaries, k = n and k = 1,
    non-finite values, a non-unit loss scale."""
    rng = np.random.default_rng(5)
    out = []
    for n, k, scale in ((1, 1, 1.0), (37, 5, 1.0), (300, 300, 4.0), (300, 1, 1.0),
                        (513, 17, 1024.0)):
        g = rng.standard_normal(n).astype(np.float32)
        r = (rng.standard_normal(n) * 0.1).astype(np.float32)
        out.append((g, r, k, scale))
    g = np.full(200, 0.5, np.float32)                     # all tied: the first k indices win
    g[::3] = -0.5
    out.append((g, np.zeros(200, np.float32), 23, 1.0))
    g = np.zeros(64, np.float32)                          # zeros and signed zeros only
    g[1::2] = -0.0
    out.append((g, np.zeros(64, np.float32), 10, 1.0))
    g = rng.standard_normal(90).astype(np.float32)
    g[[4, 50]] = np.inf
    g[70] = -np.inf
    g[33] = np.nan
    out.append((g, np.zeros(90, np.float32), 3, 2.0))
    return out


def check_select(impl, sizes=None, xp=np):
    """select() on every case against the definition, bit for bit; xp: the arrays' module
    (CuPy for the CUDA kernels on a GPU)."""
    for grad, residual, k, scale in cases():
        if sizes is not None and grad.size > sizes:
            continue
        selected(impl, grad, residual, k, scale, xp)


def selected(impl, grad, residual, k, scale, xp=np, parallel=True):
    """Run select() on xp copies of grad and residual; assert its picks and residual are
    the definition's bits."""
    values, indices = xp.empty(k, np.float32), xp.empty(k, np.int32)
    out = xp.empty(grad.size, np.float32)
    topk.select(xp.asarray(grad), xp.asarray(residual), out, k, values, indices, scale,
                impl=impl, parallel=parallel)
    want_v, want_i, want_r = reference(grad, residual, k, scale)
    np.testing.assert_array_equal(to_numpy(indices), want_i)
    assert_same_bits(to_numpy(values), want_v)
    np.testing.assert_array_equal(to_numpy(out), want_r)


def assert_same_bits(got, want):
    """Bit for bit (so -0.0 is not 0.0), except that a NaN may carry any payload: a GPU
    writes its own canonical NaN (0x7fffffff) for NaN + x."""
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.int32), want[~nan].view(np.int32))


def check_scatter(impl, n=40, k=7, p=3, xp=np):
    """p ranks' picks summed in rank order, against float64 sums, into a bucket that
    held other values before."""
    rng = np.random.default_rng(1)
    indices = np.stack([np.sort(rng.choice(n, k, replace=False))
                        for _ in range(p)]).astype(np.int32)
    values = rng.standard_normal((p, k)).astype(np.float32)
    bucket = xp.asarray(rng.standard_normal(n).astype(np.float32))
    topk.scatter_sum(bucket, xp.asarray(indices), xp.asarray(values), impl=impl)
    bucket = to_numpy(bucket)
    want = np.zeros(n)
    for r in range(p):
        want[indices[r]] += values[r]
    np.testing.assert_allclose(bucket, want, rtol=1e-6, atol=1e-7)
    untouched = np.setdiff1d(np.arange(n), indices)
    assert np.all(bucket[untouched] == 0)
    # the same order as the definition: float32 additions rank after rank
    order = np.zeros(n, np.float32)
    for r in range(p):
        order[indices[r]] += values[r]
    np.testing.assert_array_equal(bucket, order)


@pytest.mark.parametrize("impl", ["numpy", "numba"])
def test_select_matches_the_sorted_definition(impl):
    check_select(impl)


@pytest.mark.parametrize("impl", ["numpy", "numba"])
def test_scatter_sum_adds_the_ranks_in_order(impl):
    check_scatter(impl)


def tied(n, seed=2):
    """A bucket of n gradients with many equal magnitudes, and a zero residual."""
    grad = np.random.default_rng(seed).integers(-40, 40, n).astype(np.float32)
    return grad, np.zeros(n, np.float32)


def test_numba_select_on_the_calling_thread_and_over_many_chunks():
    """parallel=False (the Reducer's communication thread) and a bucket of several CPU
    chunks with ties at the threshold in more than one chunk."""
    grad, residual = tied(3 * topk.CPU_CHUNK + 11)
    for parallel in (True, False):
        selected("numba", grad, residual, 4321, 1.0, parallel=parallel)


def test_bad_arguments_are_refused():
    g = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        topk.select(g, g, np.empty_like(g), 9, np.empty(9, np.float32), np.empty(9, np.int32))
    with pytest.raises(ValueError, match="float32"):
        d = np.ones(8)
        topk.select(d, d, np.empty_like(d), 2, np.empty(2), np.empty(2, np.int32))


@pytest.mark.gpu
def test_cuda_kernels_on_the_gpu():
    """The CUDA kernels on CuPy arrays: every case, then a 6M-element bucket (a 24 MB
    fusion bucket, thousands of blocks) with ties at the threshold in many blocks, at a
    density of 1%, and k = 1 under a loss scale, and a scatter-sum of 4 ranks' 60,000 picks."""
    import cupy
    check_select("cuda", xp=cupy)
    check_scatter("cuda", xp=cupy)
    grad, zero = tied(6_000_011)
    selected("cuda", grad, zero, 60_001, 1.0, xp=cupy)
    residual = np.random.default_rng(3).standard_normal(grad.size).astype(np.float32)
    selected("cuda", grad, residual, 1, 1024.0, xp=cupy)
    check_scatter("cuda", n=6_000_011, k=60_000, p=4, xp=cupy)


def sim_kernels():
    check_select("cuda", sizes=300)
    check_scatter("cuda")


def test_cuda_kernels_under_the_simulator():
    from launcher import under_cuda_simulator
    under_cuda_simulator("test_topk_kernels", "sim_kernels")
