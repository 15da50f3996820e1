"""kernels.gemm: the small-batch GEMMs of a fully connected layer against the float64
product, which product `matmul` hands to which kernel, and the layer built on them; the
batched products of a Winograd convolution."""
import ctypes
import json
import os
import re
import subprocess
import sys

import numba
import numpy as np
import pytest

from mpitrain.kernels import gemm
from mpitrain.nets.linear import Linear


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def assert_float32_product(y, a, b):
    """|y - a b| <= K eps32 (|a| |b|), elementwise, with a b in float64."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    bound = a.shape[1] * 2.0 ** -23 * (np.abs(a64) @ np.abs(b64))
    assert y.dtype == np.float32
    assert np.all(np.abs(y - a64 @ b64) <= bound)


@pytest.mark.parametrize("M, K, N", [(1, 1, 1), (3, 5, 7), (4, 9, 4), (6, 33, 10),
                                     (16, 300, 37), (32, 64, 64)])
def test_rows_dot_rows_is_the_product_with_a_transpose(M, K, N):
    a, bt = randn(M, K), randn(N, K, seed=1)
    y = np.full((M, N), np.nan, np.float32)
    gemm._rows_dot_rows(a, bt, y)
    assert_float32_product(y, a, bt.T)


@pytest.mark.parametrize("N, K, J", [(2, 4, 1), (6, 8, 13), (10, 16, 1000), (64, 12, 257)])
def test_outer_sum_is_the_product_over_a_short_inner_dimension(N, K, J):
    a, b = randn(K, N).T, randn(K, J, seed=1)          # a: the transposed view dy.T
    y = np.full((N, J), np.nan, np.float32)
    gemm._outer_sum(a, b, y)
    assert_float32_product(y, a, b)


def test_matmul_picks_a_kernel_where_shape_and_layout_fit():
    w, x, dy = randn(40, 300, seed=1), randn(16, 300), randn(16, 40, seed=2)

    # forward of Linear: few rows times a transposed weight
    y = np.empty((16, 40), np.float32)
    gemm._rows_dot_rows(x, w, y)
    np.testing.assert_array_equal(gemm.matmul(x, w.T), y)
    # weight gradient: dy^T x over a batch of 16, also into a given `out`
    dw = np.empty((40, 300), np.float32)
    gemm._outer_sum(dy.T, x, dw)
    np.testing.assert_array_equal(gemm.matmul(dy.T, x), dw)
    out = np.empty((40, 300), np.float32)
    assert gemm.matmul(dy.T, x, out=out) is out
    np.testing.assert_array_equal(out, dw)
    # everything else is NumPy's
    many = randn(gemm.FEW_ROWS + 1, 300)
    for a, b in [(many, w.T),                                   # too many rows
                 (x, np.ascontiguousarray(w.T)),                # b not a transposed matrix
                 (dy[:6].T, x[:6]),                             # inner dimension not in 4s
                 (dy[:, :39].T, x),                             # an odd number of rows
                 (randn(40, 20).T, randn(40, 300)),             # inner dimension too long
                 (x[:, :0], w.T[:0]),                          # no inner dimension
                 (x.astype(np.float64), w.T.astype(np.float64))]:
        np.testing.assert_array_equal(gemm.matmul(a, b), np.matmul(a, b))
    # and NumPy's errors for operands that do not multiply
    for a, b in [(x, w), (dy.T, x[:12])]:
        with pytest.raises(ValueError):
            np.matmul(a, b, out=np.empty((a.shape[0], b.shape[1]), np.float32))
        with pytest.raises(ValueError):
            gemm.matmul(a, b, out=np.empty((a.shape[0], b.shape[1]), np.float32))


def test_same_bits_at_any_thread_count():
    a, bt, dy = randn(16, 500), randn(64, 500, seed=1), randn(16, 64, seed=2)
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one Numba thread (NUMBA_NUM_THREADS=1): no second count to compare")
    threads = numba.get_num_threads()
    results = []
    try:
        for n in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(n)
            results.append((gemm.matmul(a, bt.T), gemm.matmul(dy.T, a)))
    finally:
        numba.set_num_threads(threads)
    np.testing.assert_array_equal(results[1][0], results[0][0])
    np.testing.assert_array_equal(results[1][1], results[0][1])


@pytest.mark.parametrize("m, q, n", [(1, 1000, 130), (4096, 64, 1), (64, 1024, 1)])
def test_a_product_of_one_row_or_column_has_the_same_bits_at_any_thread_count(m, q, n):
    """NumPy's product of one row or one column is a gemv, which sums in another order
    than sgemm: the team's product and stack must keep one thread's bits there too."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one Numba thread (NUMBA_NUM_THREADS=1): no second count to compare")
    a, b = randn(16, m, q), randn(16, q, n, seed=1)
    threads = numba.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            numba.set_num_threads(count)
            results.append((gemm.matmul(a[0], b[0]),
                            gemm.batched_matmul(a, b, np.empty((16, m, n), np.float32))))
    finally:
        numba.set_num_threads(threads)
    for one, two in zip(*results):
        np.testing.assert_array_equal(one, two)
    assert_float32_product(results[0][0], a[0], b[0])


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_non_finite_operand_reaches_the_product(bad):
    """The loss scale finds an overflow by the non-finite values it leaves in the
    gradients: a product must not lose one."""
    a, bt, dy = randn(8, 64), randn(12, 64, seed=1), randn(8, 12, seed=2)
    a[3, 5] = bad
    dy[2, 7] = bad
    for y, ref in [(gemm.matmul(a, bt.T), a.astype(np.float64) @ bt.T),
                   (gemm.matmul(dy.T, a), dy.T.astype(np.float64) @ a)]:
        np.testing.assert_array_equal(np.isfinite(y), np.isfinite(ref))
        assert not np.isfinite(y).all()


