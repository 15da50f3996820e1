"""Stochastic preconditioned nonlinear conjugate gradients (Adya, Palakkode and Tuzel, 2018,
"Nonlinear Conjugate Gradients For Scaling Synchronous Distributed DNN Training",
arXiv:1812.02886), over the arena.

Preconditioned nonlinear CG (Shewchuk 1994, "An Introduction to the Conjugate Gradient
Method Without the Agonizing Pain", B5; Nocedal and Wright, 5.2) with a diagonal
preconditioner P_t, the mini-batch gradient g_t in place of the exact one and the learning
rate in place of the line search. At step t = 1, 2, ... (r = -g the residual):

    s_t    = P_t r_t                                   preconditioned residual
    rho_t  = r_t . s_t
    beta_t = rho_t / rho_{t-1}                         Fletcher-Reeves
           = (rho_t - r_t . s_{t-1}) / rho_{t-1}        Polak-Ribiere
    beta_t = min(max(beta_t, 0), 1);  beta_1 = 0        restart (PR+) and cap
    d_t    = s_t + beta_t d_{t-1}
    w_t    = w_{t-1} + lr d_t

The inner products run over the whole weight vector (one beta per step, not per layer),
as in the authors' published code (Apple's ncg package), whose defaults this follows for
the beta: Fletcher-Reeves (beta_rule "fr"), kept in [0, 1]. The preconditioner is a
per-weight diagonal as in Adam (Kingma and Ba), P_t = 1 / (sqrt(h_t / (1 - beta2^t)) + eps),
h_t = beta2 h_{t-1} + (1 - beta2) g_t^2; the published code's other choices, a diagonal
BFGS preconditioner and a loss-driven adjustment of the step size, are not implemented:
the learning rate's schedule sets the step.

Per element i of segment s (wd_s = weight_decay where decay_s, else 0; the L2 penalty is
part of the loss, so it enters g), with p = P g = -s stored from step to step:

    g    = grad_i * inv_scale + wd_s * w_i
    h_i  = beta2 h_i + (1 - beta2) g^2
    q    = g / (sqrt(h_i / (1 - beta2^t)) + eps)
    sums: a += g q   (rho_t),   b += g p_i   (r_t . s_{t-1})
    p_i  = q
    ... beta_t from the sums ...
    d_i  = beta_t d_i - p_i
    w_i += lr d_i;  working_i = cast(w_i)

Two passes: 1. h, p and the sums (per piece in float64, then per segment in piece order;
the (2, segments) array [a; b] goes through `sum_partials` when one is given, so that a
shard's beta is the whole arena's); 2. d, w and working. beta is computed from the sums in
the arrays' module and handed to pass 2 as a one-element array (no host synchronisation
on a GPU); rho_t stays there too, a one-element float64 array the caller keeps between
steps. Each formula is one `register_jitable` body compiled for the CPU loops and the CUDA
kernels, as in kernels/update.py and lamb.py. Padding keeps whatever it holds.
"""
import math

import numpy as np
from numba import cuda, njit, prange
from numba.extending import register_jitable

from mpitrain.backend import array_module

from .cast import refresh_working
from .segments import LANES, as_dtype, cuda_shape, device_layout, launch, layout, pick
from .update import (pieces_to_segments, pieces_to_segments_cuda, store_block_sums, store_half,
                     store_working, working_args)

BETA_RULES = ("fr", "pr")


@register_jitable
def nlcg_precondition(w, g, h, inv_scale, wd, b2, c2, bc2, eps):
    """Pass 1 on one element, in the dtype of its inputs (c2 = 1 - b2, bc2 = 1 - b2^t):
    returns (g', h', q) for g' = g * inv_scale + wd w, h' = b2 h + c2 g'^2,
    q = g' / (sqrt(h' / bc2) + eps)."""
    g = g * inv_scale + wd * w
    h = b2 * h + c2 * g * g
    return g, h, g / (math.sqrt(h / bc2) + eps)


@register_jitable
def nlcg_direction(w, d, p, lr, beta):
    """Pass 2 on one element: (w', d') for d' = beta d - p, w' = w + lr d'."""
    d = beta * d - p
    return w + lr * d, d


def conjugacy(sums, rho, step, rule, xp):
    """(beta_t, rho_t), one-element float64 arrays in xp, from the summed [a; b] per segment
    and rho_{t-1} (formulas in the module docstring)."""
    a = sums[0].sum(keepdims=True)
    numerator = a if rule == "fr" else a - sums[1].sum(keepdims=True)
    usable = rho > 0 if step > 1 else xp.zeros(1, bool)
    beta = xp.where(usable, numerator / xp.where(usable, rho, 1.0), 0.0)
    return xp.clip(beta, 0.0, 1.0), a


