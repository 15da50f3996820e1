"""The Neumann and NLCG kernels (kernels/neumann.py, kernels/nlcg.py) against their formulas
written out here in float64, one element at a time over the whole weight vector.

Numba CPU kernels run on fp32 arenas with an fp16 working copy, the NumPy references on
float64 copies; arenas with padding between the parameters hold sentinels there that no
kernel may read into a sum or overwrite. The CUDA kernels run under the numba-cuda
simulator in a subprocess on an arena of about two hundred elements (as in
test_update_kernels.py). Each run takes several steps through every phase.
"""

import numpy as np
import pytest

from mpitrain.kernels import neumann, nlcg
from test_update_kernels import (DECAY, GAPS, LARS, PAD, PAD_GRAD, PAD_WORKING, SIM_DECAY,
                                 SIM_GAPS, SIM_LARS, SIM_SIZES, SIZES, make_arena, make_padded,
                                 make_segments, padded_working, padding, spread)
from test_update_kernels import small_chunks  # noqa: F401 (a fixture, used by name)

INV_SCALE = 1 / 8


def decay_mask(seg):
    return np.repeat(seg["decay"], seg["size"]).astype(bool)


def gradients(n, steps, seed=6):
    """Loss-scaled (x8) fp32 gradients whose size shrinks step by step, so that the
    conjugacy ratios of NLCG lie inside (0, 1)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(n)
    return [((base * 0.7 ** t + 0.3 * rng.standard_normal(n)) * 8).astype(np.float32)
            for t in range(steps)]


# ----- the Neumann optimizer -----

# (phase, mu) per step: burn-in, a reset, Neumann steps with mu ramping, another reset
PHASES = [("sgd", 0.0), ("sgd", 0.0), ("reset", 0.5), ("neumann", 2 / 3), ("neumann", 0.75),
          ("reset", 0.8), ("neumann", 5 / 6)]
NEUMANN_HP = dict(lr=0.05, alpha=0.05, beta=1e-2, gamma=0.9, weight_decay=1e-2,
                  inv_scale=INV_SCALE)


def neumann_by_hand(w, m, v, grads, seg, lr, alpha, beta, gamma, weight_decay, inv_scale):
    """Algorithm 2 of Krishnan et al. in float64 over the whole (packed) weight vector:
    returns (w, m, v, [c per step])."""
    w, m, v = (a.astype(np.float64) for a in (w, m, v))
    wd = np.where(decay_mask(seg), weight_decay, 0.0)
    coefficients = []
    for (phase, mu), grad in zip(PHASES, grads):
        g = grad.astype(np.float64) * inv_scale + wd * w
        c = 0.0
        if phase == "sgd":
            w = w - lr * g
        elif phase == "reset":
            m = -lr * g
        else:
            u = w - v
            norm = np.sqrt(np.sum(u * u))
            # Eq. 8: (alpha |u|^2 - beta n / |u|^2) u / |u|
            c = alpha * norm - beta * u.size / norm ** 3
            d = g + c * u
            m = mu * m - lr * d
            w = w + mu * m - lr * d
            v = w + gamma * (v - w)
        coefficients.append(c)
    return w, m, v, coefficients


def neumann_start(seg, seed=0):
    """fp32 weights, iterate (zero) and moving average (the weights, as v_0 = w_0)."""
    master, _, _ = make_arena(seg, seed)
    return master, np.zeros_like(master), master.copy()


def run_neumann(impl, w, work, grads, m, v, seg, padded=False):
    """The kernel through PHASES (the packed gradients spread over the padded arena when
    padded); returns the coefficients c it reported."""
    out = []
    for (phase, mu), g in zip(PHASES, grads):
        g = spread(g, seg, w.size, PAD_GRAD) if padded else g
        c = neumann.neumann_update(w, work, g, m, v, seg, phase=phase, mu=mu, impl=impl,
                                   **NEUMANN_HP)
        out.append(float(c[0]))
    return out


def test_neumann_numba_and_numpy_match_the_formulas_over_seven_steps(small_chunks):
    seg = make_segments(SIZES, DECAY, LARS)
    w0, m0, v0 = neumann_start(seg)
    grads = gradients(w0.size, len(PHASES))
    w_ref, m_ref, v_ref, c_ref = neumann_by_hand(w0, m0, v0, grads, seg, **NEUMANN_HP)
    assert all(c != 0 for (phase, _), c in zip(PHASES, c_ref) if phase == "neumann")
    w64, m64, v64 = (a.astype(np.float64) for a in (w0, m0, v0))
    c64 = run_neumann("numpy", w64, w64, [g.astype(np.float64) for g in grads], m64, v64, seg)
    np.testing.assert_allclose(c64, c_ref, rtol=1e-10)
    np.testing.assert_allclose(w64, w_ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(m64, m_ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(v64, v_ref, rtol=1e-12, atol=1e-14)
    w, m, v = w0.copy(), m0.copy(), v0.copy()
    half = np.zeros(w.size, np.float16)
    c32 = run_neumann("numba", w, half, grads, m, v, seg)
    np.testing.assert_allclose(c32, c_ref, rtol=1e-4)
    np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m, m_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(v, v_ref, rtol=1e-5, atol=1e-6)
    assert np.array_equal(half, w.astype(np.float16))        # working = cast(new master)
    assert np.abs(w - w0).max() > 1e-2                        # it moved


def test_neumann_refuses_an_unknown_phase():
    seg = make_segments((3,), (1,), (1,))
    w = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="unknown Neumann phase 'warmup'"):
        neumann.neumann_update(w, w, w, w, w, seg, 0.1, "warmup")


def neumann_padded(impl, sizes, gaps, decay, lars, tail=3):
    """The phases of `impl` on a padded fp32 arena with an fp16 working copy, against
    neumann_by_hand on the packed parameters; the padding keeps its sentinels."""
    packed, seg, total = make_padded(sizes, gaps, decay, lars, tail)
    w0, m0, v0 = neumann_start(packed, seed=2)
    grads = gradients(w0.size, len(PHASES), seed=3)
    w_ref, m_ref, v_ref, c_ref = neumann_by_hand(w0, m0, v0, grads, packed, **NEUMANN_HP)
    w, m, v = (spread(a, seg, total, PAD) for a in (w0, m0, v0))
    half = padded_working(np.float16, w, total)
    c = run_neumann(impl, w, half, grads, m, v, seg, padded=True)
    pad = padding(seg, total)
    assert np.all(w[pad] == PAD) and np.all(m[pad] == PAD) and np.all(v[pad] == PAD)
    assert np.all(half[pad] == PAD_WORKING)
    np.testing.assert_allclose(c, c_ref, rtol=1e-4)
    np.testing.assert_allclose(w[~pad], w_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m[~pad], m_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(v[~pad], v_ref, rtol=1e-5, atol=1e-6)
    assert np.array_equal(half[~pad], w[~pad].astype(np.float16))


@pytest.mark.parametrize("impl", ["numpy", "numba"])
def test_neumann_leaves_padding_alone(small_chunks, impl):
    neumann_padded(impl, SIZES, GAPS, DECAY, LARS)


# ----- NLCG -----

NLCG_HP = dict(lr=0.01, beta2=0.999, eps=1e-8, weight_decay=1e-2, inv_scale=INV_SCALE)
NLCG_STEPS = 5


def nlcg_by_hand(w, grads, seg, rule, lr, beta2, eps, weight_decay, inv_scale):
    """Preconditioned nonlinear CG with Adam's diagonal preconditioner in float64 over the
    whole (packed) weight vector: returns (w, d, h, [beta per step])."""
    w = w.astype(np.float64)
    d, h, p = np.zeros_like(w), np.zeros_like(w), np.zeros_like(w)
    wd = np.where(decay_mask(seg), weight_decay, 0.0)
    rho, betas = 0.0, []
    for t, grad in enumerate(grads, start=1):
        g = grad.astype(np.float64) * inv_scale + wd * w
        h = beta2 * h + (1 - beta2) * g * g
        s = -g / (np.sqrt(h / (1 - beta2 ** t)) + eps)          # s = P r, r = -g
        r = -g
        rho_new = r @ s
        numerator = rho_new if rule == "fr" else rho_new - r @ (-p)
        beta = 0.0 if t == 1 else min(max(numerator / rho, 0.0), 1.0)
        d = s + beta * d
        w = w + lr * d
        rho, p = rho_new, -s
        betas.append(beta)
    return w, d, h, betas


def run_nlcg(impl, w, work, grads, d, h, p, seg, rule, total=None):
    """The kernel for len(grads) steps (the packed gradients spread over a padded arena of
    `total` elements when given); returns the betas it reported."""
    rho = np.zeros(1)
    betas = []
    for t, g in enumerate(grads, start=1):
        g = g if total is None else spread(g, seg, total, PAD_GRAD)
        beta = nlcg.nlcg_update(w, work, g, d, h, p, rho, seg, step=t, beta_rule=rule,
                                impl=impl, **NLCG_HP)
        betas.append(float(beta[0]))
    return betas


@pytest.mark.parametrize("rule", ["fr", "pr"])
def test_nlcg_numba_and_numpy_match_the_formulas_over_five_steps(small_chunks, rule):
    seg = make_segments(SIZES, DECAY, LARS)
    w0, _, _ = make_arena(seg)
    grads = gradients(w0.size, NLCG_STEPS)
    w_ref, d_ref, h_ref, b_ref = nlcg_by_hand(w0, grads, seg, rule, **NLCG_HP)
    assert b_ref[0] == 0 and any(0 < b < 1 for b in b_ref)     # restart, then conjugacy
    w64 = w0.astype(np.float64)
    d64, h64, p64 = (np.zeros_like(w64) for _ in range(3))
    b64 = run_nlcg("numpy", w64, w64, [g.astype(np.float64) for g in grads], d64, h64, p64, seg,
                   rule)
    np.testing.assert_allclose(b64, b_ref, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(w64, w_ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(d64, d_ref, rtol=1e-10, atol=1e-14)
    w, half = w0.copy(), np.zeros(w0.size, np.float16)
    d, h, p = (np.zeros_like(w) for _ in range(3))
    b32 = run_nlcg("numba", w, half, grads, d, h, p, seg, rule)
    np.testing.assert_allclose(b32, b_ref, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(d, d_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6)
    assert np.array_equal(half, w.astype(np.float16))
    assert np.abs(w - w0).max() > 1e-2


def test_the_two_beta_rules_differ():
    seg = make_segments(SIZES, DECAY, LARS)
    w0, _, _ = make_arena(seg)
    grads = gradients(w0.size, NLCG_STEPS)
    fr = nlcg_by_hand(w0, grads, seg, "fr", **NLCG_HP)[3]
    pr = nlcg_by_hand(w0, grads, seg, "pr", **NLCG_HP)[3]
    assert max(abs(a - b) for a, b in zip(fr, pr)) > 1e-2


def test_nlcg_refuses_step_0_and_unknown_rules():
    seg = make_segments((3,), (1,), (1,))
    w = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="NLCG steps count from 1"):
        nlcg.nlcg_update(w, w, w, w, w, w, np.zeros(1), seg, 0.1, 0)
    with pytest.raises(ValueError, match="unknown NLCG beta rule 'hs'"):
        nlcg.nlcg_update(w, w, w, w, w, w, np.zeros(1), seg, 0.1, 1, beta_rule="hs")


def nlcg_padded(impl, sizes, gaps, decay, lars, tail=3):
    """Five steps of `impl` on a padded fp32 arena with an fp16 working copy, against
    nlcg_by_hand on the packed parameters; the padding keeps its sentinels."""
    packed, seg, total = make_padded(sizes, gaps, decay, lars, tail)
    w0, _, _ = make_arena(packed, seed=4)
    grads = gradients(w0.size, NLCG_STEPS, seed=5)
    w_ref, d_ref, h_ref, b_ref = nlcg_by_hand(w0, grads, packed, "pr", **NLCG_HP)
    w = spread(w0, seg, total, PAD)
    d, h, p = (spread(np.zeros_like(w0), seg, total, PAD) for _ in range(3))
    half = padded_working(np.float16, w, total)
    betas = run_nlcg(impl, w, half, grads, d, h, p, seg, "pr", total)
    pad = padding(seg, total)
    for buf in (w, d, h, p):
        assert np.all(buf[pad] == PAD)
    assert np.all(half[pad] == PAD_WORKING)
    np.testing.assert_allclose(betas, b_ref, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(h[~pad], h_ref, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(w[~pad], w_ref, rtol=1e-5, atol=1e-6)
    assert np.array_equal(half[~pad], w[~pad].astype(np.float16))


@pytest.mark.parametrize("impl", ["numpy", "numba"])
def test_nlcg_leaves_padding_alone(small_chunks, impl):
    nlcg_padded(impl, SIZES, GAPS, DECAY, LARS)


# ----- CUDA kernels under the numba-cuda simulator -----

def sim_neumann():
    neumann_padded("cuda", SIM_SIZES, SIM_GAPS, SIM_DECAY, SIM_LARS)


def sim_nlcg():
    nlcg_padded("cuda", SIM_SIZES, SIM_GAPS, SIM_DECAY, SIM_LARS)


@pytest.mark.parametrize("check", ["sim_neumann", "sim_nlcg"])
def test_cuda_kernels_under_the_simulator(check):
    from launcher import under_cuda_simulator
    under_cuda_simulator("test_neumann_nlcg_kernels", check, timeout=300)