def test_linear_at_a_small_batch_against_float64():
    """Linear in float32 at batch 16, where both its forward and weight gradient run
    on these kernels, against the same layer in float64."""
    lin = Linear(300, 40).bind(dtype=np.float32, seed=3)
    ref = Linear(300, 40).bind(dtype=np.float64, seed=3)
    x, dy = randn(16, 300), randn(16, 40, seed=1)
    y, y64 = lin.forward(x), ref.forward(x.astype(np.float64))
    np.testing.assert_allclose(y, y64, rtol=1e-4, atol=1e-5)
    dx, dx64 = lin.backward(dy), ref.backward(dy.astype(np.float64))
    np.testing.assert_allclose(dx, dx64, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lin.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-5)


def winograd_stacks(T, C, O, seed=0):
    """The three stacks of a Winograd layer's 16 GEMMs, as nets/conv.py lays them out:
    (a, b, out) for forward M[k] = V[k] U[:, k]^T, the filter gradient dU[:, k] =
    dM[k]^T V[k] (a transposed a, out every 16th row) and dV[k] = dM[k] U[:, k]."""
    V, U = randn(16, T, C, seed=seed), randn(O, 16, C, seed=seed + 1)
    dM = randn(16, T, O, seed=seed + 2)
    dU = np.full((O, 16, C), np.nan, np.float32)
    return [(V, U.transpose(1, 2, 0), np.full((16, T, O), np.nan, np.float32)),
            (dM.transpose(0, 2, 1), V, dU.transpose(1, 0, 2)),
            (dM, U.transpose(1, 0, 2), np.full((16, T, C), np.nan, np.float32))]


@pytest.mark.parametrize("T, C, O", [(128, 256, 256), (512, 64, 48), (40, 24, 32), (1, 300, 300)])
def test_batched_matmul_is_each_product_of_the_stack(T, C, O):
    """Above SMALL_PRODUCT multiply-adds a product (the first two shapes) the stack goes to
    OpenBLAS in one call, at or below it (the last two) to np.matmul one by one: OpenBLAS
    0.3.31's batch crashes the process there."""
    for a, b, out in winograd_stacks(T, C, O):
        assert gemm.batched_matmul(a, b, out) is out
        for k in range(16):
            assert_float32_product(out[k], a[k], b[k])


