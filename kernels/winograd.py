"""Winograd's minimal filtering F(2x2, 3x3) (Lavin & Gray 2016): the 3x3 convolutions
of stride 1 on the CPU.

Each 2x2 block of output pixels comes from the 4x4 input tile d under it (tiles step
by 2, so neighbours overlap by 2 pixels) and a 3x3 filter g as

    y = A^T [ (G g G^T) * (B^T d B) ] A            (* elementwise, 4x4)

    B^T = [1  0 -1  0]      G = [ 1     0     0  ]      A^T = [1  1  1  0]
          [0  1  1  0]          [1/2   1/2   1/2 ]            [0  1 -1 -1]
          [0 -1  1  0]          [1/2  -1/2   1/2 ]
          [0  1  0 -1]          [ 0     0     1  ]

Summed over the input channels, the 16 elementwise products are 16 GEMMs, one per
position k = 4 xi + nu of the 4x4 tile:

    V[k] (T, C) = (B^T d B)[xi, nu] of every tile      input_tiles
    U[:, k] (O, C) = (G g G^T)[xi, nu] of every filter filter_tiles: U (O, 16, C)
    M[k] (T, O) = V[k] @ U[:, k]^T                     (the caller's GEMMs)
    y           = A^T M A of every tile                output_tiles

16 C O multiply-adds per 2x2 output pixels instead of the direct form's 36 C O, for
transforms that read and write each tile once (im2col writes every pixel 9 times).

Backward runs the same linear maps transposed:

    dM          = A dy A^T of every tile               output_tiles_grad
    dU[:, k]    = dM[k]^T @ V[k],  dW = G^T dU G       filter_tiles_grad
    dV[k]       = dM[k] @ U[:, k], dx = B dV B^T       input_tiles_grad
                  summed over the tiles that overlap

The tiles read a zero-padded copy of x (`padded`), so no transform checks bounds,
and fp16 input is widened in that one pass: everything after it is fp32 (float64
for float64 input, `compute_dtype`) until output_tiles and input_tiles_grad round
to the activations' dtype. Each kernel is parallel over rows of tiles (or over
filters, or rows of pixels), vectorised over channels; every output element is
written by one thread in a fixed order, so the bits do not depend on the number of
threads. The transforms that write all 16 positions of a tile (input_tiles,
output_tiles_grad, and B in input_tiles_grad) take two passes through a small
scratch per thread, down the tile's columns and then along its rows: each loop over
the channels then reads and writes 4 positions, not 16 at once, which runs faster
(docs/benchmarks-record.md) for the same arithmetic in the same order.
"""
import numpy as np
from numba import njit, prange

from . import team
from .cast import bits, load, rounded, store


