"""The gradient's way through an SGD / LARS step, in the order a step takes it.

1. Norms. Per-parameter L2 norms of the master weights and of the gradient
   (LARS's inputs), one value per row s of the segment table:

       w_norm[s] = sqrt( sum_{i in segment s} master_i^2 )
       g_norm[s] = sqrt( sum_{i in segment s} grad_i^2 )

   accumulated in float64 from one pass that reads each element of master and
   grad once. The gradient norm is of the buffer as given: under loss scaling
   the caller multiplies it by inv_scale (norms are positively homogeneous).
   Sums are taken per piece and then added per segment in piece order
   (kernels/segments.py), so the CPU and CUDA results do not depend on the
   number of threads. A non-finite gradient gives a non-finite g_norm for its
   segment.

   The sums of squares come first (`segment_sums`), the square roots last, so
   that a table covering only part of each parameter (one rank's shard of a
   sharded update, mpitrain.shard) can have its partial sums added over the
   ranks in between: the update kernels take a `sum_partials` function for
   that, called on the (2, segments) float64 array [sum w^2; sum g^2] before
   the square roots (LAMB: [sum w^2; sum r^2]), on every rank alike.

2. The non-finite check of loss scaling: does the gradient arena hold an inf
   or a NaN?

       overflow = any_i( not isfinite(grad_i) )

   One pass over the whole flat array (padding included: it is zero). On the
   CPU every chunk is reduced to one flag in parallel; on the GPU any thread
   that meets a non-finite value writes 1 to a one-element flag (all writers
   write the same value, so the race is harmless). `nonfinite_flag` leaves that
   flag where it is (on the device, for the caller to all-reduce or read once);
   `has_overflow` reads it back as a bool. With LARS the norm pass
   already tells the same thing for free: a segment's g_norm is non-finite
   exactly when it holds a non-finite value (squares of fp32 values cannot
   overflow a float64 sum of fewer than 10^200 terms).

3. The fused SGD / LARS update, one pass over the arena. For every element i
   of segment s (decay_s, lars_s from the segment table):

       g      = grad_i * inv_scale                  unscale and average
                                                    (inv_scale = 1 / (loss scale * ranks))
       g     += wd_s * w_i                          wd_s = weight_decay where decay_s, else 0
       v_i    = m * v_i + lr * local_lr_s * g
       w_i   -= v_i                                 (Nesterov: w_i -= m * v_i + lr * local_lr_s * g)
       working_i = cast(w_i)                        fp16 (or nothing when working is master)

   with the LARS trust ratio (You et al., 2017) where trust is on and lars_s:

       local_lr_s = eta * ||w||_s / (||g||_s + wd_s * ||w||_s + eps)
       ||g||_s    = ||grad||_s * inv_scale          the norm of the unscaled gradient
       local_lr_s = 1 when ||w||_s or ||g||_s is 0, and wherever trust is off or not lars_s.

   Norms (1.) are per parameter, on the master weights before the update;
   with `sum_partials` the table's sums of squares are partial ones, added over
   the ranks by that function before the square roots (see 1.), so every rank
   applies the trust ratio of the whole parameter to its part of it.
   With trust off this is SGD with momentum in the "lr inside the momentum"
   form, v = m v + lr g; w -= v. PyTorch's form is v' = m v' + g; w -= lr v'.
   The two agree exactly while lr is constant (v = lr v'); when lr changes,
   the lr-inside form keeps the velocity of the old rate: the LARS paper's form.
   Goyal et al. write it too, with a "momentum correction" (v scaled by the new
   rate over the old when the rate changes, which makes it PyTorch's) that this
   kernel leaves out.

   Each implementation first computes two small per-segment vectors, step_s =
   lr * local_lr_s and wd_s, in the master's dtype; then the element pass reads
   master, grad and momentum once and writes master, momentum and working
   once. All arithmetic is in the master's dtype (fp32; float64 in
   verification runs). The fp16 working copy is cast from the fp32-rounded
   master. sgd_update returns the per-segment local_lr (float64), for logging.

Padding. Parameters start on aligned offsets, so the arena has gaps between
segments. Norms and updates walk only the pieces inside segments: no padding
element is read into a norm, and none of master, momentum or working is
written there. Only the non-finite check reads the whole array.

One body, two targets. Each formula is written once, as a plain Python
function on scalars (per segment: on the small per-segment arrays and an
index), marked `register_jitable`. A Numba CPU loop (`njit`) or CUDA kernel
(`cuda.jit`) that calls it compiles it for its own target, as
`njit(cache=True)(f)` and `cuda.jit(device=True)(f)` would, and the bodies can
call one another (the coefficients call trust_ratio; LAMB's call direction),
where a body compiled by hand for each target would have to name a callee
compiled for that target; the NumPy references and the CUDA simulator run
them as Python. The CPU loops (whole chunks per thread,
LANES partial sums in the reductions) still vectorise: LLVM inlines the
bodies. The CUDA kernels run one block per piece, or one thread per segment. The
non-finite check is the exception: one short loop per target (a vectorised
sum of x * 0 on the CPU, `isfinite` per element on CUDA), as its test is a
single comparison.
"""
import math

