"""Data parallelism under `mpirun -np N` (any N): the gradient all-reduce sums, and N
ranks with B/N images each take the same steps as one process with the whole batch B.

Every rank computes its own verdict, the verdicts are gathered, and every rank asserts
on all of them: a failure on one rank fails the test everywhere instead of leaving the
others waiting in a collective. An unexpected exception may strike while other ranks
sit in a collective, so it aborts the whole job (after printing its traceback).
"""
import sys
import traceback

import numpy as np
from mpi4py import MPI

from mpitrain.nets.activation import ReLU
from mpitrain.nets.conv import Conv2d
from mpitrain.nets.linear import Linear
from mpitrain.nets.module import Sequential
from mpitrain.nets.pool import GlobalAvgPool2d
from mpitrain.optim import SGD
from mpitrain.train import allreduce_sum, broadcast_model, train_step

WORLD = MPI.COMM_WORLD


def agree(check):
    """Run check() on every rank (it returns None or a failure message), then fail on
    every rank if any rank failed."""
    try:
        verdict = check()
    except Exception:
        print(f"rank {WORLD.rank}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        WORLD.Abort(1)
    verdicts = WORLD.allgather(verdict)
    failures = [f"rank {r}: {v}" for r, v in enumerate(verdicts) if v is not None]
    assert not failures, "\n".join(failures)


def small_net(seed=0):
    """No BatchNorm: a rank's gradient then depends on its own images only."""
    return Sequential(Conv2d(3, 6, 3, stride=1, padding=1, bias=True), ReLU(),
                      Conv2d(6, 8, 3, stride=2, padding=1, bias=False), ReLU(),
                      GlobalAvgPool2d(), Linear(8, 5)).bind(seed=seed)


def test_gradient_allreduce_sums_rank_filled_gradients():
    def check():
        model = small_net()
        arena = model.arena
        base = np.arange(arena.size, dtype=np.float32) % 97      # exact in fp32 when summed
        arena.grad[...] = (WORLD.rank + 1) * base
        allreduce_sum(WORLD, arena.grad)
        expected = WORLD.size * (WORLD.size + 1) / 2 * base
        if not np.array_equal(arena.grad, expected):
            return f"max error {np.abs(arena.grad - expected).max()}"
        return None
    agree(check)


def test_ranks_sharing_a_batch_match_one_process_with_all_of_it():
    local, steps = 2, 5
    global_batch = local * WORLD.size

    def check():
        rng = np.random.default_rng(42)     # the same data on every rank
        x = rng.standard_normal((steps * global_batch, 10, 10, 3)).astype(np.float32)
        y = rng.integers(0, 5, steps * global_batch)

        # every rank: its slice of each global batch, gradients summed over the world
        parallel = small_net(seed=WORLD.rank)       # different seeds: the broadcast must fix it
        broadcast_model(parallel, WORLD)
        opt = SGD(parallel.arena, momentum=0.9, weight_decay=1e-3, nesterov=True)
        for s in range(steps):
            part = slice(s * global_batch + WORLD.rank * local,
                         s * global_batch + (WORLD.rank + 1) * local)
            train_step(parallel, opt, WORLD, x[part], y[part], lr=0.1, label_smoothing=0.1)

        # the serial reference, on this rank alone: rank 0's initial weights, whole batches
        serial = small_net(seed=0)
        opt = SGD(serial.arena, momentum=0.9, weight_decay=1e-3, nesterov=True)
        for s in range(steps):
            part = slice(s * global_batch, (s + 1) * global_batch)
            train_step(serial, opt, MPI.COMM_SELF, x[part], y[part], lr=0.1, label_smoothing=0.1)

        w, ref = parallel.arena.master, serial.arena.master
        moved = np.abs(ref - small_net(seed=0).arena.master).max()
        if moved < 1e-3:
            return f"the weights hardly moved ({moved}): the comparison would prove nothing"
        error = np.abs(w - ref).max() / np.abs(ref).max()
        if error > 1e-5:
            return f"weights differ from the serial run by {error:.2e} (relative to max |w|)"
        return None
    agree(check)


def test_replicas_stay_identical():
    def check():
        model = small_net(seed=WORLD.rank)
        broadcast_model(model, WORLD)
        opt = SGD(model.arena, momentum=0.9)
        rng = np.random.default_rng(WORLD.rank)     # different data on each rank
        for _ in range(3):
            x = rng.standard_normal((2, 8, 8, 3)).astype(np.float32)
            train_step(model, opt, WORLD, x, rng.integers(0, 5, 2), lr=0.05)
        root = model.arena.master.copy()
        WORLD.Bcast(root, root=0)
        error = np.abs(model.arena.master - root).max()
        return None if error <= 1e-6 * np.abs(root).max() else f"replica differs by {error}"
    agree(check)