def nlcg_update(master, working, grad, direction, exp_avg_sq, precond_grad, rho, segments, lr,
                step, beta2=0.999, eps=1e-8, weight_decay=0.0, inv_scale=1.0, beta_rule="fr",
                impl=None, sum_partials=None):
    """Apply NLCG step number `step` (1 for the first) in place; see the module docstring.

    direction, exp_avg_sq, precond_grad: d, h and p, flat arrays like master (zeros at the
    start); rho: one-element float64 array holding rho_{t-1}, replaced by rho_t.
    sum_partials: None, or a function that adds the (2, segments) float64 sums over the
    ranks in place, when the table holds only part of each parameter (a shard).
    Returns beta_t as a one-element float64 array in the arrays' module."""
    if step < 1:
        raise ValueError(f"NLCG steps count from 1, got {step}")
    if beta_rule not in BETA_RULES:
        raise ValueError(f"unknown NLCG beta rule {beta_rule!r}; choose one of "
                         f"{', '.join(BETA_RULES)}")
    return _IMPLS[pick(impl, master)](master, working, grad, direction, exp_avg_sq, precond_grad,
                                      rho, segments, lr, step, beta2, eps, weight_decay,
                                      inv_scale, beta_rule, sum_partials)


def _beta(sums, rho, step, rule, sum_partials, xp):
    """beta_t after adding the sums over the ranks; rho[...] = rho_t."""
    if sum_partials is not None:
        sum_partials(sums)
    beta, rho[...] = conjugacy(sums, rho, step, rule, xp)
    return beta


def nlcg_update_numpy(master, working, grad, direction, exp_avg_sq, precond_grad, rho, segments,
                      lr, step, beta2, eps, weight_decay, inv_scale, beta_rule, sum_partials):
    """Reference, one parameter at a time (formulas in the module docstring)."""
    xp = array_module(master)
    table = list(enumerate(segments[["offset", "size", "decay"]]))
    bc2 = 1.0 - beta2 ** step
    sums = xp.zeros((2, len(segments)))
    for s, (offset, size, decay) in table:
        sl = slice(offset, offset + size)
        w, h, p = master[sl], exp_avg_sq[sl], precond_grad[sl]
        g = grad[sl] * inv_scale
        if decay:
            g += weight_decay * w
        h *= beta2
        h += (1.0 - beta2) * g * g
        q = g / (xp.sqrt(h / bc2) + eps)
        g64 = g.astype(np.float64)
        sums[:, s] = xp.stack([xp.dot(g64, q.astype(np.float64)),
                               xp.dot(g64, p.astype(np.float64))])
        p[...] = q
    beta = _beta(sums, rho, step, beta_rule, sum_partials, xp)
    b = float(beta[0])
    for s, (offset, size, _) in table:
        sl = slice(offset, offset + size)
        d = direction[sl]
        d *= b
        d -= precond_grad[sl]
        master[sl] += lr * d
    refresh_working(master, working, segments)
    return beta


# ----- Numba CPU -----

@njit(cache=True)
def _precondition_piece(w, g, h, p, inv_scale, wd, b2, c2, bc2, eps):
    """Pass 1 on one piece: update h and p; return (sum g q, sum g p_old) in float64, with
    LANES partial sums as in update.sum_squares."""
    lane_a = np.zeros(LANES)
    lane_b = np.zeros(LANES)
    blocks = w.size // LANES
    for blk in range(blocks + 1):
        lo = blk * LANES
        for k in range(min(LANES, w.size - lo)):
            i = lo + k
            gi, hi, q = nlcg_precondition(w[i], g[i], h[i], inv_scale, wd, b2, c2, bc2, eps)
            lane_a[k] += np.float64(gi) * np.float64(q)
            lane_b[k] += np.float64(gi) * np.float64(p[i])
            h[i] = hi
            p[i] = q
    return lane_a.sum(), lane_b.sum()


@njit(parallel=True, cache=True)
def _precondition_cpu(master, grad, h, p, piece_seg, piece_start, piece_stop, chunk_first, wd,
                      inv_scale, b2, c2, bc2, eps, part_a, part_b):
    """Pass 1 on every piece; threads take whole chunks."""
    for c in prange(chunk_first.size - 1):
        for q in range(chunk_first[c], chunk_first[c + 1]):
            a = piece_start[q]
            b = piece_stop[q]
            part_a[q], part_b[q] = _precondition_piece(master[a:b], grad[a:b], h[a:b], p[a:b],
                                                       inv_scale, wd[piece_seg[q]], b2, c2, bc2,
                                                       eps)


@njit(cache=True)
def _direction_piece(w, half, d, p, lr, beta):
    """Pass 2 on one piece (slices); half is empty when there is no fp16 copy."""
    for i in range(w.size):
        wi, di = nlcg_direction(w[i], d[i], p[i], lr, beta)
        d[i] = di
        w[i] = wi
        store_half(half, i, wi)


@njit(parallel=True, cache=True)
def _direction_cpu(master, half, d, p, piece_start, piece_stop, chunk_first, lr, beta):
    """Pass 2 on every piece; threads take whole chunks."""
    b = beta[0]
    for c in prange(chunk_first.size - 1):
        for q in range(chunk_first[c], chunk_first[c + 1]):
            lo = piece_start[q]
            hi = piece_stop[q]
            _direction_piece(master[lo:hi], half[lo:hi], d[lo:hi], p[lo:hi], lr, b)