import numpy as np
from numba import cuda, float64, njit, prange
from numba.extending import register_jitable

from mpitrain.backend import array_module, to_numpy

from . import segments as _segments
from .cast import float_to_half_bits, refresh_working
from .segments import (CUDA_MAX_THREADS, LANES, as_dtype, cuda_shape, device_layout, launch, layout,
                       pick)


# ===== 1. Norms =====

def segment_norms(master, grad, segments, impl=None):
    """(w_norm, g_norm): float64 arrays of one value per segment, in the arrays' module.

    w_norm[s] = sqrt(sum_{i in s} master_i^2), g_norm[s] = sqrt(sum_{i in s} grad_i^2).
    impl: "numpy" | "numba" | "cuda", or None to choose by array type
    (kernels.segments.pick)."""
    w_norm, g_norm = array_module(master).sqrt(segment_sums(master, grad, segments, impl))
    return w_norm, g_norm


def segment_sums(master, grad, segments, impl=None):
    """sums[0, s] = sum_{i in s} master_i^2, sums[1, s] = sum_{i in s} grad_i^2: a new
    (2, segments) float64 array in the arrays' module (the norms before their square
    roots)."""
    impl = pick(impl, master)
    sums = array_module(master).zeros((2, len(segments)))
    _SUMS[impl](master, grad, segments, sums)
    return sums


def segment_sums_numpy(master, grad, segments, sums):
    """Reference: sums[0, s] = sum w_i^2, sums[1, s] = sum g_i^2 over segment s, each element
    converted to float64 before squaring."""
    xp = array_module(master)
    for s, (offset, size) in enumerate(zip(segments["offset"], segments["size"])):
        w = master[offset:offset + size].astype(np.float64)
        g = grad[offset:offset + size].astype(np.float64)
        sums[0, s] = xp.dot(w, w)
        sums[1, s] = xp.dot(g, g)


@register_jitable
def square(x):
    """x^2 in float64: x is converted before it is squared."""
    a = np.float64(x)
    return a * a


@register_jitable
def segment_sum(part_x, part_y, seg_first, s):
    """(sum of part_x over the pieces of segment s, the same of part_y): the pieces'
    float64 sums added in piece order."""
    sx = 0.0
    sy = 0.0
    for p in range(seg_first[s], seg_first[s + 1]):
        sx += part_x[p]
        sy += part_y[p]
    return sx, sy


# ----- Numba CPU -----