def tile_grid(H, W, padding):
    """(Ho, Wo, th, tw): the output size of a 3x3 stride-1 convolution and its tiles
    per column and row (the last ones run past an odd output size)."""
    Ho, Wo = H + 2 * padding - 2, W + 2 * padding - 2
    return Ho, Wo, -(-Ho // 2), -(-Wo // 2)


# ----- the 1-D transforms, on 4 (or 3, 2) numbers -----
@njit(inline="always", cache=True)
def _bt(d0, d1, d2, d3):
    """B^T d"""
    return d0 - d2, d1 + d2, d2 - d1, d1 - d3


@njit(inline="always", cache=True)
def _b(v0, v1, v2, v3):
    """B v"""
    return v0, v1 - v2 + v3, v2 - v0 + v1, -v3


@njit(inline="always", cache=True)
def _g(g0, g1, g2):
    """G g"""
    return g0, np.float32(0.5) * (g0 + g1 + g2), np.float32(0.5) * (g0 - g1 + g2), g2


@njit(inline="always", cache=True)
def _gt(u0, u1, u2, u3):
    """G^T u"""
    half = np.float32(0.5)
    return u0 + half * (u1 + u2), half * (u1 - u2), half * (u1 + u2) + u3


@njit(inline="always", cache=True)
def _at(m0, m1, m2, m3):
    """A^T m"""
    return m0 + m1 + m2, m1 - m2 - m3


@njit(inline="always", cache=True)
def _a(y0, y1):
    """A y"""
    return y0, y0 + y1, y0 - y1, -y1


@njit(inline="always", cache=True)
def _put_tiles(out, k, t, c, v):
    """out[k + m, t, c] = v[m], m < 4: four positions of tile t in a (16, T, C) array"""
    out[k, t, c] = v[0]
    out[k + 1, t, c] = v[1]
    out[k + 2, t, c] = v[2]
    out[k + 3, t, c] = v[3]


@njit(inline="always", cache=True)
def _put_column(e, j, c, v):
    """e[m, j, c] = v[m] for every m: a column's transform in a tile's scratch (m, j, C)"""
    for m in range(len(v)):
        e[m, j, c] = v[m]


@njit(inline="always", cache=True)
def _put_filter(out, o, k, c, v):
    """out[o, k + m, c] = v[m], m < 4: four positions of filter o in an (O, 16, C) array"""
    out[o, k, c] = v[0]
    out[o, k + 1, c] = v[1]
    out[o, k + 2, c] = v[2]
    out[o, k + 3, c] = v[3]


# The kernels index their arrays in full (a[n, h, w, c]) rather than through views of
# rows: Numba then vectorises the loop over channels.

@njit(inline="always", cache=True)
def _tile(r, tx, th, tw):
    """Tile tx of tile row r = n th + ty: (n, h, w, t), its first pixel (h, w) in the
    padded input and its index t = r tw + tx."""
    r = np.int64(r)                 # prange's index may be unsigned
    n, ty = divmod(r, th)
    return n, 2 * ty, 2 * tx, r * tw + tx


# ----- forward -----
@team.by_size
@njit(parallel=True, cache=True)
def _padded(x, padding, xpad):
    N, H, W, C = x.shape
    Hp, Wp = xpad.shape[1], xpad.shape[2]
    for r in prange(N * Hp):
        n, h = divmod(np.int64(r), Hp)
        inside = padding <= h < padding + H
        for w in range(Wp):
            if inside and padding <= w < padding + W:
                for c in range(C):
                    xpad[n, h, w, c] = load(x, (n, h - padding, w - padding, c))
            else:
                xpad[n, h, w, :] = 0.0


def compute_dtype(dtype):
    """The transforms' and GEMMs' dtype for activations of `dtype`: float64 for float64,
    else float32."""
    return np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)


def padded(x, padding, out):
    """out (N, 2 th + 2, 2 tw + 2, C) = x at offset (padding, padding), zeros around."""
    _padded(bits(x), padding, out)
    return out


@team.by_size
@njit(parallel=True, cache=True)
def _input_tiles(xpad, th, tw, V):
    N, C = xpad.shape[0], xpad.shape[3]
    for r in prange(N * th):
        e = np.empty((4, 4, C), V.dtype)                 # B^T d of one tile
        for tx in range(tw):
            n, h, w, t = _tile(r, tx, th, tw)
            for j in range(4):                           # B^T down each of its 4 columns
                for c in range(C):
                    _put_column(e, j, c, _bt(xpad[n, h, w + j, c], xpad[n, h + 1, w + j, c],
                                             xpad[n, h + 2, w + j, c], xpad[n, h + 3, w + j, c]))
            for i in range(4):                           # then B^T along each row
                for c in range(C):
                    _put_tiles(V, 4 * i, t, c, _bt(e[i, 0, c], e[i, 1, c], e[i, 2, c], e[i, 3, c]))


def input_tiles(xpad, th, tw, out):
    """out (16, T, C) = B^T d B of every 4x4 tile d of the padded input xpad, T = N th tw
    (tile t = (n th + ty) tw + tx starts at pixel (2 ty, 2 tx) of xpad)."""
    _input_tiles(xpad, th, tw, out)
    return out