def test_batched_matmul_takes_numpys_openblas_where_it_has_the_batch():
    """The one-call path (batched_matmul's without a team to take the stack) is found
    where NumPy runs on OpenBLAS 0.3.30 or later (its sgemm_batch_strided), and gives
    each product as np.matmul does."""
    from threadpoolctl import threadpool_info
    numpys = gemm.numpys_openblas(threadpool_info())      # not SciPy's, which may be newer
    version = numpys["version"] if numpys else "none"
    if not numpys or tuple(int(v) for v in version.split(".")[:3]) < (0, 3, 30):
        pytest.skip(f"NumPy's BLAS has no sgemm_batch_strided (its OpenBLAS: {version})")
    assert gemm._batch_strided() is not None
    for a, b, out in winograd_stacks(256, 128, 64):
        assert a.shape[1] * a.shape[2] * b.shape[2] > gemm.SMALL_PRODUCT
        # every stack has a layout CBLAS takes, so the one call, not the loop, computes it
        assert None not in [gemm._layout(m) for m in (a, b, out)]
        assert gemm._layout(out)[0] == gemm._NO_TRANS
        out[...] = np.nan
        assert gemm._batch_call(a, b, out) is out
        np.testing.assert_allclose(out, np.matmul(a, b), rtol=1e-5, atol=1e-4)


def test_batched_matmul_without_a_unit_stride_axis_goes_to_numpy():
    # (4, 200, 150) @ (4, 150, 120)
    a, b = randn(4, 200, 300)[:, :, ::2], randn(4, 150, 240)[:, :, ::2]
    out = np.empty((4, 200, 120), np.float32)
    gemm.batched_matmul(a, b, out)
    np.testing.assert_array_equal(out, np.matmul(a, b))


# ----- the products on the kernels' team -----
team_only = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2 or not gemm.team_gemms(2),
                               reason="no team of two threads, or no BLAS the team can "
                                      "call (MKL, or NumPy's OpenBLAS on one thread)")


blas_calls = pytest.mark.skipif(not gemm.team_gemms(2),
                                reason="no BLAS this module can call (MKL, or NumPy's "
                                       "OpenBLAS without OPENBLAS_NUM_THREADS above 1)")


@pytest.fixture
def two_threads():
    """Numba's team at two threads for the test, its count restored afterwards."""
    before = numba.get_num_threads()
    numba.set_num_threads(2)
    yield
    numba.set_num_threads(before)


def mkl_installed():
    import importlib.metadata
    try:
        return importlib.metadata.files("mkl") is not None
    except importlib.metadata.PackageNotFoundError:
        return False


def needs_mkl():
    """Skips the test where MKL is not installed (launch.sh installs it on Intel's CPUs)."""
    if not mkl_installed():
        pytest.skip(f"MKL is not installed: the set-up adds it on Intel's CPUs only; "
                    f"`{sys.executable} -m pip install mkl` adds it here")


def cpu_maker():
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...), read here, apart from
    kernels.blas_choice.cpu_vendor, which the tests check."""
    with open("/proc/cpuinfo") as f:
        return re.search(r"^vendor_id\s*:\s*(\S+)$", f.read(), re.M).group(1)


def choose_blas(name, monkeypatch):
    """The team's BLAS made `name` for one test, as MPITRAIN_BLAS chooses it (the cached
    choice dropped, before and after: monkeypatch restores the variable after this)."""
    if name == "mkl":
        needs_mkl()
    monkeypatch.setenv("MPITRAIN_BLAS", name)
    gemm.team_blas.cache_clear()
    blas = gemm.team_blas()
    assert blas.name == name
    return blas


@pytest.fixture(params=["mkl", "openblas"])
def each_blas(request, monkeypatch):
    """The test once with MKL as the team's BLAS, once with NumPy's OpenBLAS, whichever
    this CPU takes by default (kernels.blas_choice)."""
    yield choose_blas(request.param, monkeypatch)
    gemm.team_blas.cache_clear()


@pytest.fixture
def mkl_blas(monkeypatch):
    yield choose_blas("mkl", monkeypatch)
    gemm.team_blas.cache_clear()


def blas_alone(a, b, base=None):
    """Every product of the (count, m, k) @ (count, k, n) stacks, or base + it, by one
    cblas_sgemm call each of the team's BLAS (kernels.gemm.team_blas) on this thread, the
    operands in the layouts the team passes: the bits the team's products must have."""
    blas = gemm.team_blas()
    assert blas.threads() == 1
    size = ctypes.c_int64 if blas.integer == np.int64 else ctypes.c_int32
    sgemm = ctypes.CFUNCTYPE(None, *[ctypes.c_int] * 3, size, size, size, ctypes.c_float,
                             ctypes.c_void_p, size, ctypes.c_void_p, size, ctypes.c_float,
                             ctypes.c_void_p, size)(blas.sgemm)
    out = np.zeros(a.shape[:2] + b.shape[2:], np.float32) if base is None else base.copy()
    for x, y, z in zip(a, b, out):
        (ta, lda, _), (tb, ldb, _) = gemm._layout(x[None]), gemm._layout(y[None])
        sgemm(gemm._ROW_MAJOR, ta, tb, x.shape[0], y.shape[1], x.shape[1], 1.0, x.ctypes.data,
              lda, y.ctypes.data, ldb, 0.0 if base is None else 1.0, z.ctypes.data, z.shape[1])
    return out


