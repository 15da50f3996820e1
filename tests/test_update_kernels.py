"""The optimizer kernels (mpitrain.kernels: update (norms, overflow check, SGD/LARS),
lamb, cast, segments).

Numba CPU kernels run on fp32 arenas and are compared with the NumPy reference
run on float64 copies, and with loops written out here. Arenas with padding
between the parameters (as mpitrain.arena lays them out) hold sentinel values
there, which no kernel may read into a norm or overwrite. The CUDA kernels run
under the numba-cuda simulator in a subprocess (NUMBA_ENABLE_CUDASIM must be
set before numba.cuda is first imported) on arenas of a few hundred elements.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from mpitrain.arena import SEGMENT_DTYPE
from mpitrain.kernels import cast, lamb, segments, update

SIZES = (1, 7, 3001, 64, 129, 0, 2, 1000)        # 1, odd, a few thousand, an empty one
DECAY = (0, 1, 1, 0, 1, 1, 0, 1)
LARS = (0, 1, 1, 0, 0, 1, 0, 1)
SIM_SIZES = (1, 7, 150, 33, 0, 10)              # the simulator runs ~1000 elements/s
SIM_DECAY = (1, 1, 0, 1, 0, 0)
SIM_LARS = (1, 0, 1, 1, 1, 0)
SIM_GAPS = (2, 0, 5, 300, 1, 3)                 # 300: more than a simulator piece (128)


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


# Padded arenas, as mpitrain.arena lays them out: GAPS[i] elements of padding before
# parameter i, TAIL after the last one. The padding holds sentinels: PAD in master,
# momentum and LAMB's moments, PAD_WORKING in the working copy, PAD_GRAD (finite, so that
# has_overflow stays quiet; large, so that it would swamp any norm it entered) in grad.
GAPS = (2, 0, 5, 2100, 1, 3, 0, 7)      # 2100: a CPU chunk of 1000 without any parameter
TAIL = 9
PAD, PAD_WORKING, PAD_GRAD = 7.0, 5.0, 1e4


def make_padded(sizes, gaps, decay, lars, tail=TAIL):
    """(packed, padded, total): the segment table of the parameters one after another, the
    table with gaps[i] elements of padding before parameter i, and the padded arena's size."""
    packed = make_segments(sizes, decay, lars)
    padded = packed.copy()
    padded["offset"] += np.cumsum(gaps)
    return packed, padded, int(padded["offset"][-1] + padded["size"][-1] + tail)


def padding(seg, total):
    """Boolean mask of the elements of a `total`-element arena that no segment holds."""
    pad = np.ones(total, bool)
    for offset, size in zip(seg["offset"], seg["size"]):
        pad[offset:offset + size] = False
    return pad


def spread(values, padded, total, fill):
    """The packed array `values` laid out by the padded table, `fill` in the padding."""
    out = np.full(total, fill, values.dtype)
    out[~padding(padded, total)] = values
    return out


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