@team.by_size
@njit(parallel=True, cache=True)
def _filter_tiles(w, U):
    O, C = w.shape[0], w.shape[3]
    for o in prange(O):
        for c in range(C):
            # G down each of the filter's 3 columns, then G along each row
            e0 = _g(load(w, (o, 0, 0, c)), load(w, (o, 1, 0, c)), load(w, (o, 2, 0, c)))
            e1 = _g(load(w, (o, 0, 1, c)), load(w, (o, 1, 1, c)), load(w, (o, 2, 1, c)))
            e2 = _g(load(w, (o, 0, 2, c)), load(w, (o, 1, 2, c)), load(w, (o, 2, 2, c)))
            _put_filter(U, o, 0, c, _g(e0[0], e1[0], e2[0]))
            _put_filter(U, o, 4, c, _g(e0[1], e1[1], e2[1]))
            _put_filter(U, o, 8, c, _g(e0[2], e1[2], e2[2]))
            _put_filter(U, o, 12, c, _g(e0[3], e1[3], e2[3]))


def filter_tiles(w, dtype):
    """U (O, 16, C) of `dtype` = G g G^T of every 3x3 filter g of w (O, 3, 3, C): the
    GEMMs' U[k] is U[:, k, :].T."""
    U = np.empty((w.shape[0], 16, w.shape[3]), dtype)
    _filter_tiles(bits(w), U)
    return U


@team.by_size
@njit(parallel=True, cache=True)
def _output_tiles(M, th, tw, y):
    N, Ho, Wo, O = y.shape
    for r in prange(N * th):
        for tx in range(tw):
            n, h, w, t = _tile(r, tx, th, tw)
            right, below = w + 1 < Wo, h + 1 < Ho
            for o in range(O):
                # A^T down each column of M's 4x4, then A^T along the two rows
                e0 = _at(M[0, t, o], M[4, t, o], M[8, t, o], M[12, t, o])
                e1 = _at(M[1, t, o], M[5, t, o], M[9, t, o], M[13, t, o])
                e2 = _at(M[2, t, o], M[6, t, o], M[10, t, o], M[14, t, o])
                e3 = _at(M[3, t, o], M[7, t, o], M[11, t, o], M[15, t, o])
                top, bottom = _at(e0[0], e1[0], e2[0], e3[0]), _at(e0[1], e1[1], e2[1], e3[1])
                store(y, (n, h, w, o), top[0])
                if right:
                    store(y, (n, h, w + 1, o), top[1])
                if below:
                    store(y, (n, h + 1, w, o), bottom[0])
                    if right:
                        store(y, (n, h + 1, w + 1, o), bottom[1])


def output_tiles(M, th, tw, out):
    """out (N, Ho, Wo, O) = A^T M A of every tile of M (16, T, O), rounded to out's dtype;
    the pixels past an odd Ho or Wo are dropped."""
    _output_tiles(M, th, tw, bits(out))
    return out


# ----- backward -----
@team.by_size
@njit(parallel=True, cache=True)
def _output_tiles_grad(dy, th, tw, dM):
    N, Ho, Wo, O = dy.shape
    zero = rounded(dM, 0.0)
    for r in prange(N * th):
        e = np.empty((4, 2, O), dM.dtype)                # A dy of one 2x2 block
        for tx in range(tw):
            n, h, w, t = _tile(r, tx, th, tw)
            below = h + 1 < Ho
            for j in range(2):                           # A down each of its 2 columns
                inside = w + j < Wo                      # zeros past an odd Wo
                for o in range(O):
                    y0 = load(dy, (n, h, w + j, o)) if inside else zero
                    y1 = load(dy, (n, h + 1, w + j, o)) if inside and below else zero
                    _put_column(e, j, o, _a(y0, y1))
            for i in range(4):                           # then A along each of 4 rows
                for o in range(O):
                    _put_tiles(dM, 4 * i, t, o, _a(e[i, 0, o], e[i, 1, o]))