@team_only
@pytest.mark.parametrize("m, q, n", [(300, 70, 90),      # bands of rows
                                     (64, 500, 200),     # bands of columns (MKL)
                                     (41, 4000, 17),     # 2 bands of 20 and 21 rows (MKL)
                                     (600, 300, 70),     # of rows, with either BLAS
                                     (200, 300, 500)])   # of columns (MKL), of rows (OpenBLAS)
@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True), (True, True)])
def test_a_product_cut_into_bands_has_the_bits_of_one_call(m, q, n, ta, tb, two_threads,
                                                           each_blas):
    """Each band is one call of the BLAS over the whole inner dimension, so the product
    has the bits of the BLAS's own product in one call, whichever operand is transposed
    (a transposed operand: a view of the transposed array, as conv's dy.T is)."""
    a = randn(q, m).T if ta else randn(m, q)
    b = randn(n, q, seed=1).T if tb else randn(q, n, seed=1)
    y = np.full((m, n), np.nan, np.float32)
    assert gemm._on_team(a[None], b[None], y[None]) is not None
    np.testing.assert_array_equal(y, blas_alone(a[None], b[None])[0])
    np.testing.assert_array_equal(gemm.matmul(a, b), y)
    assert_float32_product(y, a, b)


@team_only
@pytest.mark.parametrize("T, C, O", [(128, 256, 256), (512, 64, 48)])
def test_a_stack_dealt_out_to_the_team_has_the_bits_of_one_call_each(T, C, O, two_threads,
                                                                    each_blas):
    """Winograd's stacks, a whole product per thread: each as the BLAS computes it alone."""
    for a, b, out in winograd_stacks(T, C, O):
        assert gemm._on_team(a, b, out) is out
        np.testing.assert_array_equal(out, blas_alone(a, b))
    # a stack of fewer products than threads: each product in bands
    a, b, out = randn(1, 400, 300), randn(1, 300, 200, seed=1), np.empty((1, 400, 200), np.float32)
    assert gemm.batched_matmul(a, b, out) is out
    np.testing.assert_array_equal(out, blas_alone(a, b))


def test_bands_are_whole_granules_and_cover_the_side():
    """band_rows: consecutive, non-empty bands from 0 to the side's end, each starting at
    the multiple of the granule nearest the even cut; with granule 1, the even cut
    (sizes differ by one at most)."""
    for size, bands, granule in [(600, 2, 48), (200, 2, 48), (191, 3, 48), (41, 2, 1),
                                 (1000, 7, 1), (96, 2, 48), (5000, 16, 12), (128, 2, 12)]:
        cuts = [gemm.band_rows(b, bands, size, granule) for b in range(bands)]
        assert cuts[0][0] == 0 and cuts[-1][1] == size
        assert all(lo < hi for lo, hi in cuts), cuts
        assert all(cuts[i][1] == cuts[i + 1][0] for i in range(bands - 1)), cuts
        for b, (lo, _) in enumerate(cuts):
            assert lo % granule == 0 and abs(lo - b * size / bands) <= granule / 2, cuts
        if granule == 1:
            assert max(hi - lo for lo, hi in cuts) - min(hi - lo for lo, hi in cuts) <= 1
    assert [gemm.band_rows(b, 2, 128, 12) for b in range(2)] == [(0, 60), (60, 128)]