def test_layout_with_gaps_cuts_pieces_only_inside_segments():
    _, seg, total = make_padded(SIZES, GAPS, DECAY, LARS)
    lay = segments.layout(seg, chunk=1000)
    covered = np.zeros(total, int)
    for a, b, s in zip(lay.piece_start, lay.piece_stop, lay.piece_seg):
        assert seg["offset"][s] <= a < b <= seg["offset"][s] + seg["size"][s]
        assert a // 1000 == (b - 1) // 1000                      # inside one chunk
        covered[a:b] += 1
    assert np.array_equal(covered, (~padding(seg, total)).astype(int))   # each element once
    for s in range(len(seg)):
        own = np.flatnonzero(lay.piece_seg == s)
        assert list(own) == list(range(lay.seg_first[s], lay.seg_first[s + 1]))
    end = int(seg["offset"][-1] + seg["size"][-1])
    assert lay.chunk_first.size - 1 == -(-end // 1000)           # chunks: equal arena ranges
    for c in range(lay.chunk_first.size - 1):
        own = slice(lay.chunk_first[c], lay.chunk_first[c + 1])
        assert np.all(lay.piece_start[own] >= 1000 * c)
        assert np.all(lay.piece_stop[own] <= 1000 * (c + 1))
    assert np.any(np.diff(lay.chunk_first) == 0)                 # the chunk inside the gap


@pytest.mark.parametrize("offsets,sizes,message", [
    ((0, 5), (10, 10), "must not overlap"),
    ((20, 0), (5, 5), "arena order"),
    ((0, 10, 12), (10, 5, 5), "starts before the end of segment 1"),
    ((0, 10), (10, -1), "negative"),
])
def test_layout_refuses_overlapping_or_unordered_segments(offsets, sizes, message):
    seg = np.zeros(len(sizes), SEGMENT_DTYPE)
    seg["offset"], seg["size"] = offsets, sizes
    with pytest.raises(ValueError, match=message):
        segments.layout(seg)


# ----- norms -----

def test_segment_norms_numba_equal_float64_reference(small_chunks):
    seg = make_segments(SIZES, DECAY, LARS)
    master, grad, _ = make_arena(seg)
    w_norm, g_norm = update.segment_norms(master, grad, seg, impl="numba")
    for s, (offset, size) in enumerate(zip(seg["offset"], seg["size"])):
        w = master[offset:offset + size].astype(np.float64)
        g = grad[offset:offset + size].astype(np.float64)
        np.testing.assert_allclose(w_norm[s], np.sqrt(np.sum(w * w)), rtol=1e-13)
        np.testing.assert_allclose(g_norm[s], np.sqrt(np.sum(g * g)), rtol=1e-13)
    ref = update.segment_norms(master.astype(np.float64), grad.astype(np.float64), seg, "numpy")
    np.testing.assert_allclose(w_norm, ref[0], rtol=1e-13)
    np.testing.assert_allclose(g_norm, ref[1], rtol=1e-13)


def norms_padded(impl, sizes, gaps, decay, lars, tail=TAIL):
    """segment_norms of `impl` on a padded arena equal the float64 reference on the packed
    parameters: nothing of the padding (PAD_GRAD would swamp a norm) is read."""
    packed, seg, total = make_padded(sizes, gaps, decay, lars, tail)
    master, grad, _ = make_arena(packed)
    w_norm, g_norm = update.segment_norms(spread(master, seg, total, PAD),
                                          spread(grad, seg, total, PAD_GRAD), seg, impl=impl)
    ref = update.segment_norms(master.astype(np.float64), grad.astype(np.float64), packed,
                               "numpy")
    np.testing.assert_allclose(w_norm, ref[0], rtol=1e-13)
    np.testing.assert_allclose(g_norm, ref[1], rtol=1e-13)


@pytest.mark.parametrize("impl", ["numpy", "numba"])
def test_segment_norms_read_no_padding(small_chunks, impl):
    norms_padded(impl, SIZES, GAPS, DECAY, LARS)


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


def padded_working(kind, master, total):
    """The working copy of a padded test arena: fp16 or a separate fp32 array with
    PAD_WORKING in every element, or master itself."""
    return master if kind == "master" else np.full(total, PAD_WORKING, kind)


def sgd_padded(impl, sizes, gaps, decay, lars, trust, working, tail=TAIL):
    """One Nesterov SGD/LARS step of `impl` on a padded fp32 arena, checked against the
    float64 reference on the packed parameters; the padding must keep its sentinels."""
    packed, seg, total = make_padded(sizes, gaps, decay, lars, tail)
    master, grad, momentum = make_arena(packed)
    kw = dict(STEP, trust=trust, nesterov=True)
    w_ref, v_ref, lr_ref = reference_step(master, grad, momentum, packed, **kw)
    w, v = spread(master, seg, total, PAD), spread(momentum, seg, total, PAD)
    work = padded_working(working, w, total)
    local_lr = update.sgd_update(w, work, spread(grad, seg, total, PAD_GRAD), v, seg,
                                 impl=impl, **kw)
    pad = padding(seg, total)
    assert np.all(w[pad] == PAD) and np.all(v[pad] == PAD)
    if work is not w:
        assert np.all(work[pad] == PAD_WORKING)
    np.testing.assert_allclose(local_lr, lr_ref, rtol=1e-12)
    np.testing.assert_allclose(v[~pad], v_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(w[~pad], w_ref, rtol=1e-6, atol=1e-7)
    assert np.array_equal(work[~pad], w[~pad].astype(work.dtype))


@pytest.mark.parametrize("impl", ["numpy", "numba"])
@pytest.mark.parametrize("trust", [False, True], ids=["sgd", "lars"])
@pytest.mark.parametrize("working", [np.float16, np.float32, "master"],
                         ids=["fp16", "fp32-copy", "master"])
def test_fused_update_leaves_padding_alone(small_chunks, impl, trust, working):
    sgd_padded(impl, SIZES, GAPS, DECAY, LARS, trust, working)


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


LAMB_HP = dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=1e-2, inv_scale=1 / 8)


def lamb_padded(impl, sizes, gaps, decay, lars, tail=TAIL):
    """Two LAMB steps of `impl` on a padded fp32 arena with an fp16 working copy, checked
    against lamb_by_hand on the packed parameters; the padding must keep its sentinels."""
    packed, seg, total = make_padded(sizes, gaps, decay, lars, tail)
    master, grad, _ = make_arena(packed)
    grads = [grad, grad[::-1].copy()]
    w_ref, m_ref, v_ref = lamb_by_hand(master, grads, packed, *(LAMB_HP[k] for k in (
        "lr", "beta1", "beta2", "eps", "weight_decay", "inv_scale")))
    w = spread(master, seg, total, PAD)
    m, v = spread(np.zeros_like(master), seg, total, PAD), spread(np.zeros_like(master), seg,
                                                                  total, PAD)
    half = padded_working(np.float16, w, total)
    for t, g in enumerate(grads, start=1):
        ratio = lamb.lamb_update(w, half, spread(g, seg, total, PAD_GRAD), m, v, seg, step=t,
                                 impl=impl, **LAMB_HP)
    pad = padding(seg, total)
    assert np.all(w[pad] == PAD) and np.all(m[pad] == PAD) and np.all(v[pad] == PAD)
    assert np.all(half[pad] == PAD_WORKING)
    np.testing.assert_allclose(m[~pad], m_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(v[~pad], v_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(w[~pad], w_ref, rtol=1e-5, atol=1e-6)
    assert np.array_equal(half[~pad], w[~pad].astype(np.float16))
    on = seg["lars"].astype(bool) & (seg["size"] > 0)
    assert np.all(ratio[~on] == 1.0) and np.all(ratio[on] != 1.0)


@pytest.mark.parametrize("impl", ["numpy", "numba"])
def test_lamb_leaves_padding_alone(small_chunks, impl):
    lamb_padded(impl, SIZES, GAPS, DECAY, LARS)


# ----- overflow -----

@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_overflow_check_finds_one_nonfinite_value_anywhere(small_chunks, bad):
    grad = np.random.default_rng(7).standard_normal(3001).astype(np.float32)
    grad[17] = 3e38                                     # large but finite
    assert not update.has_overflow(grad, impl="numba")
    for where in (0, 1500, 3000):
        g = grad.copy()
        g[where] = bad
        assert update.has_overflow(g, impl="numba"), where
        assert update.has_overflow(g, impl="numpy"), where


def test_overflow_check_reads_the_whole_array_padding_included(small_chunks):
    _, seg, total = make_padded(SIZES, GAPS, DECAY, LARS)
    grad = np.zeros(total, np.float32)
    assert not update.has_overflow(grad, impl="numba")
    grad[np.flatnonzero(padding(seg, total))[[0, 500, -1]]] = [0.0, np.nan, 0.0]
    assert update.has_overflow(grad, impl="numba") and update.has_overflow(grad, impl="numpy")


def test_overflow_check_of_an_empty_array_is_clean():
    assert not update.has_overflow(np.zeros(0, np.float32), impl="numba")


@pytest.mark.parametrize("impl", ["numpy", "numba"])
def test_nonfinite_flag_writes_a_device_style_scalar_and_clears_it(impl):
    grad = np.ones(2001, np.float32)
    flag = update.nonfinite_flag(grad, impl=impl)
    assert flag.dtype == np.int32 and flag.shape == (1,) and flag[0] == 0
    grad[1999] = np.nan
    assert update.nonfinite_flag(grad, out=flag, impl=impl) is flag and flag[0] == 1
    grad[1999] = 1.0                                  # a stale 1 is cleared
    assert update.nonfinite_flag(grad, out=flag, impl=impl)[0] == 0


# ----- launching CUDA kernels on the compute stream -----

class FakeCupyArray:
    """Stands for a CuPy array: launch() recognises CuPy arrays by their type's module."""
    def __init__(self, name):
        self.name = name


FakeCupyArray.__module__ = "cupy._core.core"


def test_launch_runs_on_cupys_stream_without_a_sync_per_array(monkeypatch):
    """CuPy arrays reach the kernel wrapped with as_cuda_array(sync=False), the launch goes
    to the Numba wrapper of CuPy's current stream (made once per stream), scalars and
    NumPy arrays pass untouched, and kernels on host arrays launch as before."""
    import sys
    import types
    from numba import cuda
    stream = types.SimpleNamespace(ptr=0xABC)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(get_current_stream=lambda: stream)))
    wrapped, made = [], []
    monkeypatch.setattr(cuda, "as_cuda_array",
                        lambda a, sync=True: wrapped.append((a.name, sync)) or ("dev", a.name),
                        raising=False)
    monkeypatch.setattr(cuda, "external_stream", lambda ptr: made.append(ptr) or f"numba {ptr:#x}",
                        raising=False)
    monkeypatch.setattr(segments, "_numba_streams", {})
    launches = []

    class Kernel:
        def __getitem__(self, config):
            return lambda *args: launches.append((config, args))

    host = np.zeros(3)
    for _ in range(2):
        segments.launch(Kernel(), 4, 32, FakeCupyArray("a"), 1.5, host, FakeCupyArray("b"))
    assert wrapped == [("a", False), ("b", False)] * 2 and made == [0xABC]
    assert launches[0] == ((4, 32, "numba 0xabc"), (("dev", "a"), 1.5, host, ("dev", "b")))
    stream.ptr = 0                                    # CuPy's null stream: the legacy default
    segments.launch(Kernel(), 1, 32, FakeCupyArray("c"))
    assert launches[-1][0] == (1, 32, 0)
    segments.launch(Kernel(), 2, 64, host, 3)
    assert launches[-1] == ((2, 64), (host, 3))


# ----- casts -----

def half_inputs():
    """fp32 values for to_half: every fp16 value, every midpoint between two neighbours
    (ties) and the fp32 values either side of it, the overflow boundary, fp32 subnormals,
    infinities, NaNs with payloads, a million random bit patterns and normal values of
    every scale."""
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = np.unique(every[np.isfinite(every)].astype(np.float32))
    ties = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)   # exact
    top = np.float32(65520)                                      # the tie between 65504 and inf
    special = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 1e-40, 2.0 ** -25,
                        2.0 ** -26, 3 * 2.0 ** -26, 3.4e38, -3.4e38, 1e5], np.float32)
    nans = np.array([0x7fc00000, 0xffc00000, 0x7f800001, 0x7fa00000, 0xff812345, 0x7fffffff,
                     0x7f802000, 0xffbfffff], np.uint32).view(np.float32)
    rng = np.random.default_rng(8)
    bits = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    normal = (rng.standard_normal(1 << 16) * 10.0 ** rng.uniform(-9, 5, 1 << 16)).astype(np.float32)
    parts = [every.astype(np.float32), ties, np.nextafter(ties, np.float32(np.inf)),
             np.nextafter(ties, np.float32(-np.inf)), [top, -top], np.nextafter(top, 0 * top),
             special, nans, bits, normal]
    return np.concatenate([np.asarray(p, np.float32).ravel() for p in parts])


