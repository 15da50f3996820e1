"""Elementwise layers without parameters: ReLU and dropout."""
import numpy as np

from mpitrain.backend import array_module
from mpitrain.kernels import elementwise
from mpitrain.kernels import gpu

from .module import Module


class ReLU(Module):
    """y = max(x, 0);  dx = dy * [y > 0] (mpitrain.kernels.elementwise)."""

    def forward(self, x, train=True):
        y = elementwise.relu(x)
        self.y = y if train else None    # (N, H, W, C), or (N, F) after a flatten
        return y

    def backward(self, dy):
        dx = elementwise.relu_grad(dy, self.y)
        self.y = None
        return dx


class Dropout(Module):
    """Inverted dropout (Srivastava et al. 2014).

    Train mode: y = x * m / (1 - p), m_i ~ Bernoulli(1 - p) drawn afresh each call,
    so the expected value of y is x and eval mode is the identity.
    Backward: dx = dy * m / (1 - p) (the same mask); identity after an eval forward.

    Every mask comes from the layer's own NumPy generator `rng`, so a run is
    reproducible. `seed` is an integer or a sequence of them: the networks seed
    each dropout layer from (model seed, rank, layer), so that every rank of a
    data-parallel run draws its own masks.

    On the CPU the mask is rng's uniforms >= p. On a GPU (CuPy input) each train
    forward takes one 64-bit key from rng (draw_key) into `key`, a (2,) uint32
    device array of its low and high words, and the device draws the mask from it,
    element i keeping where Philox4x32-10 of (i // 4, key) passes p's threshold
    (mpitrain.kernels.gpu.dropout; no host-to-device copy of a mask). Backward
    draws the same mask again from the same key, so no mask is kept. The key
    lives on the device because a CUDA graph (mpitrain.graph.StepGraph) replays
    kernels with the pointers they were captured with: the graph sets
    `key_drawn_ahead`, so that forward leaves `key` as it is, and calls draw_key
    itself before each replay, one key per step as the eager forward draws it.
    Either way the layer's whole random state is rng's, which checkpoints save and
    restore (mpitrain.checkpoint.rng_states): a resumed run draws the same masks
    as the uninterrupted one. The CPU and GPU masks of one seed differ.
    """

    def __init__(self, p=0.5, seed=0):
        if not 0 <= p < 1:
            raise ValueError(f"Dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.mask = None            # the CPU's mask of the last train forward
        self.key = None             # the GPU's key buffer, made at the first draw
        self.keyed = False          # whether the last forward's mask came from `key`
        self.key_drawn_ahead = False    # set by a CUDA graph, which draws the keys itself
        self.seed(seed)

    def seed(self, s):
        """Restart the mask sequence from seed s (an integer or a sequence of integers)."""
        self.rng = np.random.default_rng(s)

    def draw_key(self, xp):
        """Take rng's next 64-bit key into `key` (made on array module xp at the first
        draw) by a copy from the host: a CUDA graph calls this before each replay, never
        inside its capture, which would keep the captured key."""
        key = int(self.rng.integers(1 << 64, dtype=np.uint64))
        if self.key is None:
            self.key = xp.empty(2, np.uint32)
        # through xp.asarray: CuPy's key[...] = (a NumPy array) would call fill, for scalars
        self.key[...] = xp.asarray(gpu.key_words(key))

    def forward(self, x, train=True):
        self.mask, self.keyed = None, False
        if not train or self.p == 0:
            return x
        if gpu.handles(x):
            if not self.key_drawn_ahead:
                self.draw_key(array_module(x))
            self.keyed = True
            return gpu.dropout(x, self.key, self.p)
        xp = array_module(x)
        keep = self.rng.random(x.shape, dtype=np.float32) >= self.p
        # x.shape, 0 or 1/(1-p)
        self.mask = xp.asarray(keep.astype(x.dtype) * x.dtype.type(1 / (1 - self.p)))
        return x * self.mask

    def backward(self, dy):
        if self.keyed:
            return gpu.dropout(dy, self.key, self.p)
        mask, self.mask = self.mask, None
        return dy if mask is None else dy * mask