def output_tiles_grad(dy, th, tw, out):
    """out (16, T, O) = A dy A^T of every 2x2 block of dy (N, Ho, Wo, O), zeros past an
    odd Ho or Wo."""
    _output_tiles_grad(bits(dy), th, tw, out)
    return out


@njit(inline="always", cache=True)
def _put3(out, o, i, c, g):
    """out[o, i, j, c] = g[j], j < 3, rounded to out's dtype"""
    store(out, (o, i, 0, c), g[0])
    store(out, (o, i, 1, c), g[1])
    store(out, (o, i, 2, c), g[2])


@team.by_size
@njit(parallel=True, cache=True)
def _filter_tiles_grad(dU, gw):
    O, C = gw.shape[0], gw.shape[3]
    for o in prange(O):
        for c in range(C):
            # G^T down each of dU's 4 columns, then G^T along the 3 rows
            e0 = _gt(dU[o, 0, c], dU[o, 4, c], dU[o, 8, c], dU[o, 12, c])
            e1 = _gt(dU[o, 1, c], dU[o, 5, c], dU[o, 9, c], dU[o, 13, c])
            e2 = _gt(dU[o, 2, c], dU[o, 6, c], dU[o, 10, c], dU[o, 14, c])
            e3 = _gt(dU[o, 3, c], dU[o, 7, c], dU[o, 11, c], dU[o, 15, c])
            _put3(gw, o, 0, c, _gt(e0[0], e1[0], e2[0], e3[0]))
            _put3(gw, o, 1, c, _gt(e0[1], e1[1], e2[1], e3[1]))
            _put3(gw, o, 2, c, _gt(e0[2], e1[2], e2[2], e3[2]))


def filter_tiles_grad(dU, out):
    """out (O, 3, 3, C) = G^T dU G of every filter's 4x4 gradient in dU (O, 16, C), rounded
    to out's dtype."""
    _filter_tiles_grad(dU, bits(out))
    return out


@team.by_size
@njit(parallel=True, cache=True)
def _untransform(dV, tw):
    C = dV.shape[2]
    for r in prange(dV.shape[1] // tw):
        e = np.empty((4, 4, C), dV.dtype)                # B dV of one tile
        for t in range(r * tw, (r + 1) * tw):
            for j in range(4):                           # B down each of its 4 columns
                for c in range(C):
                    _put_column(e, j, c, _b(dV[j, t, c], dV[4 + j, t, c], dV[8 + j, t, c],
                                            dV[12 + j, t, c]))
            for i in range(4):                           # then B along each row: its pixels
                for c in range(C):
                    _put_tiles(dV, 4 * i, t, c, _b(e[i, 0, c], e[i, 1, c], e[i, 2, c], e[i, 3, c]))


@team.by_size
@njit(parallel=True, cache=True)
def _gathered(D, th, tw, padding, dx):
    N, H, W, C = dx.shape
    for r in prange(N * H):
        n, h = divmod(np.int64(r), H)
        hp = h + padding                              # the row in the padded input
        acc = np.empty(C, D.dtype)
        for w in range(W):
            wp = w + padding
            acc[:] = 0.0
            # the (up to 2 x 2) tiles over pixel (hp, wp), in order
            for ty in range(max(0, (hp - 2) // 2), min(th - 1, hp // 2) + 1):
                for tx in range(max(0, (wp - 2) // 2), min(tw - 1, wp // 2) + 1):
                    t, k = (n * th + ty) * tw + tx, 4 * (hp - 2 * ty) + wp - 2 * tx
                    for c in range(C):
                        acc[c] += D[k, t, c]
            for c in range(C):
                store(dx, (n, h, w, c), acc[c])


def input_tiles_grad(dV, th, tw, padding, shape, dtype):
    """dx, a new (N, H, W, C) array of `dtype`: B dV B^T of every tile (in place over dV,
    16, T, C), each pixel of x then the sum of its (up to four) tiles' values there, in
    tile order, rounded once."""
    _untransform(dV, tw)
    dx = np.empty(shape, dtype)
    _gathered(dV, th, tw, padding, bits(dx))
    return dx