def _scalars(master, step, beta2, eps, inv_scale):
    """The per-step scalars in the master's dtype: inv_scale, b2, 1 - b2, 1 - b2^t, eps."""
    return as_dtype(master, inv_scale, beta2, 1.0 - beta2, 1.0 - beta2 ** step, eps)


def nlcg_update_numba(master, working, grad, direction, exp_avg_sq, precond_grad, rho, segments,
                      lr, step, beta2, eps, weight_decay, inv_scale, beta_rule, sum_partials):
    """Numba CPU version of nlcg_update_numpy: the two passes, threads take whole chunks."""
    lay = layout(segments)
    wd = np.where(lay.decay, weight_decay, 0.0).astype(master.dtype)
    part_a = np.empty(lay.piece_start.size)
    part_b = np.empty(lay.piece_start.size)
    _precondition_cpu(master, grad, exp_avg_sq, precond_grad, lay.piece_seg, lay.piece_start,
                      lay.piece_stop, lay.chunk_first, wd,
                      *_scalars(master, step, beta2, eps, inv_scale), part_a, part_b)
    sums = np.zeros((2, lay.num_segments))
    pieces_to_segments(part_a, part_b, lay.seg_first, sums[0], sums[1])
    beta = _beta(sums, rho, step, beta_rule, sum_partials, np)
    fused_half = working is not master and working.dtype == np.float16
    half = working.view(np.uint16) if fused_half else np.empty(0, np.uint16)
    _direction_cpu(master, half, direction, precond_grad, lay.piece_start, lay.piece_stop,
                   lay.chunk_first, *as_dtype(master, lr), beta.astype(master.dtype))
    if not fused_half:
        refresh_working(master, working, segments)
    return beta


# ----- Numba CUDA -----

@cuda.jit
def _precondition_cuda(master, grad, h, p, piece_seg, piece_start, piece_stop, wd, inv_scale,
                       b2, c2, bc2, eps, part_a, part_b):
    """Pass 1: h_i, p_i updated; part_a[p], part_b[p] = sum g q, sum g p_old over the piece;
    one block per piece."""
    k = cuda.blockIdx.x        # one block per piece
    d = wd[piece_seg[k]]
    sa = 0.0
    sb = 0.0
    for i in range(piece_start[k] + cuda.threadIdx.x, piece_stop[k], cuda.blockDim.x):
        g, h[i], q = nlcg_precondition(master[i], grad[i], h[i], inv_scale, d, b2, c2, bc2, eps)
        sa += np.float64(g) * np.float64(q)
        sb += np.float64(g) * np.float64(p[i])
        p[i] = q
    store_block_sums(part_a, part_b, k, sa, sb)


@cuda.jit
def _direction_cuda(master, d, p, piece_start, piece_stop, lr, beta, working, write_working,
                    via_fp32):
    """Pass 2: (w_i, d_i) = nlcg_direction(...), working_i = cast(w_i); one block per piece."""
    k = cuda.blockIdx.x        # one block per piece
    b = beta[0]
    for i in range(piece_start[k] + cuda.threadIdx.x, piece_stop[k], cuda.blockDim.x):
        w, d[i] = nlcg_direction(master[i], d[i], p[i], lr, b)
        master[i] = w
        store_working(working, i, w, write_working, via_fp32)


def nlcg_update_cuda(master, working, grad, direction, exp_avg_sq, precond_grad, rho, segments,
                     lr, step, beta2, eps, weight_decay, inv_scale, beta_rule, sum_partials):
    """Numba CUDA version of nlcg_update_numpy: pass 1 one block per piece, the per-segment
    sums one thread per segment, pass 2 one block per piece."""
    threads, chunk = cuda_shape()
    xp = array_module(master)
    lay = device_layout(segments, chunk, xp)
    pieces, nseg = lay.piece_start.size, lay.num_segments
    wd = xp.where(lay.decay, weight_decay, 0.0).astype(master.dtype)
    sums = xp.zeros((2, nseg))
    if pieces:
        part_a, part_b = xp.zeros(pieces), xp.zeros(pieces)
        launch(_precondition_cuda, pieces, threads, master, grad, exp_avg_sq, precond_grad,
               lay.piece_seg, lay.piece_start, lay.piece_stop, wd,
               *_scalars(master, step, beta2, eps, inv_scale), part_a, part_b)
        launch(pieces_to_segments_cuda, (nseg + threads - 1) // threads, threads, part_a, part_b,
               lay.seg_first, sums[0], sums[1])
    beta = _beta(sums, rho, step, beta_rule, sum_partials, xp)     # every rank, pieces or not
    if pieces:
        launch(_direction_cuda, pieces, threads, master, direction, precond_grad,
               lay.piece_start, lay.piece_stop, *as_dtype(master, lr), beta.astype(master.dtype),
               *working_args(master, working))
    return beta


_IMPLS = {"numpy": nlcg_update_numpy, "numba": nlcg_update_numba, "cuda": nlcg_update_cuda}