def quieted(x, quiet_bit):
    """x with every signalling NaN replaced by its quiet twin (the quiet bit set). IEEE 754
    conversions quiet a signalling NaN, and so do the hardware conversions the kernels use;
    NumPy's own fp16 conversions keep it signalling. That is the only difference allowed."""
    bits = x.view(np.uint32 if x.dtype == np.float32 else np.uint16)
    return np.where(np.isnan(x) & ((bits & quiet_bit) == 0), bits | quiet_bit, bits).view(x.dtype)


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "serial"])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1024.0, 2.0 ** -24, 3.0, 1 / 3])
@pytest.mark.parametrize("impl", ["numpy", "numba"])
def test_to_half_is_numpys_cast_bit_for_bit(impl, scale, parallel):
    x = half_inputs()
    with np.errstate(all="ignore"):
        expected = (x if scale == 1.0 else x * np.float32(scale)).astype(np.float16)
        got = cast.to_half(x, impl=impl, scale=scale, parallel=parallel)
        if impl == "numba":     # the NaN inputs that NumPy lets through signalling
            expected = quieted(x, 0x00400000).astype(np.float16) if scale == 1.0 else expected
    assert got.dtype == np.float16
    assert np.array_equal(got.view(np.uint16), expected.view(np.uint16))   # NaNs included


