"""Weight-update sharding (--shard-update): each rank updates 1/N of the arena and holds
the optimizer state of that part only (Kumar et al. 2019, "Scale MLPerf-0.6 models on
Google TPU-v3 Pods"; ZeRO stage 1, Rajbhandari et al. 2020).

One step, N ranks (train.train_step calls the same methods as without sharding):

    backward        every rank writes its whole gradient arena, as without sharding
    reduce-scatter  ShardedReducer.finish(): the gradients summed over the ranks into
                    each rank's shard of arena.grad (Communicator.reduce_scatter)
    overflow        under loss scaling each rank checks its summed shard, and one
                    all-reduce (MAX) of the flags gives every rank the same verdict
                    (ShardedReducer.nonfinite_flag)
    norms           LARS and LAMB need per-parameter norms (Neumann ||w - v||, NLCG two
                    inner products), and a shard may cut through a parameter: each
                    rank sums squares (or products) per parameter over its shard
                    (the kernels' segment sums on the shard's clipped table), one small
                    all-reduce of that (2, parameters) float64 array gives every rank the
                    whole parameters' sums (`sum_partials`, called inside the kernels),
                    and the norms are their square roots:
                        ||x||_s^2 = sum over ranks r of sum_{i in s and in shard r} x_i^2
    update          the SGD / LARS / LAMB / Neumann / NLCG kernels of the unsharded path,
                    on the shard's slices of master and grad and its own momentum (and
                    the optimizer's other arrays: LAMB's second moment, Neumann's moving
                    average, NLCG's second moment and preconditioned gradient)
    all-gather      ShardedOptimizer.step(): every shard's updated fp32 masters to every
                    rank (Communicator.all_gather), then the working copy (fp16 under
                    mixed precision) refreshed from them

A reduce-scatter and an all-gather move the bytes of one all-reduce (a ring
all-reduce is exactly these two phases), so the communication costs about what the
all-reduce costs; the update reads and writes 1/N of the arena, and the optimizer
state per rank is 1/N of the arena's momentum (and of the optimizer's other arrays).

Shards. With U = arena.size / ALIGN (the arena's size is a multiple of ALIGN),
rank r's shard is the element range

    [ALIGN * floor(r U / N), ALIGN * floor((r + 1) U / N))

so every shard starts ALIGN-aligned in every buffer, the sizes differ by at most
ALIGN elements, a shard may begin or end inside a parameter, and the bounds depend
on the arena's size and N only: identical on every rank, fixed for the run.

A shard's segment table has every row of the arena's, each clipped to the shard
and shifted to the shard's start (a parameter outside the shard gets size 0). So
every rank's table has the same rows and flags, and the kernels decide alike on
every rank whether to take norms, hence whether to join the norms' all-reduce.

Checkpoints hold the whole state, as without sharding: state_dict() gathers
every shard's optimizer arrays into arena-sized ones, load_state_dict() keeps
this rank's part of arena-sized ones. A run hence resumes sharded or not, on
any number of ranks, from a checkpoint written either way (mpitrain.checkpoint).
"""
import numpy as np

from .arena import ALIGN, SEGMENT_DTYPE, aligned_zeros
from .backend import to_numpy
from .kernels.cast import refresh_working
from .kernels.update import nonfinite_flag
from .optim import make_optimizer