@njit(cache=True)
def sum_squares(x, y):
    """(sum x_i^2, sum y_i^2) in float64 over two slices of equal length.

    Without fastmath, LLVM may not reorder a floating-point sum, so a single
    accumulator runs at one add per cycle-latency. LANES independent partial
    sums (lane k takes elements k, k + LANES, ...) are an order we chose, so the
    loop vectorises; the lanes are then added in order, then the tail."""
    lane_x = np.zeros(LANES)
    lane_y = np.zeros(LANES)
    blocks = x.size // LANES
    for b in range(blocks):
        xs = x[b * LANES:(b + 1) * LANES]
        ys = y[b * LANES:(b + 1) * LANES]
        for k in range(LANES):
            lane_x[k] += square(xs[k])
            lane_y[k] += square(ys[k])
    sx = lane_x.sum()
    sy = lane_y.sum()
    for i in range(blocks * LANES, x.size):
        sx += square(x[i])
        sy += square(y[i])
    return sx, sy


@njit(cache=True)
def pieces_to_segments(part_x, part_y, seg_first, out_x, out_y):
    """out[s] = segment_sum(...) for every segment s, one after another."""
    for s in range(out_x.size):
        out_x[s], out_y[s] = segment_sum(part_x, part_y, seg_first, s)


@njit(parallel=True, cache=True)
def _piece_sums_cpu(master, grad, piece_start, piece_stop, chunk_first, part_w, part_g):
    """part_w[p], part_g[p] = sum of master_i^2, grad_i^2 (float64) over piece p; threads
    take whole chunks."""
    for c in prange(chunk_first.size - 1):
        for p in range(chunk_first[c], chunk_first[c + 1]):
            a = piece_start[p]
            b = piece_stop[p]
            part_w[p], part_g[p] = sum_squares(master[a:b], grad[a:b])


def segment_sums_numba(master, grad, segments, sums):
    """Numba CPU version of segment_sums_numpy (threads take whole chunks)."""
    lay = layout(segments)
    part_w = np.empty(lay.piece_start.size)
    part_g = np.empty(lay.piece_start.size)
    _piece_sums_cpu(master, grad, lay.piece_start, lay.piece_stop, lay.chunk_first, part_w, part_g)
    pieces_to_segments(part_w, part_g, lay.seg_first, sums[0], sums[1])


# ----- Numba CUDA -----

@cuda.jit(device=True)
def store_block_sums(part_x, part_y, p, x, y):
    """part_x[p], part_y[p] = the sums of x and y over the threads of the block (a tree
    in shared memory). blockDim.x must be a power of two <= CUDA_MAX_THREADS.

    Called from kernels of other modules too (lamb.py). The numba-cuda simulator swaps
    its fake `cuda` into this module for each call, thread by thread, and the first
    thread to return swaps the real one back: so nothing here reads `cuda` after the
    last barrier, and no other device function of this module is called from here."""
    buf_x = cuda.shared.array(CUDA_MAX_THREADS, float64)
    buf_y = cuda.shared.array(CUDA_MAX_THREADS, float64)
    t = cuda.threadIdx.x
    buf_x[t] = x
    buf_y[t] = y
    cuda.syncthreads()
    half = cuda.blockDim.x // 2
    while half > 0:
        if t < half:
            buf_x[t] += buf_x[t + half]
            buf_y[t] += buf_y[t + half]
        cuda.syncthreads()
        half //= 2
    if t == 0:
        part_x[p] = buf_x[0]
        part_y[p] = buf_y[0]


@cuda.jit
def _piece_sums_cuda(master, grad, piece_start, piece_stop, part_w, part_g):
    """part_w[p], part_g[p] = sum of master_i^2, grad_i^2 (float64) over piece p; one block
    per piece."""
    p = cuda.blockIdx.x        # one block per piece
    sw = 0.0
    sg = 0.0
    for i in range(piece_start[p] + cuda.threadIdx.x, piece_stop[p], cuda.blockDim.x):
        sw += square(master[i])
        sg += square(grad[i])
    store_block_sums(part_w, part_g, p, sw, sg)