@pytest.mark.parametrize("impl", ["numpy", "numba"])
def test_to_half_rounds_the_scaled_value_to_fp32_first(impl):
    # 6147 * fp32(1/3) = 2049.00006...: rounded to fp32 that is 2049, a tie between the
    # fp16 neighbours 2048 and 2050, which goes to even (2048); a single rounding of the
    # product straight to fp16 would give 2050
    got = cast.to_half(np.array([6147.0], np.float32), impl=impl, scale=1 / 3)
    assert got[0] == 2048


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "serial"])
@pytest.mark.parametrize("impl", ["numpy", "numba"])
def test_to_float_is_numpys_cast_for_every_half(impl, parallel):
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    got = cast.to_float(every, impl=impl, parallel=parallel)
    expected = (quieted(every, 0x0200) if impl == "numba" else every).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))   # NaNs included
    assert np.sum(quieted(every, 0x0200).view(np.uint16) != every.view(np.uint16)) == 1022


SERIAL_CASTS_BESIDE_PARALLEL_ONES = """
import sys, threading
import numpy as np
from mpitrain.kernels import cast
parallel = sys.argv[1] == "parallel"
x = np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32)
h = cast.to_half(x)
cast.to_float(h)
stop = threading.Event()

def background():
    while not stop.is_set():
        assert np.array_equal(cast.to_half(x, parallel=parallel), h)
        cast.to_float(h, parallel=parallel)

t = threading.Thread(target=background)
t.start()
for _ in range(300):
    cast.to_half(x)
    cast.to_float(h)
stop.set()
t.join()
import numba
assert numba.threading_layer() == "workqueue"
"""