def test_the_team_takes_numpys_openblas_not_scipys():
    """SciPy's wheel brings an OpenBLAS of its own; the team's is NumPy's, the one
    np.matmul runs (whose bits it must have), whichever threadpoolctl lists first. NumPy's
    is the one that `import numpy` alone maps into a fresh process (NumPy's wheel, or a
    distribution's NumPy and its shared OpenBLAS)."""
    import scipy.linalg  # noqa: F401  (loads SciPy's OpenBLAS)
    from threadpoolctl import threadpool_info
    numpys = in_fresh_process(
        "import json, os, numpy\n"
        "paths = (line.split()[-1] for line in open('/proc/self/maps'))\n"
        "print(json.dumps(sorted({os.path.realpath(p) for p in paths\n"
        "                         if 'openblas' in os.path.basename(p)})))")
    infos = threadpool_info()
    chosen = gemm.numpys_openblas(infos)
    assert chosen is not None and gemm.numpys_openblas(infos[::-1]) == chosen
    assert [os.path.realpath(chosen["filepath"])] == numpys, (chosen, numpys)
    assert gemm._openblas().lib._name == chosen["filepath"]
    a, b = randn(300, 200), randn(200, 100, seed=1)
    y = np.empty((300, 100), np.float32)
    gemm._openblas().call(gemm._ROW_MAJOR, gemm._NO_TRANS, gemm._NO_TRANS, 300, 100, 200, 1.0,
                          a.ctypes.data, 200, b.ctypes.data, 100, 0.0, y.ctypes.data, 100)
    np.testing.assert_array_equal(y, np.matmul(a, b))