@cuda.jit
def pieces_to_segments_cuda(part_x, part_y, seg_first, out_x, out_y):
    """One thread per segment: out[s] = segment_sum(...)."""
    s = cuda.grid(1)
    if s < out_x.size:
        out_x[s], out_y[s] = segment_sum(part_x, part_y, seg_first, s)


def segment_sums_cuda(master, grad, segments, sums):
    """Numba CUDA version of segment_sums_numpy: one block per piece reduces in shared
    memory, then one thread per segment adds its pieces."""
    threads, chunk = cuda_shape()
    xp = array_module(master)
    lay = device_layout(segments, chunk, xp)
    pieces = lay.piece_start.size
    part_w = xp.zeros(pieces)
    part_g = xp.zeros(pieces)
    if pieces:
        launch(_piece_sums_cuda, pieces, threads, master, grad, lay.piece_start,
               lay.piece_stop, part_w, part_g)
        launch(pieces_to_segments_cuda, (lay.num_segments + threads - 1) // threads, threads,
               part_w, part_g, lay.seg_first, sums[0], sums[1])


_SUMS = {"numpy": segment_sums_numpy, "numba": segment_sums_numba, "cuda": segment_sums_cuda}


# ===== 2. The non-finite check =====

def has_overflow(grad, impl=None):
    """True when the flat float array grad holds an inf or a NaN (anywhere: padding too).

    On a GPU the answer crosses to the host (a synchronisation of the current stream);
    `nonfinite_flag` gives the same answer as a device scalar instead."""
    return bool(nonfinite_flag(grad, impl=impl)[0])


def nonfinite_flag(grad, out=None, impl=None):
    """out[0] = 1 when the flat float array grad holds an inf or a NaN (padding too), else 0.

    out: a one-element int32 array in grad's module (made when None), returned. On a
    GPU it stays on the device, written by kernels queued on the current stream, so
    that the caller can all-reduce it, or copy it to the host once, when it needs it."""
    if out is None:
        out = array_module(grad).zeros(1, np.int32)
    _NONFINITE[pick(impl, grad)](grad, out)
    return out


def nonfinite_flag_numpy(grad, out):
    """Reference: out[0] = not all(isfinite(grad)) (on CuPy arrays: device operations only)."""
    xp = array_module(grad)
    out[...] = xp.logical_not(xp.isfinite(grad).all())


@njit(cache=True)
def _nonfinite(x):
    """x * 0 is 0 for every finite x and NaN for inf and NaN, so a sum of x * 0 is NaN
    exactly when x holds a non-finite value. LANES partial sums keep it vectorised."""
    zero = x.dtype.type(0)
    lanes = np.zeros(LANES, x.dtype)
    blocks = x.size // LANES
    for b in range(blocks):
        xs = x[b * LANES:(b + 1) * LANES]
        for k in range(LANES):
            lanes[k] += xs[k] * zero
    total = lanes.sum()
    for i in range(blocks * LANES, x.size):
        total += x[i] * zero
    return not np.isfinite(total)


@njit(parallel=True, cache=True)
def _overflow_cpu(grad, chunk):
    """any(not isfinite(grad_i)): one flag per chunk, the chunks in parallel."""
    chunks = (grad.size + chunk - 1) // chunk
    flags = np.zeros(chunks, np.bool_)
    for c in prange(chunks):
        flags[c] = _nonfinite(grad[c * chunk:(c + 1) * chunk])
    return flags.any()


def nonfinite_flag_numba(grad, out):
    """Numba CPU version of nonfinite_flag_numpy: one flag per chunk, in parallel."""
    out[0] = _overflow_cpu(grad, _segments.CPU_CHUNK)


@cuda.jit
def _overflow_cuda(grad, flag):
    """flag[0] = 1 where some grad_i is not finite (grid-stride loop)."""
    for i in range(cuda.grid(1), grad.size, cuda.gridsize(1)):
        if not math.isfinite(grad[i]):
            flag[0] = 1


