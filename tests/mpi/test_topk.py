"""Top-k sparsified gradients (mpitrain.comm.topk) under `mpirun -np N` (any N): the
exchange across real ranks, the residual through overflows, loss-scale changes and
checkpoints, and density 1.0 against dense sums. Verdicts are agreed as in
test_data_parallel (every rank asserts on every rank's)."""
import os

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from mpitrain import checkpoint
from mpitrain.kernels.update import has_overflow
from mpitrain.optim import SGD
from mpitrain.train import broadcast_model, train_step
from test_data_parallel import agree, digest, reducer_for, small_net

WORLD = MPI.COMM_WORLD


def fill(arena, buf, rng, scale=1.0):
    """Random values in every parameter's elements of the arena-sized buf; padding zero."""
    buf[...] = 0
    for o, n in zip(arena.segments["offset"], arena.segments["size"]):
        buf[o:o + n] = rng.standard_normal(n) * scale


def picks(acc, k):
    """This rank's picks by the definition: the k largest |acc|, ties by index."""
    order = np.lexsort((np.arange(acc.size), -np.abs(acc.astype(np.float64))))
    return np.sort(order[:k])


@pytest.mark.parametrize("overlap", [False, True], ids=["after", "thread"])
def test_every_rank_gets_the_float64_sum_of_every_ranks_picks(comm, overlap):
    """Same bits on every rank; each bucket equals the float64 sum of every rank's picks
    of grad + scale * residual; the new residual is the rest / scale, padding zero."""
    scale = 8.0

    def check():
        model = small_net(seed=0)
        a = model.arena
        reducer = reducer_for(model, comm, threshold=400, density=0.05, overlap=overlap)
        rng = np.random.default_rng(10 + WORLD.rank)
        fill(a, a.grad, rng, scale)
        fill(a, reducer.topk.residual, rng, 0.1)
        grad, residual = a.grad.copy(), reducer.topk.residual.copy()
        reducer.begin(scale)
        reducer.finish()
        reducer.settle(True)
        reducer.close()
        if len(reducer.bounds) < 3:
            return f"only {len(reducer.bounds)} bucket(s): the test needs several"
        failures = []
        for b, (start, stop) in enumerate(reducer.bounds):
            acc = grad[start:stop] + np.float32(scale) * residual[start:stop]
            mine = picks(acc, reducer.topk.k[b])
            every = comm.allgather((mine, acc[mine]))
            want, size = np.zeros(stop - start), np.zeros(stop - start)
            for idx, val in every:
                want[idx] += val
                size[idx] += np.abs(val)
            # p float32 additions: each rounds by at most half an ulp of the running sum
            if np.any(np.abs(a.grad[start:stop] - want) > WORLD.size * 2.0 ** -24 * size):
                failures.append(f"bucket {b}: sum differs from the float64 sum of the picks")
            rest = acc / np.float32(scale)
            rest[mine] = 0
            if not np.array_equal(reducer.topk.residual[start:stop], rest):
                failures.append(f"bucket {b}: residual is not the rest of acc / scale")
        outside = np.ones(a.size, bool)
        for o, n in zip(a.segments["offset"], a.segments["size"]):
            outside[o:o + n] = False
        if np.any(reducer.topk.residual[outside]) or np.any(a.grad[outside]):
            failures.append("padding is not zero")
        digests = comm.allgather(digest(a.grad))
        if len(set(digests)) != 1:
            failures.append(f"summed gradients differ between ranks: {digests}")
        return "; ".join(failures) or None
    agree(check)


def test_an_overflow_leaves_the_residual_and_the_loss_scale_does_not_matter(comm):
    """A non-finite gradient on one rank makes every rank's sum non-finite (the overflow
    check sees it) and settle(False) keeps the residual bit for bit; the residual is
    unscaled: gradients x 2^10 under scale 2^10 leave the same residual bits."""
    def check():
        model = small_net(seed=0)
        a = model.arena
        reducer = reducer_for(model, comm, threshold=400, density=0.1, overlap=False)
        rng = np.random.default_rng(20 + WORLD.rank)
        fill(a, reducer.topk.residual, rng, 0.1)
        before = reducer.topk.residual.copy()
        fill(a, a.grad, rng)
        clean = a.grad.copy()
        if WORLD.rank == WORLD.size - 1:
            a.grad[a.params[-1].offset] = np.inf
        reducer.begin(1.0)
        reducer.finish()
        if not has_overflow(a.grad):
            return "the summed gradient of an overflowed step is finite"
        reducer.settle(False)
        if not np.array_equal(reducer.topk.residual, before):
            return "a skipped step changed the residual"
        summed, residuals = [], []
        for scale in (1.0, 1024.0):
            reducer.topk.residual[...] = before
            a.grad[...] = clean * np.float32(scale)
            reducer.begin(scale)
            reducer.finish()
            reducer.settle(True)
            summed.append(a.grad / np.float32(scale))
            residuals.append(reducer.topk.residual.copy())
        reducer.close()
        if np.array_equal(residuals[0], before):
            return "an applied step left the residual as it was"
        if not np.array_equal(residuals[0], residuals[1]):
            return "the residual depends on the loss scale"
        if not np.array_equal(summed[0], summed[1]):
            return "the unscaled sum depends on the loss scale"
        return None
    agree(check)