def test_openblas_products_are_cut_by_rows_at_its_core_types_row_block(monkeypatch,
                                                                      two_threads):
    """With OpenBLAS, a product cut in two at any multiple of its core type's row block
    has the bits of one call, and the team cuts a wide product (more columns than rows)
    by rows too: a cut that its kernels' blocks of columns would straddle changes bits
    (docs/benchmarks.md, "The BLAS by CPU"). OPENBLAS_ROWS, for the core types not
    listed, is a multiple of every listed block."""
    assert all(gemm.OPENBLAS_ROWS % g == 0 for g in gemm.OPENBLAS_ROW_BLOCKS.values())
    blas = choose_blas("openblas", monkeypatch)
    try:
        for m, q, n in [(200, 300, 250), (577, 64, 131), (128, 600, 300)]:
            a, b = randn(m, q), randn(q, n, seed=1)
            whole = blas_alone(a[None], b[None])[0]
            first = -(-gemm.MIN_BAND // blas.granule) * blas.granule
            for r in range(first, m - gemm.MIN_BAND + 1, blas.granule):
                if min(r, m - r) * n * q < gemm.TEAM_MIN_MACS:
                    continue                    # OpenBLAS's small-matrix kernels: not the team's
                cut = np.concatenate([blas_alone(a[None, :r], b[None])[0],
                                      blas_alone(a[None, r:], b[None])[0]])
                np.testing.assert_array_equal(cut, whole, err_msg=f"{(m, q, n)} cut at {r}")
        a, b = randn(200, 300), randn(300, 500, seed=1)
        y = np.full((200, 500), np.nan, np.float32)
        assert gemm._on_team(a[None], b[None], y[None]) is not None
        np.testing.assert_array_equal(y, blas_alone(a[None], b[None])[0])
    finally:
        gemm.team_blas.cache_clear()


def test_with_mkl_one_thread_computes_the_products_as_the_team_does(mkl_blas):
    """MKL takes the team's products on one thread too, called from Python there (a
    Numba kernel's launch cost more): each product, of a stack or alone, with the bits of
    one MKL call, as on the team."""
    stacks = winograd_stacks(128, 256, 64) + [(randn(1, 300, 400), randn(1, 400, 200, seed=1),
                                               np.empty((1, 300, 200), np.float32))]
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        for a, b, out in stacks:
            assert gemm._on_team(a, b, out) is out
            np.testing.assert_array_equal(out, blas_alone(a, b))
    finally:
        numba.set_num_threads(threads)


@team_only
def test_the_team_path_is_taken_only_where_it_can_be(two_threads, each_blas):
    """Not for a product under TEAM_MIN_MACS, float64, an output that is not row-major,
    or one thread where the BLAS is NumPy's own (None: the caller then takes np.matmul,
    with the same bits); otherwise into the given output, or a new one."""
    big = randn(256, 256)
    y = np.zeros((256, 256), np.float32)
    small = randn(64, 64)
    assert gemm._on_team(small[None], small[None], y[None, :64, :64]) is None
    assert gemm._on_team(big[None].astype(np.float64), big[None].astype(np.float64),
                         y[None].astype(np.float64)) is None
    assert gemm._on_team(big[None], big[None], y.T[None]) is None
    try:
        numba.set_num_threads(1)
        alone = gemm._on_team(big[None], big[None], y[None])
        assert (alone is None) == gemm.team_blas().numpys
    finally:
        numba.set_num_threads(2)
    out = y[None]
    assert gemm._on_team(big[None], big[None], out) is out
    np.testing.assert_array_equal(y, blas_alone(big[None], big[None])[0])
    made = gemm._on_team(big[None], big[None], None)        # no out: a new array
    np.testing.assert_array_equal(made[0], y)


@team_only
@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_non_finite_operand_reaches_a_product_on_the_team(bad, two_threads, each_blas):
    a, b = randn(256, 300), randn(300, 128, seed=1)
    a[200, 5] = bad
    y = gemm.matmul(a, b)
    ref = a.astype(np.float64) @ b
    np.testing.assert_array_equal(np.isfinite(y), np.isfinite(ref))
    assert not np.isfinite(y[200]).any() and np.isfinite(y[:200]).all()


# ----- accumulating products: out += a @ b -----
def assert_float32_sum(y, base, a, b):
    """|y - (base + a b)| <= (K + 1) eps32 (|base| + |a| |b|), elementwise, in float64."""
    a64, b64, c64 = a.astype(np.float64), b.astype(np.float64), base.astype(np.float64)
    bound = (a.shape[1] + 1) * 2.0 ** -23 * (np.abs(c64) + np.abs(a64) @ np.abs(b64))
    assert y.dtype == np.float32
    assert np.all(np.abs(y - (c64 + a64 @ b64)) <= bound)


@pytest.mark.parametrize("m, q, n", [(300, 64, 200), (300, 1000, 200),
                                     (20, 30, 10)])         # under TEAM_MIN_MACS: NumPy's
def test_an_accumulating_product_adds_into_out(m, q, n, each_blas):
    """out += a @ b: into out itself, the float32 sum within its rounding bound of the
    float64 one: the BLAS's own product with beta = 1 where the team takes it, else
    NumPy's product, then added."""
    a, b, base = randn(q, m).T, randn(q, n, seed=1), randn(m, n, seed=2)   # a: as dy.T
    out = base.copy()
    assert gemm.matmul(a, b, out=out, accumulate=True) is out
    assert_float32_sum(out, base, a, b)
    if m * q * n < gemm.TEAM_MIN_MACS:
        np.testing.assert_array_equal(out, base + np.matmul(a, b))
    elif gemm.team_blas() is not None:
        np.testing.assert_array_equal(out, blas_alone(a[None], b[None], base[None])[0])


def test_an_accumulating_product_takes_numpy_where_the_gemms_cannot():
    """float64, or an out that is not C-contiguous: NumPy's product, added into out."""
    a, b, base = randn(300, 200), randn(200, 100, seed=1), randn(300, 100, seed=2)
    for dtype, order in [(np.float32, "F"), (np.float64, "C"), (np.float64, "F")]:
        x, y = a.astype(dtype), b.astype(dtype)
        out = base.astype(dtype, order=order)
        assert gemm.matmul(x, y, out=out, accumulate=True) is out
        np.testing.assert_array_equal(out, base.astype(dtype) + np.matmul(x, y))


@blas_calls
def test_an_accumulating_product_has_the_same_bits_on_one_thread_and_on_the_team(each_blas):
    """Each element one BLAS call over the whole inner dimension, on one thread too (not
    NumPy's product and an add, which round otherwise past one inner block)."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one Numba thread (NUMBA_NUM_THREADS=1): no second count to compare")
    a, b, base = randn(2000, 300).T, randn(2000, 200, seed=1), randn(300, 200, seed=2)
    threads = numba.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            numba.set_num_threads(count)
            out = base.copy()
            gemm.matmul(a, b, out=out, accumulate=True)
            results.append(out)
    finally:
        numba.set_num_threads(threads)
    np.testing.assert_array_equal(results[0], results[1])
    assert_float32_sum(results[0], base, a, b)


def in_fresh_process(code, **env):
    """stdout's JSON of `code` run in a new Python with two Numba threads and `env` (a None
    value removes the variable)."""
    env = {**os.environ, "NUMBA_NUM_THREADS": "2", **env}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={k: v for k, v in env.items() if v is not None}, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.mark.parametrize("blas_threads, on_team", [(None, True), ("1", True), ("2", False)])
def test_openblas_runs_one_thread_unless_the_user_gives_it_more(blas_threads, on_team):
    """In a fresh process, OpenBLAS the team's BLAS (MPITRAIN_BLAS=openblas): after a
    GEMM, NumPy's OpenBLAS runs on one thread and the team takes the products, unless
    OPENBLAS_NUM_THREADS gives OpenBLAS threads of its own, which it then keeps (and the
    products go to it); the run's environment report says which."""
    threads, team, said = in_fresh_process(
        "import mpitrain, json, numba, numpy as np; from mpitrain.kernels import gemm; "
        "numba.set_num_threads(2); a = np.ones((256, 256), np.float32); gemm.matmul(a, a); "
        "print(json.dumps([gemm._openblas().threads(), gemm.team_gemms(2), "
        "[gemm.describe(n) for n in (1, 2)]]))",
        MPITRAIN_BLAS="openblas", OPENBLAS_NUM_THREADS=blas_threads)
    assert team == on_team
    assert threads == (1 if on_team else 2)
    version = gemm._openblas().version
    assert said == ([f"openblas {version}, on one thread",
                     f"openblas {version}, cut among the team's 2 threads"] if on_team else
                    [f"openblas {version}, on its own 2 threads (OPENBLAS_NUM_THREADS)"] * 2)


