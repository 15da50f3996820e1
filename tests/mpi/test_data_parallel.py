"""Data parallelism under `mpirun -np N` (any N): the gradient sum of the training path,
and N ranks with B/N images each take the same steps as one process with the whole batch B.

Every rank computes its own verdict, the verdicts are gathered, and every rank asserts
on all of them: a failure on one rank fails the test everywhere instead of leaving the
others waiting in a collective. An unexpected exception may strike while other ranks
sit in a collective, so it aborts the whole job (after printing its traceback).
"""
import hashlib
import sys
import traceback

import numpy as np
import pytest
from mpi4py import MPI

from mpitrain.comm import ALGORITHMS, Communicator
from mpitrain.comm.buckets import Reducer, share_gradients
from mpitrain.control import end_job
from mpitrain.nets.activation import ReLU
from mpitrain.nets.conv import Conv2d
from mpitrain.nets.linear import Linear
from mpitrain.nets.module import Sequential
from mpitrain.nets.pool import GlobalAvgPool2d
from mpitrain.optim import SGD
from mpitrain.train import broadcast_model, train_step

WORLD = MPI.COMM_WORLD


def agree(check):
    """Run check() on every rank (it returns None or a failure message), then fail on
    every rank if any rank failed."""
    try:
        verdict = check()
    except Exception:
        print(f"rank {WORLD.rank}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        end_job(WORLD, 1)
    verdicts = WORLD.allgather(verdict)
    failures = [f"rank {r}: {v}" for r, v in enumerate(verdicts) if v is not None]
    assert not failures, "\n".join(failures)


def digest(a):
    return hashlib.sha1(np.ascontiguousarray(a).view(np.uint8)).hexdigest()


def small_net(seed=0, **bind):
    """No BatchNorm: a rank's gradient then depends on its own images only."""
    return Sequential(Conv2d(3, 6, 3, stride=1, padding=1, bias=True), ReLU(),
                      Conv2d(6, 8, 3, stride=2, padding=1, bias=False), ReLU(),
                      GlobalAvgPool2d(), Linear(8, 5)).bind(seed=seed, **bind)


def reducer_for(model, comm, algorithm="hybrid", **options):
    """The training path's Reducer: the arena's gradients in shared memory where the
    algorithm may use it, as train() does."""
    share_gradients(model.arena, comm, algorithm)
    return Reducer(model.arena, comm, algorithm=algorithm, **options)


def serial_steps(net, x, y, steps, global_batch, make_optimizer, **step):
    """The single-process reference: whole global batches on this rank alone."""
    comm = Communicator(MPI.COMM_SELF)
    reducer = Reducer(net.arena, comm)
    opt = make_optimizer(net.arena)
    for s in range(steps):
        part = slice(s * global_batch, (s + 1) * global_batch)
        train_step(net, opt, reducer, x[part], y[part], lr=0.1, **step)
    reducer.close()
    comm.free()
    return net


def test_ranks_sharing_a_batch_match_one_process_with_all_of_it(comm):
    local, steps = 2, 5
    global_batch = local * WORLD.size

    def optimizer(arena):
        return SGD(arena, momentum=0.9, weight_decay=1e-3, nesterov=True)

    def check():
        rng = np.random.default_rng(42)     # the same data on every rank
        x = rng.standard_normal((steps * global_batch, 10, 10, 3)).astype(np.float32)
        y = rng.integers(0, 5, steps * global_batch)

        # every rank: its slice of each global batch, gradients summed over the world
        parallel = small_net(seed=WORLD.rank)       # different seeds: the broadcast must fix it
        broadcast_model(parallel, comm)
        reducer = reducer_for(parallel, comm, threshold=100)
        opt = optimizer(parallel.arena)
        for s in range(steps):
            part = slice(s * global_batch + WORLD.rank * local,
                         s * global_batch + (WORLD.rank + 1) * local)
            train_step(parallel, opt, reducer, x[part], y[part], lr=0.1, label_smoothing=0.1)
        reducer.close()

        serial = serial_steps(small_net(seed=0), x, y, steps, global_batch, optimizer,
                              label_smoothing=0.1)
        w, ref = parallel.arena.master, serial.arena.master
        moved = np.abs(ref - small_net(seed=0).arena.master).max()
        if moved < 1e-3:
            return f"the weights hardly moved ({moved}): the comparison would prove nothing"
        error = np.abs(w - ref).max() / np.abs(ref).max()
        if error > 1e-5:
            return f"weights differ from the serial run by {error:.2e} (relative to max |w|)"
        return None
    agree(check)


@pytest.mark.parametrize("wire", [None, np.float16], ids=["fp32-wire", "fp16-wire"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_replicas_stay_bitwise_identical_through_the_training_path(comm, algorithm, wire):
    """The contract: every rank applies the same update to the same weights, bit for bit,
    whatever the algorithm and the dtype on the wire (different data on every rank)."""
    def check():
        model = small_net(seed=WORLD.rank)
        broadcast_model(model, comm)
        reducer = reducer_for(model, comm, algorithm, threshold=300, wire_dtype=wire)
        opt = SGD(model.arena, momentum=0.9)
        rng = np.random.default_rng(WORLD.rank)
        start = model.arena.master.copy()
        for _ in range(3):
            x = rng.standard_normal((2, 8, 8, 3)).astype(np.float32)
            train_step(model, opt, reducer, x, rng.integers(0, 5, 2), lr=0.05)
        reducer.close()
        if np.array_equal(model.arena.master, start):
            return "the weights did not move"
        digests = comm.allgather(digest(model.arena.master))
        return None if len(set(digests)) == 1 else f"master weights differ: {digests}"
    agree(check)
