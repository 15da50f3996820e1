"""The optimizer kernels (mpitrain.kernels: norms, update, lamb, overflow, cast).

Numba CPU kernels run on fp32 arenas and are compared with the NumPy reference
run on float64 copies, and with loops written out here. The CUDA kernels run
under the numba-cuda simulator in a subprocess (NUMBA_ENABLE_CUDASIM must be
set before numba.cuda is first imported) on arenas of a few hundred elements.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from mpitrain.arena import SEGMENT_DTYPE
from mpitrain.kernels import cast, lamb, norms, overflow, segments, update

SIZES = (1, 7, 3001, 64, 129, 0, 2, 1000)        # 1, odd, a few thousand, an empty one
DECAY = (0, 1, 1, 0, 1, 1, 0, 1)
LARS = (0, 1, 1, 0, 0, 1, 0, 1)
SIM_SIZES = (1, 7, 150, 33, 0, 10)              # the simulator runs ~1000 elements/s
SIM_DECAY = (1, 1, 0, 1, 0, 0)
SIM_LARS = (1, 0, 1, 1, 1, 0)


def make_segments(sizes, decay, lars):
    seg = np.zeros(len(sizes), SEGMENT_DTYPE)
    seg["size"] = sizes
    seg["offset"] = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    seg["decay"] = decay
    seg["lars"] = lars
    return seg


def make_arena(seg, seed=0):
    """fp32 master, grad (loss-scaled by 8) and momentum; parameters of different scales."""
    rng = np.random.default_rng(seed)
    n = int(seg["size"].sum())
    scale = np.repeat(10.0 ** rng.uniform(-2, 1, len(seg)), seg["size"])
    master = (rng.standard_normal(n) * scale).astype(np.float32)
    grad = (rng.standard_normal(n) * 8).astype(np.float32)
    momentum = (rng.standard_normal(n) * 0.01).astype(np.float32)
    return master, grad, momentum


@pytest.fixture
def small_chunks(monkeypatch):
    """CPU chunks of 1000 elements, so that parameters span several chunks and pieces."""
    monkeypatch.setattr(segments, "CPU_CHUNK", 1000)


# ----- layout -----

def test_layout_pieces_tile_the_arena_inside_segments_and_chunks():
    seg = make_segments(SIZES, DECAY, LARS)
    lay = segments.layout(seg, chunk=1000)
    n = int(seg["size"].sum())
    assert lay.piece_start[0] == 0 and lay.piece_stop[-1] == n
    assert np.all(lay.piece_start[1:] == lay.piece_stop[:-1])
    end = seg["offset"] + seg["size"]
    assert np.all(lay.piece_start >= seg["offset"][lay.piece_seg])
    assert np.all(lay.piece_stop <= end[lay.piece_seg])
    assert np.all(lay.piece_start // 1000 == (lay.piece_stop - 1) // 1000)
    for s in range(len(seg)):
        own = np.flatnonzero(lay.piece_seg == s)
        assert list(own) == list(range(lay.seg_first[s], lay.seg_first[s + 1]))
    assert lay.seg_first[5] == lay.seg_first[6]                 # the empty segment has no piece
    for c in range(lay.chunk_first.size - 1):
        chunk = slice(lay.chunk_first[c], lay.chunk_first[c + 1])
        assert lay.piece_start[chunk][0] == 1000 * c
        assert lay.piece_stop[chunk][-1] == min(1000 * (c + 1), n)


def test_pick_chooses_by_array_type_and_rejects_unknown_names():
    x = np.zeros(3, np.float32)
    assert segments.pick(None, x) == "numba"
    assert segments.pick("numpy", x) == "numpy"
    with pytest.raises(ValueError, match="unknown kernel implementation"):
        segments.pick("fortran", x)


# ----- norms -----

def test_segment_norms_numba_equal_float64_reference(small_chunks):
    seg = make_segments(SIZES, DECAY, LARS)
    master, grad, _ = make_arena(seg)
    w_norm, g_norm = norms.segment_norms(master, grad, seg, impl="numba")
    for s, (offset, size) in enumerate(zip(seg["offset"], seg["size"])):
        w = master[offset:offset + size].astype(np.float64)
        g = grad[offset:offset + size].astype(np.float64)
        np.testing.assert_allclose(w_norm[s], np.sqrt(np.sum(w * w)), rtol=1e-13)
        np.testing.assert_allclose(g_norm[s], np.sqrt(np.sum(g * g)), rtol=1e-13)
    ref = norms.segment_norms(master.astype(np.float64), grad.astype(np.float64), seg, "numpy")
    np.testing.assert_allclose(w_norm, ref[0], rtol=1e-13)
    np.testing.assert_allclose(g_norm, ref[1], rtol=1e-13)


# ----- fused SGD / LARS -----

STEP = dict(lr=0.1, momentum=0.9, weight_decay=1e-2, inv_scale=1 / 8, eta=0.02, eps=1e-9)


def reference_step(master, grad, velocity, seg, **kw):
    """The NumPy reference on float64 copies: (master, velocity, local_lr)."""
    w, v = master.astype(np.float64), velocity.astype(np.float64)
    local_lr = update.sgd_update(w, w, grad.astype(np.float64), v, seg, impl="numpy", **kw)
    return w, v, local_lr


@pytest.mark.parametrize("trust", [False, True], ids=["sgd", "lars"])
@pytest.mark.parametrize("nesterov", [False, True], ids=["plain", "nesterov"])
@pytest.mark.parametrize("working", ["fp16", "master"])
def test_fused_update_numba_equals_float64_reference(small_chunks, trust, nesterov, working):
    seg = make_segments(SIZES, DECAY, LARS)
    master, grad, momentum = make_arena(seg)
    kw = dict(STEP, trust=trust, nesterov=nesterov)
    w_ref, v_ref, lr_ref = reference_step(master, grad, momentum, seg, **kw)
    half = np.zeros(master.size, np.float16) if working == "fp16" else master
    local_lr = update.sgd_update(master, half, grad, momentum, seg, impl="numba", **kw)
    np.testing.assert_allclose(local_lr, lr_ref, rtol=1e-12)
    np.testing.assert_allclose(momentum, v_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(master, w_ref, rtol=1e-6, atol=1e-7)
    assert np.array_equal(half, master.astype(half.dtype))    # working = cast(new master)
    if trust:
        assert np.ptp(local_lr[seg["lars"].astype(bool) & (seg["size"] > 0)]) > 0
    else:
        assert np.all(local_lr == 1.0)


def test_fused_update_numba_in_float64_matches_reference_tightly(small_chunks):
    seg = make_segments(SIZES, DECAY, LARS)
    master, grad, momentum = (a.astype(np.float64) for a in make_arena(seg))
    kw = dict(STEP, trust=True, nesterov=True)
    w_ref, v_ref, _ = reference_step(master, grad, momentum, seg, **kw)
    update.sgd_update(master, master, grad, momentum, seg, impl="numba", **kw)
    np.testing.assert_allclose(momentum, v_ref, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(master, w_ref, rtol=1e-12, atol=1e-15)


def test_lars_norms_are_per_parameter_not_whole_arena():
    # two LARS parameters of very different scales: one arena-wide norm would give
    # both the same local_lr; per parameter they differ by about 100x
    seg = make_segments((500, 300), (1, 1), (1, 1))
    rng = np.random.default_rng(3)
    master = np.concatenate([rng.standard_normal(500) * 10, rng.standard_normal(300) * 0.1])
    grad = rng.standard_normal(800) * 0.5
    master, grad = master.astype(np.float32), grad.astype(np.float32)
    lr, eta, wd = 0.5, 0.01, 1e-3

    def lars_step(w_norms, g_norms):
        w, g = master.astype(np.float64), grad.astype(np.float64)
        out = w.copy()
        for s, (offset, size) in enumerate(zip(seg["offset"], seg["size"])):
            sl = slice(offset, offset + size)
            local = eta * w_norms[s] / (g_norms[s] + wd * w_norms[s])
            out[sl] -= lr * local * (g[sl] + wd * w[sl])    # zero momentum: v = lr local_lr g
        return out

    sl = [slice(0, 500), slice(500, 800)]
    per_param = lars_step([np.linalg.norm(master[s].astype(np.float64)) for s in sl],
                          [np.linalg.norm(grad[s].astype(np.float64)) for s in sl])
    whole = lars_step([np.linalg.norm(master.astype(np.float64))] * 2,
                      [np.linalg.norm(grad.astype(np.float64))] * 2)
    w, v = master.copy(), np.zeros(800, np.float32)
    update.sgd_update(w, w, grad, v, seg, lr=lr, momentum=0.9, weight_decay=wd, trust=True,
                      eta=eta, eps=0.0, impl="numba")
    np.testing.assert_allclose(w, per_param, rtol=1e-6, atol=1e-6)
    assert np.abs(w - whole).max() > 1e3 * np.abs(w - per_param).max()


@pytest.mark.parametrize("nesterov", [False, True], ids=["plain", "nesterov"])
def test_sgd_trust_off_equals_pytorch_style_sgd_for_three_steps(nesterov):
    seg = make_segments((12, 5, 40), (1, 0, 1), (1, 0, 1))
    rng = np.random.default_rng(4)
    w0 = rng.standard_normal(57).astype(np.float32)
    grads = [rng.standard_normal(57).astype(np.float32) for _ in range(3)]
    lr, m, wd = 0.05, 0.9, 1e-2
    decay = np.repeat(seg["decay"], seg["size"]).astype(bool)
    w, buf = w0.astype(np.float64), np.zeros(57)
    for g in grads:                                   # torch.optim.SGD's formulas, dampening 0
        d = g.astype(np.float64) + np.where(decay, wd, 0.0) * w
        buf = m * buf + d
        w = w - lr * (d + m * buf if nesterov else buf)
    ours, v = w0.copy(), np.zeros(57, np.float32)
    for g in grads:
        update.sgd_update(ours, ours, g, v, seg, lr=lr, momentum=m, weight_decay=wd,
                          nesterov=nesterov, impl="numba")
    np.testing.assert_allclose(ours, w, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(v, lr * buf, rtol=1e-5, atol=1e-7)   # v = lr * torch's buffer


@pytest.mark.torch
def test_sgd_trust_off_equals_torch_optim_sgd():
    import torch
    seg = make_segments((12, 5, 40), (1, 0, 1), (1, 0, 1))
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal(57)
    grads = [rng.standard_normal(57) for _ in range(3)]
    params = [torch.tensor(w0[o:o + n]) for o, n in zip(seg["offset"], seg["size"])]
    groups = [{"params": [p], "weight_decay": 1e-2 if d else 0.0}
              for p, d in zip(params, seg["decay"])]
    opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True)
    ours, v = w0.copy(), np.zeros(57)
    for g in grads:
        for p, o, n in zip(params, seg["offset"], seg["size"]):
            p.grad = torch.tensor(g[o:o + n])
        opt.step()
        update.sgd_update(ours, ours, g, v, seg, lr=0.05, momentum=0.9, weight_decay=1e-2,
                          nesterov=True, impl="numba")
    np.testing.assert_allclose(ours, torch.cat([p.detach() for p in params]).numpy(),
                               rtol=1e-12, atol=1e-14)


def test_lars_with_no_lars_segments_is_sgd_bit_for_bit():
    seg = make_segments(SIZES, DECAY, (0,) * len(SIZES))
    master, grad, momentum = make_arena(seg)
    a = [master.copy(), momentum.copy()]
    b = [master.copy(), momentum.copy()]
    update.sgd_update(a[0], a[0], grad, a[1], seg, **STEP, trust=True, impl="numba")
    update.sgd_update(b[0], b[0], grad, b[1], seg, **STEP, trust=False, impl="numba")
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


# ----- LAMB -----

def lamb_by_hand(w, grads, seg, lr, beta1, beta2, eps, wd, inv_scale):
    """Three LAMB steps in float64, one parameter at a time, written out."""
    w = w.astype(np.float64)
    m, v = np.zeros_like(w), np.zeros_like(w)
    for t, grad in enumerate(grads, start=1):
        for offset, size, decay, lars in seg[["offset", "size", "decay", "lars"]]:
            sl = slice(offset, offset + size)
            g = grad[sl].astype(np.float64) * inv_scale
            m[sl] = beta1 * m[sl] + (1 - beta1) * g
            v[sl] = beta2 * v[sl] + (1 - beta2) * g ** 2
            m_hat, v_hat = m[sl] / (1 - beta1 ** t), v[sl] / (1 - beta2 ** t)
            r = m_hat / (np.sqrt(v_hat) + eps) + (wd * w[sl] if decay else 0.0)
            w_norm, r_norm = np.linalg.norm(w[sl]), np.linalg.norm(r)
            ratio = w_norm / r_norm if lars and w_norm > 0 and r_norm > 0 else 1.0
            w[sl] -= lr * ratio * r
    return w, m, v


def test_lamb_numba_and_numpy_match_hand_computed_reference_for_three_steps(small_chunks):
    seg = make_segments(SIZES, DECAY, LARS)
    master, _, _ = make_arena(seg)
    rng = np.random.default_rng(6)
    grads = [(rng.standard_normal(master.size) * 8).astype(np.float32) for _ in range(3)]
    hp = dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=1e-2, inv_scale=1 / 8)
    w_ref, m_ref, v_ref = lamb_by_hand(master, grads, seg, hp["lr"], hp["beta1"], hp["beta2"],
                                       hp["eps"], hp["weight_decay"], hp["inv_scale"])
    w32, half = master.copy(), np.zeros(master.size, np.float16)
    m32, v32 = lamb.lamb_state(w32)
    w64 = master.astype(np.float64)
    m64, v64 = lamb.lamb_state(w64)
    for t, g in enumerate(grads, start=1):
        ratio = lamb.lamb_update(w32, half, g, m32, v32, seg, step=t, impl="numba", **hp)
        lamb.lamb_update(w64, w64, g.astype(np.float64), m64, v64, seg, step=t, impl="numpy", **hp)
    np.testing.assert_allclose(w64, w_ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(m32, m_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(v32, v_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(w32, w_ref, rtol=1e-5, atol=1e-6)
    assert np.array_equal(half, w32.astype(np.float16))
    on = seg["lars"].astype(bool) & (seg["size"] > 0)
    assert np.all(ratio[~on] == 1.0) and np.all(ratio[on] != 1.0)


# ----- overflow -----

@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_overflow_check_finds_one_nonfinite_value_anywhere(small_chunks, bad):
    grad = np.random.default_rng(7).standard_normal(3001).astype(np.float32)
    grad[17] = 3e38                                     # large but finite
    assert not overflow.has_overflow(grad, impl="numba")
    for where in (0, 1500, 3000):
        g = grad.copy()
        g[where] = bad
        assert overflow.has_overflow(g, impl="numba"), where
        assert overflow.has_overflow(g, impl="numpy"), where


def test_overflow_check_of_an_empty_array_is_clean():
    assert not overflow.has_overflow(np.zeros(0, np.float32), impl="numba")


# ----- casts -----

def test_to_half_rounds_like_numpy():
    rng = np.random.default_rng(8)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, -65520, 1e-8,
               2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -14, 1 + 2.0 ** -11,
               1 + 3 * 2.0 ** -11, 2049, 2051]            # ties to even, subnormals, overflow
    x = np.concatenate([special, rng.standard_normal(5000) * 10.0 ** rng.uniform(-9, 5, 5000)])
    x = x.astype(np.float32)
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16)
    got = cast.to_half(x, impl="numba")
    assert got.dtype == np.float16
    assert np.array_equal(got.view(np.uint16)[~np.isnan(x)], expected.view(np.uint16)[~np.isnan(x)])
    assert np.all(np.isnan(got[np.isnan(x)]))


def test_to_float_is_exact_for_every_half():
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    got = cast.to_float(h, impl="numba")
    assert np.array_equal(got, h.astype(np.float32), equal_nan=True)


def test_casts_check_dtypes():
    with pytest.raises(TypeError):
        cast.to_half(np.zeros(3, np.float64))


# ----- CUDA kernels under the numba-cuda simulator -----

def sim_arena():
    seg = make_segments(SIM_SIZES, SIM_DECAY, SIM_LARS)
    return (seg, *make_arena(seg, seed=9))


def sim_norms():
    seg, master, grad, _ = sim_arena()
    got = norms.segment_norms(master, grad, seg, impl="cuda")
    ref = norms.segment_norms(master.astype(np.float64), grad.astype(np.float64), seg, "numpy")
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-13)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-13)


def sim_update():
    seg, master0, grad, momentum0 = sim_arena()
    for trust, nesterov in [(False, False), (True, True)]:
        kw = dict(STEP, trust=trust, nesterov=nesterov)
        w_ref, v_ref, lr_ref = reference_step(master0, grad, momentum0, seg, **kw)
        master, momentum = master0.copy(), momentum0.copy()
        half = np.zeros(master.size, np.float16)
        local_lr = update.sgd_update(master, half, grad, momentum, seg, impl="cuda", **kw)
        np.testing.assert_allclose(local_lr, lr_ref, rtol=1e-12)
        np.testing.assert_allclose(momentum, v_ref, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(master, w_ref, rtol=1e-6, atol=1e-7)
        assert np.array_equal(half, master.astype(np.float16))


def sim_lamb():
    seg, master, grad, _ = sim_arena()
    grads = [grad, grad[::-1].copy()]
    hp = dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=1e-2, inv_scale=1 / 8)
    w_ref, m_ref, v_ref = lamb_by_hand(master, grads, seg, hp["lr"], hp["beta1"], hp["beta2"],
                                       hp["eps"], hp["weight_decay"], hp["inv_scale"])
    w, half = master.copy(), np.zeros(master.size, np.float16)
    m, v = lamb.lamb_state(w)
    for t, g in enumerate(grads, start=1):
        lamb.lamb_update(w, half, g, m, v, seg, step=t, impl="cuda", **hp)
    np.testing.assert_allclose(m, m_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(v, v_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6)
    assert np.array_equal(half, w.astype(np.float16))


def sim_overflow_and_casts():
    grad = np.random.default_rng(10).standard_normal(50).astype(np.float32)
    assert not overflow.has_overflow(grad, impl="cuda")
    for where, bad in [(0, np.inf), (25, np.nan), (49, -np.inf)]:
        g = grad.copy()
        g[where] = bad
        assert overflow.has_overflow(g, impl="cuda")
    x = np.array([0.5, 65520, 2.0 ** -25, 3 * 2.0 ** -25, -1 - 2.0 ** -11, np.nan, -np.inf] +
                 list(grad[:40]), np.float32)
    with np.errstate(over="ignore"):
        h = cast.to_half(x, impl="cuda")
        assert np.array_equal(h, x.astype(np.float16), equal_nan=True)
    assert np.array_equal(cast.to_float(h, impl="cuda"), h.astype(np.float32), equal_nan=True)


@pytest.mark.parametrize("check", ["sim_norms", "sim_update", "sim_lamb", "sim_overflow_and_casts"])
def test_cuda_kernels_under_the_simulator(check):
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"import test_update_kernels as t; t.{check}()")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