def nonfinite_flag_cuda(grad, out):
    """Numba CUDA version of nonfinite_flag_numpy: the flag is cleared, then a grid-stride
    loop writes 1 into it wherever it meets a non-finite value; nothing is read back."""
    threads, _ = cuda_shape()
    out[...] = 0
    if grad.size:
        launch(_overflow_cuda, min((grad.size + threads - 1) // threads, 4096), threads,
               grad, out)


_NONFINITE = {"numpy": nonfinite_flag_numpy, "numba": nonfinite_flag_numba,
              "cuda": nonfinite_flag_cuda}


# ===== 3. The fused SGD / LARS update =====

@register_jitable
def trust_ratio(w_norm, g_norm, wd, eta, eps):
    """LARS local learning rate: eta ||w|| / (||g|| + wd ||w|| + eps); 1 when a norm is 0."""
    if w_norm > 0.0 and g_norm > 0.0:
        return eta * w_norm / (g_norm + wd * w_norm + eps)
    return 1.0


@register_jitable
def sgd_coefficients(s, w_norm, g_norm, decay, lars, lr, weight_decay, inv_scale, trust, eta,
                     eps, step, wd, local_lr):
    """Segment s: local_lr[s] = trust_ratio(w_norm, g_norm * inv_scale, wd_s) where trust
    and lars[s], else 1; step[s] = lr * local_lr[s]; wd[s] = weight_decay where decay[s]."""
    d = weight_decay if decay[s] else 0.0
    r = 1.0
    if trust and lars[s]:
        r = trust_ratio(w_norm[s], g_norm[s] * inv_scale, d, eta, eps)
    local_lr[s] = r
    step[s] = lr * r
    wd[s] = d


@register_jitable
def sgd_element(w, g, v, step, wd, inv_scale, m, nesterov):
    """One element of the fused pass, in the dtype of its inputs: returns (w', v') for
    d = g * inv_scale + wd * w; v' = m v + step d; w' = w - v' (Nesterov: w - (m v' + step d))."""
    d = g * inv_scale + wd * w
    v = m * v + step * d
    return w - (m * v + step * d if nesterov else v), v


def sgd_update(master, working, grad, velocity, segments, lr, momentum=0.9, weight_decay=0.0,
               inv_scale=1.0, nesterov=False, trust=False, eta=0.001, eps=1e-9, impl=None,
               sum_partials=None):
    """Apply one SGD (trust=False) or LARS (trust=True) step in place; see the module docstring.

    master, grad, velocity: flat arrays of one float dtype (velocity is arena.momentum);
    working: the layers' copy, fp16 or master itself; segments: the arena's segment table
    (gaps between segments are padding, left untouched).
    impl: "numpy" | "numba" | "cuda", or None to choose by array type.
    sum_partials: None, or a function that adds the (2, segments) float64 sums of squares
    over the ranks in place, when the table holds only part of each parameter (a shard).
    Returns local_lr, one float64 per segment, in the arrays' module."""
    if nesterov and momentum <= 0:
        raise ValueError("Nesterov momentum needs momentum > 0")
    return _SGD[pick(impl, master)](master, working, grad, velocity, segments, lr, momentum,
                                    weight_decay, inv_scale, nesterov, trust, eta, eps,
                                    sum_partials)


def whole_norms(sums, sum_partials):
    """(w_norm, g_norm) from the (2, segments) sums of squares, added over the ranks first
    by sum_partials when it is given."""
    if sum_partials is not None:
        sum_partials(sums)
    w_norm, g_norm = array_module(sums).sqrt(sums)
    return w_norm, g_norm


def sgd_update_numpy(master, working, grad, velocity, segments, lr, momentum, weight_decay,
                     inv_scale, nesterov, trust, eta, eps, sum_partials):
    """Reference, one parameter at a time (formula in the module docstring)."""
    xp = array_module(master)
    n = len(segments)
    local_lr = np.ones(n)
    if trust:
        sums = segment_sums(master, grad, segments, "numpy")
        w_norm, g_norm = (to_numpy(a) for a in whole_norms(sums, sum_partials))
    for s, (offset, size, decay, lars) in enumerate(segments[["offset", "size", "decay", "lars"]]):
        wd = weight_decay if decay else 0.0
        if trust and lars:
            local_lr[s] = trust_ratio(w_norm[s], g_norm[s] * inv_scale, wd, eta, eps)
        step = float(lr * local_lr[s])      # a Python float keeps the arithmetic in w's dtype
        w = master[offset:offset + size]
        v = velocity[offset:offset + size]
        g = grad[offset:offset + size] * inv_scale
        if decay:
            g += wd * w
        v *= momentum
        v += step * g
        if nesterov:
            w -= momentum * v + step * g
        else:
            w -= v
    refresh_working(master, working, segments)
    return xp.asarray(local_lr)


def _per_segment(master, grad, segments, trust, xp, sums, sum_partials):
    """What the fused versions need before the coefficients, in the module xp: whether
    any segment takes the trust ratio, the norms (`sums`, an implementation of
    segment_sums, then whole_norms; zeros when no segment takes it), and empty step, wd
    (master's dtype) and local_lr (float64), one value per segment. Whether the norms are
    taken depends on the table's flags only, so every rank of a sharded update calls
    sum_partials alike."""
    n = len(segments)
    trust = trust and bool(layout(segments).lars.any())
    partial = xp.zeros((2, n))
    if trust:
        sums(master, grad, segments, partial)
    w_norm, g_norm = whole_norms(partial, sum_partials if trust else None)
    return trust, w_norm, g_norm, xp.empty(n, master.dtype), xp.empty(n, master.dtype), xp.empty(n)


# ----- Numba CPU -----

@njit(cache=True)
def coefficients(w_norm, g_norm, decay, lars, lr, weight_decay, inv_scale, trust, eta, eps,
                 step, wd, local_lr):
    """sgd_coefficients for every segment, one after another."""
    for s in range(step.size):
        sgd_coefficients(s, w_norm, g_norm, decay, lars, lr, weight_decay, inv_scale, trust,
                         eta, eps, step, wd, local_lr)


@njit(cache=True)
def store_half(half, i, w):
    """half[i] = the fp16 bits of fp32(w), when there is an fp16 copy (half not empty)."""
    if half.size:
        half[i] = float_to_half_bits(np.float32(w))


@njit(cache=True)
def _sgd_piece(w, half, g, v, step, wd, inv_scale, m, nesterov):
    """The element pass on one piece (slices); half is empty when there is no fp16 copy."""
    for i in range(w.size):
        wi, vi = sgd_element(w[i], g[i], v[i], step, wd, inv_scale, m, nesterov)
        v[i] = vi
        w[i] = wi
        store_half(half, i, wi)


@njit(parallel=True, cache=True)
def _sgd_cpu(master, half, grad, velocity, piece_seg, piece_start, piece_stop, chunk_first,
             step, wd, inv_scale, m, nesterov):
    """(master_i, velocity_i) = sgd_element(...) with the constants of the piece's segment, and
    half_i = fp16(master_i) when there is an fp16 copy; threads take whole chunks."""
    for c in prange(chunk_first.size - 1):
        for p in range(chunk_first[c], chunk_first[c + 1]):
            s = piece_seg[p]
            a = piece_start[p]
            b = piece_stop[p]
            _sgd_piece(master[a:b], half[a:b], grad[a:b], velocity[a:b], step[s], wd[s],
                       inv_scale, m, nesterov)


def sgd_update_numba(master, working, grad, velocity, segments, lr, momentum, weight_decay,
                     inv_scale, nesterov, trust, eta, eps, sum_partials):
    """Numba CPU version of sgd_update_numpy: norms pass (if trust), then the fused pass;
    threads take whole chunks of the arena."""
    lay = layout(segments)
    trust, w_norm, g_norm, step, wd, local_lr = _per_segment(master, grad, segments, trust, np,
                                                             segment_sums_numba, sum_partials)
    coefficients(w_norm, g_norm, lay.decay, lay.lars, lr, weight_decay, inv_scale, trust, eta,
                 eps, step, wd, local_lr)
    fused_half = working is not master and working.dtype == np.float16
    half = working.view(np.uint16) if fused_half else np.empty(0, np.uint16)
    _sgd_cpu(master, half, grad, velocity, lay.piece_seg, lay.piece_start, lay.piece_stop,
             lay.chunk_first, step, wd, *as_dtype(master, inv_scale, momentum), nesterov)
    if not fused_half:
        refresh_working(master, working, segments)
    return local_lr


# ----- Numba CUDA -----

@cuda.jit
def coefficients_cuda(w_norm, g_norm, decay, lars, lr, weight_decay, inv_scale, trust, eta, eps,
                      step, wd, local_lr):
    """One thread per segment: sgd_coefficients."""
    s = cuda.grid(1)
    if s < step.size:
        sgd_coefficients(s, w_norm, g_norm, decay, lars, lr, weight_decay, inv_scale, trust,
                         eta, eps, step, wd, local_lr)


@cuda.jit(device=True)
def store_working(working, i, w, write_working, via_fp32):
    """working[i] = cast(w) when write_working; an fp16 copy of a float64 master goes
    through fp32, as on the CPU."""
    if write_working:
        if via_fp32:
            working[i] = np.float32(w)
        else:
            working[i] = w


def working_args(master, working):
    """(working, write_working, via_fp32): the last three arguments of the CUDA update
    kernels. When working is master they get an empty array in its place, as they write
    master anyway: one host array passed as two arguments would be copied to the device
    twice and back twice (Numba's automatic transfers, and the simulator's), the second
    copy back undoing the first."""
    if working is master:
        return master[:0], False, False
    return working, True, working.dtype == np.float16


@cuda.jit
def _sgd_cuda(master, grad, velocity, piece_seg, piece_start, piece_stop, step, wd, inv_scale,
              m, nesterov, working, write_working, via_fp32):
    """(master_i, velocity_i) = sgd_element(...), working_i = cast(master_i); one block per
    piece."""
    p = cuda.blockIdx.x        # one block per piece: its segment's constants for every thread
    s = piece_seg[p]
    st = step[s]
    d = wd[s]
    for i in range(piece_start[p] + cuda.threadIdx.x, piece_stop[p], cuda.blockDim.x):
        w, velocity[i] = sgd_element(master[i], grad[i], velocity[i], st, d, inv_scale, m,
                                     nesterov)
        master[i] = w
        store_working(working, i, w, write_working, via_fp32)


def sgd_update_cuda(master, working, grad, velocity, segments, lr, momentum, weight_decay,
                    inv_scale, nesterov, trust, eta, eps, sum_partials):
    """Numba CUDA version of sgd_update_numpy: norms kernels (if trust), one thread per
    segment for the coefficients, then one block per piece for the fused pass."""
    threads, chunk = cuda_shape()
    xp = array_module(master)
    lay = device_layout(segments, chunk, xp)
    trust, w_norm, g_norm, step, wd, local_lr = _per_segment(master, grad, segments, trust, xp,
                                                             segment_sums_cuda, sum_partials)
    if lay.num_segments:
        launch(coefficients_cuda, (lay.num_segments + threads - 1) // threads, threads,
               w_norm, g_norm, lay.decay, lay.lars, lr, weight_decay, inv_scale, trust, eta,
               eps, step, wd, local_lr)
    if lay.piece_start.size:
        launch(_sgd_cuda, lay.piece_start.size, threads,
               master, grad, velocity, lay.piece_seg, lay.piece_start, lay.piece_stop,
               step, wd, *as_dtype(master, inv_scale, momentum), nesterov,
               *working_args(master, working))
    return local_lr


_SGD = {"numpy": sgd_update_numpy, "numba": sgd_update_numba, "cuda": sgd_update_cuda}
