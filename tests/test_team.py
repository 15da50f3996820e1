"""The layers' Numba kernels: on the calling thread alone below PARALLEL_MIN_BYTES, on the
whole team above it, with the same bits either way."""
import numba
import numpy as np
import pytest
from numba import njit, prange

from mpitrain.tools.bench.step import OneStep, build_on_device
from mpitrain.kernels import team
from mpitrain.nets import conv as conv_module

pytestmark = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2,
                                reason="one Numba thread (NUMBA_NUM_THREADS=1): no team")


@team.by_size
@njit(parallel=True)
def _thread_ids(x, ids):
    for i in prange(ids.size):
        ids[i] = numba.get_thread_id()


def test_small_arrays_stay_on_the_calling_thread():
    ids = np.full(64, -1, np.int64)
    threads = numba.get_num_threads()
    assert threads >= 2
    small = np.zeros(team.PARALLEL_MIN_BYTES // 8 - 1)
    _thread_ids(small, ids)
    assert set(ids) == {0}
    _thread_ids(np.zeros(team.PARALLEL_MIN_BYTES // 8), ids)
    assert len(set(ids)) >= 2, "an array of PARALLEL_MIN_BYTES ran on one thread"
    assert numba.get_num_threads() == threads


def test_the_thread_count_comes_back_when_the_kernel_fails():
    threads = numba.get_num_threads()
    with pytest.raises(numba.core.errors.TypingError):
        _thread_ids(np.zeros(4), "not an array")
    assert numba.get_num_threads() == threads


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_network_step_gives_the_same_bits_alone_and_on_the_team(precision, monkeypatch):
    # every 3x3 stride-1 convolution on Winograd's path, so its kernels run too
    monkeypatch.setattr(conv_module, "WINOGRAD_MACS", 0)
    monkeypatch.setattr(conv_module, "WINOGRAD_TILES_PER_CHANNEL", 0)
    results = []
    for limit in (np.inf, 0):         # every kernel alone, then every kernel on the team
        monkeypatch.setattr(team, "PARALLEL_MIN_BYTES", limit)
        model, x, y = build_on_device("resnet_small", 64, 8, 10, seed=3, precision=precision)
        step = OneStep(model, precision)
        logits, loss = step.forward(x, y)
        step.backward()
        results.append((logits, loss, model.arena.grad.copy()))
    (l1, s1, g1), (l2, s2, g2) = results
    assert np.abs(g1).max() > 0
    np.testing.assert_array_equal(l1, l2)
    assert s1 == s2
    np.testing.assert_array_equal(g1, g2)
