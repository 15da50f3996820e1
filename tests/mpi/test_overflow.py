"""The overflow flag under `mpirun -np N` (any N): an inf or NaN on one rank makes every
rank see an overflow and skip the same step, so the replicas never part.

As in test_data_parallel.py, every rank computes its verdict, the verdicts are
gathered, and every rank asserts on all of them, so that a failure on one rank
never leaves the others waiting in a collective.
"""
import sys
import traceback

import numpy as np
import pytest
from mpi4py import MPI

from mpitrain.nets.activation import ReLU
from mpitrain.nets.conv import Conv2d
from mpitrain.nets.linear import Linear
from mpitrain.nets.module import Sequential
from mpitrain.nets.pool import GlobalAvgPool2d
from mpitrain.optim import SGD
from mpitrain.precision import LossScaler, found_overflow
from mpitrain.train import broadcast_model, train_step

WORLD = MPI.COMM_WORLD


def agree(check):
    """Run check() on every rank (None or a failure message), then fail everywhere if
    any rank failed; an exception aborts the job after printing its traceback."""
    try:
        verdict = check()
    except Exception:
        print(f"rank {WORLD.rank}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        WORLD.Abort(1)
    failures = [f"rank {r}: {v}" for r, v in enumerate(WORLD.allgather(verdict)) if v is not None]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_nonfinite_value_on_the_last_rank_is_seen_by_all(bad):
    def check():
        grad = np.ones(200_000, np.float32)
        clean = found_overflow(grad, WORLD)
        if WORLD.rank == WORLD.size - 1:
            grad[WORLD.size * 1000] = bad
        flagged = found_overflow(grad, WORLD)
        if clean or not flagged:
            return f"clean arenas gave {clean}, one bad value on the last rank gave {flagged}"
        return None
    agree(check)


@pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")   # the forced overflow
def test_an_overflow_on_one_rank_makes_every_rank_skip_the_same_step():
    bad_step = 2

    def check():
        model = Sequential(Conv2d(3, 6, 3, padding=1, bias=True), ReLU(), GlobalAvgPool2d(),
                           Linear(6, 5)).bind(working_dtype=np.float16, seed=WORLD.rank)
        broadcast_model(model, WORLD)
        opt = SGD(model.arena, momentum=0.9, weight_decay=1e-4)
        scaler = LossScaler("dynamic", init_scale=1024.0, growth_interval=1000)
        rng = np.random.default_rng(WORLD.rank)          # different data on each rank
        record = []
        for step in range(5):
            x = rng.standard_normal((2, 6, 6, 3)).astype(np.float16)
            if step == bad_step and WORLD.rank == WORLD.size - 1:
                x[0, 1, 1, 1] = np.inf                   # this rank alone overflows
            before = model.arena.master.copy()
            train_step(model, opt, WORLD, x, rng.integers(0, 5, 2), lr=0.1, scaler=scaler)
            moved = bool(np.any(model.arena.master != before))
            record.append((moved, scaler.scale, scaler.skipped))
        expected = [(True, 1024.0, 0), (True, 1024.0, 0), (False, 512.0, 1),
                    (True, 512.0, 1), (True, 512.0, 1)]
        if record != expected:
            return f"steps (moved, scale, skipped) {record}, expected {expected}"
        root = model.arena.master.copy()
        WORLD.Bcast(root, root=0)
        if not np.array_equal(model.arena.master, root):
            return "the replicas differ from rank 0's"
        return None
    agree(check)