def test_serial_casts_run_beside_parallel_ones_in_another_thread():
    # Numba's workqueue threading layer aborts the process when two threads enter parallel
    # regions at once: parallel=False must not enter one (with parallel=True it aborts)
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue", NUMBA_NUM_THREADS="2")
    run = subprocess.run([sys.executable, "-c", SERIAL_CASTS_BESIDE_PARALLEL_ONES, "serial"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


CASTS_FROM_THE_CACHE = """
import numpy as np
from mpitrain.kernels import cast
src = np.linspace(-70000, 70000, 100003, dtype=np.float32)
for parallel in (True, False):
    dst = np.empty(src.size, np.float16)
    cast.to_half_numba(src, dst, np.float32(0.5), parallel=parallel)
    kernel = cast._to_half_cpu[parallel]
    kernel = kernel if hasattr(kernel, "stats") else kernel.__wrapped__   # team.by_size's
    print(kernel.py_func.__qualname__, len(kernel.stats.cache_hits),
          len(kernel.stats.cache_misses), dst.view(np.uint16).sum(dtype=np.int64))
"""


def test_the_serial_and_the_parallel_cast_each_keep_their_own_cache_entry(tmp_path):
    """A second process loads both compilations of one loop from Numba's cache, and they
    give the same bits: neither one's cache entry takes the other's place."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    runs = [subprocess.run([sys.executable, "-c", CASTS_FROM_THE_CACHE], env=env,
                           capture_output=True, text=True, timeout=300) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stdout + run.stderr
    (parallel, serial), (parallel_again, serial_again) = \
        [[line.split() for line in run.stdout.splitlines()] for run in runs]
    assert [parallel[:3], serial[:3]] == [["_to_half_loop", "0", "1"],
                                          ["_to_half_loop_serial", "0", "1"]]      # compiled
    assert [parallel_again[:3], serial_again[:3]] == [["_to_half_loop", "1", "0"],
                                                      ["_to_half_loop_serial", "1", "0"]]
    assert parallel[3] == serial[3] == parallel_again[3] == serial_again[3]


def test_casts_check_dtypes():
    with pytest.raises(TypeError):
        cast.to_half(np.zeros(3, np.float64))


# ----- CUDA kernels under the numba-cuda simulator -----

def sim_arena():
    seg = make_segments(SIM_SIZES, SIM_DECAY, SIM_LARS)
    return (seg, *make_arena(seg, seed=9))


def sim_norms():
    seg, master, grad, _ = sim_arena()
    got = update.segment_norms(master, grad, seg, impl="cuda")
    ref = update.segment_norms(master.astype(np.float64), grad.astype(np.float64), seg, "numpy")
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
    assert not update.has_overflow(grad, impl="cuda")
    flag = np.ones(1, np.int32)                         # a stale 1: cleared by the kernel
    assert update.nonfinite_flag(grad, out=flag, impl="cuda") is flag and flag[0] == 0
    for where, bad in [(0, np.inf), (25, np.nan), (49, -np.inf)]:
        g = grad.copy()
        g[where] = bad
        assert update.has_overflow(g, impl="cuda")
        assert update.nonfinite_flag(g, out=flag, impl="cuda")[0] == 1
    x = np.array([0.5, 65520, 2.0 ** -25, 3 * 2.0 ** -25, -1 - 2.0 ** -11, np.nan, -np.inf] +
                 list(grad[:40]), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        h = cast.to_half(x, impl="cuda")
        assert np.array_equal(h.view(np.uint16), x.astype(np.float16).view(np.uint16))
        for scale in (0.5, 1 / 3):
            hs = cast.to_half(x, impl="cuda", scale=scale)
            assert np.array_equal(hs.view(np.uint16),
                                  (x * np.float32(scale)).astype(np.float16).view(np.uint16))
    assert cast.to_half(np.array([6147.0], np.float32), impl="cuda", scale=1 / 3)[0] == 2048
    assert np.array_equal(cast.to_float(h, impl="cuda"), h.astype(np.float32), equal_nan=True)


def sim_padding():
    """The CUDA norms, SGD/LARS and LAMB kernels on a padded arena: padding neither read
    into a norm nor written."""
    norms_padded("cuda", SIM_SIZES, SIM_GAPS, SIM_DECAY, SIM_LARS, tail=3)
    sgd_padded("cuda", SIM_SIZES, SIM_GAPS, SIM_DECAY, SIM_LARS, True, np.float16, tail=3)
    sgd_padded("cuda", SIM_SIZES, SIM_GAPS, SIM_DECAY, SIM_LARS, False, "master", tail=3)
    lamb_padded("cuda", SIM_SIZES, SIM_GAPS, SIM_DECAY, SIM_LARS, tail=3)


def adding(other):
    """A sum_partials that adds the other half's partial sums, as a 2-rank all-reduce would."""
    def add(sums):
        sums += other
    return add


def halves_match_whole(impl):
    """LARS and LAMB on the two halves of an arena cut inside a parameter (each half's table
    clipped as mpitrain.shard clips a shard's), each given the other half's partial sums
    through sum_partials, take the whole arena's step: the whole parameters' norms."""
    from mpitrain.shard import clip_segments
    seg, master0, grad, momentum0 = sim_arena()
    cut = 100                                           # inside the 150-element parameter
    halves = [(0, cut, clip_segments(seg, 0, cut)), (cut, master0.size,
                                                     clip_segments(seg, cut, master0.size))]
    kw = dict(STEP, trust=True)
    w_ref, v_ref = master0.copy(), momentum0.copy()
    rates = update.sgd_update(w_ref, w_ref, grad, v_ref, seg, impl="numpy", **kw)
    partial = [update.segment_sums(master0[lo:hi], grad[lo:hi], t, "numpy") for lo, hi, t in halves]
    w, v = master0.copy(), momentum0.copy()
    for (lo, hi, t), other in zip(halves, partial[::-1]):
        got = update.sgd_update(w[lo:hi], w[lo:hi], grad[lo:hi], v[lo:hi], t, impl=impl,
                                sum_partials=adding(other), **kw)
        np.testing.assert_allclose(got, rates, rtol=1e-12)
    np.testing.assert_allclose(w, w_ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(v, v_ref, rtol=1e-5, atol=1e-7)

    hp = dict(lr=0.01, step=1, weight_decay=1e-2, inv_scale=1 / 8)
    w_ref, (m_ref, s_ref) = master0.copy(), lamb.lamb_state(master0)
    ratios = lamb.lamb_update(w_ref, w_ref, grad, m_ref, s_ref, seg, impl="numpy", **hp)
    partial = []
    for lo, hi, t in halves:                            # each half's own sums, on copies
        w_half, (m, s) = master0[lo:hi].copy(), lamb.lamb_state(master0[lo:hi])
        lamb.lamb_update(w_half, w_half, grad[lo:hi], m, s, t, impl="numpy",
                         sum_partials=lambda sums: partial.append(sums.copy()), **hp)
    w, (m, s) = master0.copy(), lamb.lamb_state(master0)
    for (lo, hi, t), other in zip(halves, partial[::-1]):
        got = lamb.lamb_update(w[lo:hi], w[lo:hi], grad[lo:hi], m[lo:hi], s[lo:hi], t,
                               impl=impl, sum_partials=adding(other), **hp)
        np.testing.assert_allclose(got, ratios, rtol=1e-10)
    np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m, m_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("impl", ["numpy", "numba"])
def test_sum_partials_gives_halves_the_norms_of_whole_parameters(impl):
    halves_match_whole(impl)


def sim_halves():
    halves_match_whole("cuda")


@pytest.mark.parametrize("check", ["sim_norms", "sim_update", "sim_lamb", "sim_overflow_and_casts",
                                   "sim_padding", "sim_halves"])
def test_cuda_kernels_under_the_simulator(check):
    from launcher import under_cuda_simulator
    under_cuda_simulator("test_update_kernels", check, timeout=300)
