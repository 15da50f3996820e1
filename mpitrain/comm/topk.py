"""Top-k gradient sparsification with error feedback (Shi et al. 2020; RedSync, Fang et al. 2019).

Instead of summing a fusion bucket's n gradients over the ranks, each rank sends only
its k = ceil(density * n) entries of largest magnitude, and keeps everything else
for later: what it held back (the residual) is added to its next gradient, so no
gradient is lost, only delayed (error feedback). Per bucket, on every rank:

    acc       = grad + residual                 (the residual of this rank, this bucket)
    picks     = the k largest |acc|, ties by index (mpitrain.kernels.topk.select)
    residual' = acc with the picks zeroed
    exchange  = all-gather of every rank's k (index, value) pairs: k int32 indices,
                k float32 values, the same k on every rank (Communicator.all_gather)
    bucket    = 0, then each rank's pairs added in rank order (kernels.topk.scatter_sum)

so every rank ends with the same bits, as after a dense all-reduce, and the Reducer's
`postscale` still averages. A rank sends 8 k bytes per bucket instead of the 4 n of a
dense sum (which moves 2 (p-1)/p of that per rank in a ring), and receives 8 k (p-1).

Loss scaling. The gradient arrives multiplied by the loss scale; the residual is kept
unscaled (acc = grad + scale * residual, residual' = (acc without the picks) / scale),
so a change of scale between steps needs nothing. The new residuals go to a second
buffer and replace the old ones only when the step is applied (`settle`): a step
skipped on overflow leaves the residual as it was. The non-finite check still sees
every overflow: a non-finite value has the largest key, so one is always picked and
reaches the summed bucket on every rank.

`active` False (the dense warm-up epochs) sums the buckets densely; the residual then
stays as it was (zero, from the start of a run).
"""
import math
import threading

import numpy as np

from mpitrain.kernels import topk


class TopK:
    """The residuals and the exchange of one Reducer's buckets (`bounds`, arena element
    ranges) at `density` in (0, 1]."""

    def __init__(self, arena, bounds, density):
        if not 0 < density <= 1:
            raise ValueError(f"the top-k density must be in (0, 1], got {density}")
        if arena.grad.dtype != np.float32:
            raise ValueError(f"top-k sparsification needs float32 gradients, got "
                             f"{arena.grad.dtype}")
        self.density = float(density)
        self.bounds = bounds
        self.k = [min(b - a, max(1, math.ceil(density * (b - a)))) for a, b in bounds]
        self.residual = arena.zeros()   # arena layout, unscaled; the padding stays zero
        self._next = arena.zeros()      # this step's, until settle() keeps it
        self.active = True
        self.exchanged = False          # this step went through exchange()

    def carry_over(self, previous):
        """Go on from `previous`, another bucket layout's TopK of the same arena (the fusion
        tuner changing the bucket size): the residuals are in arena layout, not bucket
        layout, so they carry over as they are."""
        self.residual, self._next, self.active = previous.residual, previous._next, previous.active

    def bytes_per_step(self):
        """Bytes one rank sends per step: k indices and k values per bucket."""
        return sum(k * (4 + self.residual.itemsize) for k in self.k)

    def exchange(self, comm, b, buf, scale=1.0, wait=None):
        """Replace bucket b's gradients `buf` (this rank's, times `scale`) by the sum over
        the ranks of every rank's picks; the new residual waits for settle(). Collective
        over the Communicator `comm`. Returns the bytes this rank sent."""
        start, stop = self.bounds[b]
        k, p, mine = self.k[b], comm.size, slice(comm.rank * self.k[b], (comm.rank + 1) * self.k[b])
        # Numba's parallel regions are entered from one thread only
        parallel = threading.current_thread() is threading.main_thread()
        every_value = comm.scratch(buf.dtype, k * p, like=buf, purpose="topk values")
        every_index = comm.scratch(np.int32, k * p, like=buf, purpose="topk indices")
        topk.select(buf, self.residual[start:stop], self._next[start:stop], k, every_value[mine],
                    every_index[mine], scale, parallel=parallel)
        ranks = [r * k for r in range(p + 1)]       # rank r's picks: [r k, (r + 1) k)
        comm.all_gather(every_value, ranks, wait)
        comm.all_gather(every_index, ranks, wait)
        topk.scatter_sum(buf, every_index.reshape(p, k), every_value.reshape(p, k),
                         parallel=parallel)
        self.exchanged = True
        return k * (every_value.itemsize + every_index.itemsize)

    def settle(self, applied):
        """The step's verdict: applied, the new residuals replace the old; skipped (an
        overflow), the old ones stay."""
        if self.exchanged and applied:
            self.residual, self._next = self._next, self.residual
        self.exchanged = False