def test_a_new_bucket_layout_carries_the_residual_over(comm):
    """The fusion tuner's change of bucket size: the next Reducer goes on from the last
    one's residual (Reducer.take_over), so nothing held back is lost. With a zero gradient each rank
    sends picks of its residual and keeps the rest: summed over the ranks, the new
    residuals plus the summed bucket are the old residuals (float64, to rounding)."""
    def check():
        model = small_net(seed=0)
        a = model.arena
        first = reducer_for(model, comm, threshold=400, density=0.1, overlap=False)
        fill(a, first.topk.residual, np.random.default_rng(30 + WORLD.rank), 0.1)
        held = comm.allgather(first.topk.residual.astype(np.float64))
        first.close()
        second = reducer_for(model, comm, threshold=4000, density=0.1, overlap=False)
        if second.bounds == first.bounds:
            return "the two thresholds give the same buckets: the test needs two layouts"
        second.take_over(first)
        a.grad[...] = 0
        second.begin(1.0)
        second.finish()
        second.settle(True)
        kept = comm.allgather(second.residual.astype(np.float64))
        second.close()
        if not np.any(a.grad):
            return "nothing was sent: the residual did not carry over"
        if not np.allclose(sum(kept) + a.grad, sum(held), rtol=0, atol=1e-6):
            return "summed bucket + new residuals differ from the residuals carried over"
        return None
    agree(check)


def test_warm_up_sums_densely_and_leaves_the_residual(comm):
    """An epoch before `dense_epochs` (--compress-warmup): the dense all-reduce's bits,
    and the residual as it was; from that epoch on, sparse sums."""
    def check():
        sums = []
        for density in (None, 0.01):
            model = small_net(seed=0)
            a = model.arena
            reducer = reducer_for(model, comm, threshold=400, density=density, overlap=False,
                                  dense_epochs=2)
            reducer.start_epoch(1)
            fill(a, a.grad, np.random.default_rng(50 + WORLD.rank))
            if density is not None:
                fill(a, reducer.residual, np.random.default_rng(60 + WORLD.rank))
                before = reducer.residual.copy()
            reducer.begin(1.0)
            reducer.finish()
            reducer.settle(True)
            reducer.close()
            sums.append(a.grad.copy())
        if not np.array_equal(reducer.residual, before):
            return "a dense step changed the residual"
        if not np.array_equal(*sums):
            return "the warm-up sum is not the dense sum"
        reducer.start_epoch(2)
        return None if reducer.topk.active else "epoch dense_epochs still sums densely"
    agree(check)


def test_density_one_takes_the_steps_of_dense_sums(comm):
    """5 training steps with every entry sent equal the dense all-reduce's: bit for bit on
    1 and 2 ranks (a sum of two does not depend on the order), within float32 rounding
    on more (the dense algorithms add in another order)."""
    def check():
        weights = []
        for density in (None, 1.0):
            model = small_net(seed=0)
            broadcast_model(model, comm)
            reducer = reducer_for(model, comm, threshold=400, density=density)
            opt = SGD(model.arena, momentum=0.9, weight_decay=1e-3)
            rng = np.random.default_rng(30 + WORLD.rank)
            for _ in range(5):
                x = rng.standard_normal((2, 8, 8, 3)).astype(np.float32)
                train_step(model, opt, reducer, x, rng.integers(0, 5, 2), lr=0.1)
            reducer.close()
            if density is not None and np.any(reducer.topk.residual):
                return "density 1.0 left a residual"
            weights.append(model.arena.master)
        dense, sparse = weights
        if np.array_equal(dense, small_net(seed=0).arena.master):
            return "the weights did not move"
        if WORLD.size <= 2 and not np.array_equal(dense, sparse):
            return f"not bitwise equal: max difference {np.abs(dense - sparse).max():.3g}"
        if not np.allclose(dense, sparse, rtol=1e-5, atol=1e-7):
            return f"weights differ by {np.abs(dense - sparse).max():.3g}"
        return None
    agree(check)


def test_checkpoints_keep_each_ranks_residual(comm, shared_dir):
    """collect gathers every rank's residual; restore_residual gives each rank its own
    back bit for bit, and zeros with a warning when the rank count differs."""
    def check():
        model = small_net(seed=0)
        a = model.arena
        mine = a.zeros()
        fill(a, mine, np.random.default_rng(40 + WORLD.rank))
        state = checkpoint.collect(model, comm, 0, 1, 1, {}, residual=mine)
        path = os.path.join(shared_dir, "checkpoint-000000001.h5")
        if WORLD.rank == 0:
            checkpoint.write(path, state)
        comm.barrier()
        said = []
        back = a.zeros()
        checkpoint.restore_residual(path, a, back, comm, lambda *m, **k: said.append(m))
        if not np.array_equal(back, mine) or said:
            return f"own residual not restored bit for bit ({said})"
        if WORLD.rank == 0:
            with h5py.File(path, "r+") as f:
                rows = f["residual"][...]
                del f["residual"]
                f["residual"] = np.concatenate([rows, rows[:1]])
        comm.barrier()
        checkpoint.restore_residual(path, a, back, comm, lambda *m, **k: said.append(m))
        if np.any(back):
            return "residual not zero after a resume on another rank count"
        if WORLD.rank == 0 and not any("start from zero" in m[0] for m in said):
            return f"no warning: {said}"
        return None
    agree(check)