@pytest.mark.parametrize("choice", [None, "mkl", "MKL", "openblas", "OpenBLAS", "atlas"])
def test_the_team_blas_is_mkl_on_intel_where_installed_unless_mpitrain_blas_chooses(choice):
    """MPITRAIN_BLAS unset: MKL where the mkl package is installed and the CPU is Intel's
    (/proc/cpuinfo's vendor_id), else NumPy's OpenBLAS; mkl or openblas (any case): that
    one, an error naming the fix where MKL is asked for and missing; anything else: an
    error naming the choices. MKL runs no thread of its own, and the team takes products
    on one thread too (its bits are not np.matmul's); NumPy's OpenBLAS, set to one thread,
    still runs NumPy's own products either way."""
    code = ("import mpitrain, json; from mpitrain.kernels import gemm\n"
            "try:\n    b = gemm.team_blas(); out = [b.name, b.threads(), b.numpys, "
            "gemm._openblas().threads()]\n"
            "except ValueError as e:\n    out = str(e)\n"
            "print(json.dumps(out))")
    got = in_fresh_process(code, MPITRAIN_BLAS=choice, OPENBLAS_NUM_THREADS=None)
    want = (choice or ("mkl" if cpu_maker() == "GenuineIntel" else "openblas")).lower()
    if want == "mkl" and not mkl_installed():
        want = "openblas" if choice is None else None
    if choice == "atlas":
        assert "MPITRAIN_BLAS='atlas': expected mkl or openblas (or unset)" in got
    elif want is None:
        assert "MKL is not installed here: `" in got and " -m pip install mkl` installs it" in got
    else:
        assert got == [want, 1, want == "openblas", 1]


def test_mkl_products_have_the_same_bits_at_any_alignment(mkl_blas):
    """MKL runs in its reproducible mode (CBWR AUTO, STRICT): the same product from
    operands copied to other addresses, 4 bytes off a 64-byte boundary or on one, has the
    same bits, as a resumed run needs of arrays that land elsewhere."""
    a, b = randn(300, 500), randn(500, 200, seed=1)
    results = []
    for offset in (0, 1, 3, 16):
        buf = np.empty(a.size + b.size + 64, np.float32)
        start = (-buf.ctypes.data // 4) % 16 + offset                # 64-byte aligned, then off
        x = buf[start:start + a.size].reshape(a.shape)
        y = buf[start + a.size:start + a.size + b.size].reshape(b.shape)
        x[...], y[...] = a, b
        results.append(blas_alone(x[None], y[None])[0])
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])
    assert gemm.team_blas().name == "mkl"
