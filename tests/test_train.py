"""The training pieces: SGD against a hand computation, the learning-rate schedule,
the data sharding, and the default job end to end under mpirun."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpitrain.arena import Arena, Param
from mpitrain.optim import SGD, learning_rate
from mpitrain.train import ConfigError, check_batch


# ----- SGD -----
def tiny_arena(dtype, working_dtype=None):
    """A weight with decay (2 elements) and a bias without (3 elements)."""
    w = Param((2,), None, decay=True)
    b = Param((3,), None, decay=False, lars=False)
    arena = Arena([w, b], dtype=dtype, working_dtype=working_dtype)
    w.master[...] = [0.5, -1.5]
    b.master[...] = [2.0, 0.25, -0.75]
    arena.sync_working()
    return arena


GRADS = [[0.1, -0.2, 0.3, 0.4, -0.5], [-0.3, 0.6, 0.05, -0.1, 0.2], [0.2, 0.2, -0.4, 0.0, 0.1]]


def sgd_by_hand(lr, m, wd, nesterov):
    """The same three steps, one scalar at a time, from PyTorch's documented formulas."""
    w = [0.5, -1.5, 2.0, 0.25, -0.75]
    decays = [True, True, False, False, False]
    v = [0.0] * 5
    for g in GRADS:
        for i in range(5):
            d = g[i] + (wd * w[i] if decays[i] else 0.0)
            v[i] = m * v[i] + d
            w[i] -= lr * (d + m * v[i] if nesterov else v[i])
    return np.array(w), np.array(v)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-14), (np.float32, 1e-6)])
def test_sgd_matches_hand_computation(nesterov, dtype, tol):
    lr, m, wd = 0.1, 0.9, 0.05
    arena = tiny_arena(dtype)
    opt = SGD(arena, momentum=m, weight_decay=wd, nesterov=nesterov)
    for g in GRADS:
        arena.grad[...] = g
        opt.step(lr)
    w, v = sgd_by_hand(lr, m, wd, nesterov)
    np.testing.assert_allclose(arena.master, w, rtol=0, atol=tol)
    np.testing.assert_allclose(arena.momentum, v, rtol=0, atol=tol)


def test_sgd_decays_only_flagged_segments():
    # with a zero gradient, only weight decay moves the weights: the bias must stay put
    arena = tiny_arena(np.float64)
    opt = SGD(arena, momentum=0.0, weight_decay=0.5)
    opt.step(1.0)
    np.testing.assert_allclose(arena.master, [0.25, -0.75, 2.0, 0.25, -0.75], rtol=0, atol=0)


def test_sgd_refreshes_the_working_copy():
    arena = tiny_arena(np.float32, working_dtype=np.float16)
    arena.grad[...] = GRADS[0]
    SGD(arena, momentum=0.9, weight_decay=1e-2).step(0.5)
    np.testing.assert_array_equal(arena.working, arena.master.astype(np.float16))


def test_nesterov_needs_momentum():
    with pytest.raises(ValueError, match="momentum"):
        SGD(tiny_arena(np.float32), momentum=0.0, nesterov=True)


# ----- schedule -----
def test_learning_rate_schedule():
    # linear warm-up to the peak, then cosine to zero at the end
    assert learning_rate(0.5, 0.4, 10, warmup_epochs=2) == pytest.approx(0.1)
    assert learning_rate(2.0, 0.4, 10, warmup_epochs=2) == pytest.approx(0.4)
    assert learning_rate(6.0, 0.4, 10, warmup_epochs=2) == pytest.approx(0.2)
    assert learning_rate(10.0, 0.4, 10, warmup_epochs=2) == pytest.approx(0.0, abs=1e-12)
    assert learning_rate(7.0, 1.0, 10, kind="step", milestones=(3, 6)) == pytest.approx(0.01)
    assert learning_rate(2.0, 1.0, 10, kind="step", milestones=(3, 6)) == 1.0
    with pytest.raises(ValueError, match="unknown schedule"):
        learning_rate(1.0, 1.0, 10, kind="poly")


def test_check_batch():
    check_batch(64, 4, num_train=1000)
    with pytest.raises(ConfigError, match="does not divide by the 3 MPI ranks"):
        check_batch(64, 3)
    with pytest.raises(ConfigError, match="exceeds the 100 training images"):
        check_batch(128, 2, num_train=100)


# ----- the command, under mpirun -----
def mpirun():
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.fail("no mpiexec: run ./launch.sh setup")
    return found


def run_train(ranks, *args, timeout):
    """`mpirun -np ranks python -m mpitrain train args`, with each rank's share of the cores
    (as launch.sh gives it)."""
    env = dict(os.environ)
    threads = str(max(1, len(os.sched_getaffinity(0)) // ranks))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
        env[var] = threads
    return subprocess.run([mpirun(), "-np", str(ranks), sys.executable, "-m", "mpitrain", "train",
                           *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_batch_that_does_not_divide_is_refused_before_any_work():
    r = run_train(2, "--batch-size", "63", timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "global batch size 63 does not divide by the 2 MPI ranks" in r.stderr
    assert r.stderr.count("does not divide") == 1          # said once, by rank 0
    assert "usage:" in r.stderr
    assert "epoch" not in r.stdout                          # no training happened


def test_default_job_reaches_95_percent(tmp_path):
    r = run_train(2, "--data-dir", str(tmp_path), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    final = re.findall(r"final validation accuracy: ([\d.]+)% top-1", r.stdout)
    assert len(final) == 1, r.stdout                        # rank 0 alone reports
    assert float(final[0]) >= 95.0, r.stdout
    assert (tmp_path / "digits_train.h5").exists()          # it trained from converted files