def shard_bounds(arena_size, ranks):
    """[b_0, ..., b_ranks]: rank r's shard is [b_r, b_r+1) (see the module docstring)."""
    units = arena_size // ALIGN
    return [ALIGN * (units * r // ranks) for r in range(ranks + 1)]


def clip_segments(segments, lo, hi):
    """The segment table of the elements [lo, hi): every row kept, its range clipped to
    [lo, hi) and counted from lo (size 0 for a parameter outside), its flags as they are."""
    start = np.clip(segments["offset"], lo, hi)
    stop = np.clip(segments["offset"] + segments["size"], lo, hi)
    out = np.zeros(len(segments), SEGMENT_DTYPE)
    out["offset"], out["size"] = start - lo, stop - start
    out["decay"], out["lars"] = segments["decay"], segments["lars"]
    return out


class Shard:
    """Rank `rank`'s part of `arena` among `ranks`, with what an optimizer reads of an arena:
    master and grad (views of the arena's slice), momentum (the shard's own buffer),
    working (the master slice itself: the kernels leave the working copy alone, and the
    ShardedOptimizer refreshes all of it after the all-gather), segments (clipped), zeros().
    bounds: every rank's shard boundaries; lo, hi: this one's."""

    def __init__(self, arena, rank, ranks):
        self.arena, self.xp = arena, arena.xp
        self.bounds = shard_bounds(arena.size, ranks)
        self.lo, self.hi = self.bounds[rank], self.bounds[rank + 1]
        self.size = self.hi - self.lo
        self.segments = clip_segments(arena.segments, self.lo, self.hi)
        self.master = arena.master[self.lo:self.hi]
        self.grad = arena.grad[self.lo:self.hi]
        self.working = self.master
        self.momentum = self.zeros()

    def zeros(self, dtype=None):
        """A zero buffer of the shard's size (aligned), e.g. optimizer state beside momentum."""
        return aligned_zeros(self.size, dtype or self.arena.dtype, self.xp)


class ShardedOptimizer:
    """The optimizer `name` (a key of optim.OPTIMIZERS; keyword arguments `hyper` as for
    optim.make_optimizer) applied to this rank's shard of `arena`, then the masters
    all-gathered. Releases arena.momentum: the shard's optimizer holds the state.

    step(lr, inv_scale) takes arena.grad summed into this rank's shard (ShardedReducer)
    and returns the per-parameter local learning rates / trust ratios of the whole
    parameters (the same on every rank)."""

    def __init__(self, name, arena, comm, **hyper):
        self.arena, self.comm = arena, comm
        self.shard = Shard(arena, comm.rank, comm.size)
        self.inner = make_optimizer(name, self.shard, sum_partials=self.sum_partials, **hyper)
        arena.release_momentum()

    def sum_partials(self, sums):
        """Add the (2, segments) per-parameter partial sums (squares, or NLCG's inner
        products) over the ranks, in place."""
        self.comm.allreduce(sums.reshape(-1), "flat")

    def step(self, lr, inv_scale=1.0):
        ratios = self.inner.step(lr, inv_scale)
        a = self.arena
        self.comm.all_gather(a.master, self.shard.bounds)
        refresh_working(a.master, a.working)        # one pass, zero padding included
        return ratios

    def state_bytes(self):
        """Bytes of optimizer state this rank holds (its shard's)."""
        return self.shard.momentum.nbytes + sum(v.nbytes for v in self.inner.state_dict().values()
                                                if np.ndim(v))

    def state_dict(self):
        """The state of an unsharded optimizer, plus "momentum": every array arena-sized,
        gathered from every rank's shard (collective)."""
        state = {"momentum": self.shard.momentum, **self.inner.state_dict()}
        return {k: self._gather(v) if np.ndim(v) else v for k, v in state.items()}

    def load_state_dict(self, state):
        """Keep this rank's part of an arena-sized state (as from state_dict, or an
        unsharded run's checkpoint: "momentum" and the optimizer's own arrays)."""
        part = {k: v[self.shard.lo:self.shard.hi] if np.ndim(v) else v for k, v in state.items()}
        self.shard.momentum[...] = part.pop("momentum")
        self.inner.load_state_dict(part)

    def _gather(self, part):
        full = self.arena.zeros()
        full[self.shard.lo:self.shard.hi] = part
        self.comm.all_gather(full, self.shard.bounds)
        return full


class ShardedReducer:
    """The gradient Reducer's interface (mpitrain.comm.buckets.Reducer: begin, finish,
    nonfinite_flag, settle, close, postscale and top-k's residual, start_epoch,
    describe_compression) for a sharded update: finish() sums arena.grad over the ranks
    into each rank's shard, in one reduce-scatter after backward. No top-k: the
    reduce-scatter sums every gradient."""

    residual = None

    def start_epoch(self, epoch):
        """No top-k, so no dense warm-up."""

    def describe_compression(self):
        return None

    def __init__(self, shard, comm):
        self.shard, self.comm = shard, comm
        self.postscale = 1.0 / comm.size        # the update averages, as after an all-reduce

    def begin(self, loss_scale=1.0):
        """Nothing to arm: the reduce-scatter waits for the whole backward pass."""

    def finish(self):
        """This rank's shard of arena.grad holds the sum over the ranks."""
        self.comm.reduce_scatter(self.shard.arena.grad, self.shard.bounds)

    def nonfinite_flag(self):
        """1 on every rank when some rank's summed shard holds an inf or a NaN, else 0."""
        return self.comm.allmax(to_numpy(nonfinite_flag(self.shard.grad)))

    def settle(self, applied):
        """Nothing kept from step to step."""

    def close(self):
        """Nothing to release."""
