"""kernels/prefetch.py: a prefetch is a hint, so a kernel that asks for lines past the ends
of its arrays reads and writes the same values, and never faults."""
import numpy as np
import pytest
from numba import njit

from mpitrain.kernels.prefetch import AHEAD, prefetch, prefetch_ahead


@njit
def _sum_prefetching(a, far):
    """The sum of a (C-contiguous, any shape), each run of elements prefetched ahead as
    the kernels do, and the element `far` past the end asked for as well."""
    flat, total = a.reshape(-1), 0.0
    for lo in range(0, a.size, 7):
        prefetch_ahead(a, lo, min(a.size, lo + 7))
        for i in range(lo, min(a.size, lo + 7)):
            total += flat[i]
    prefetch(a, a.size + far)
    prefetch(a, -far)
    return total


@pytest.mark.parametrize("dtype, shape", [(np.float32, (1000,)), (np.float64, (33, 17)),
                                          (np.uint16, (5, 3, 41))])
def test_prefetching_past_the_ends_changes_nothing_and_does_not_fault(dtype, shape):
    a = (np.arange(np.prod(shape)) % 251).astype(dtype).reshape(shape)
    before = a.copy()
    # lines AHEAD bytes past the end, and 2^40 elements away on either side: unmapped
    # memory, which a load would fault on
    assert _sum_prefetching(a, 1 << 40) == a.astype(np.float64).sum()
    assert _sum_prefetching(a, AHEAD) == a.astype(np.float64).sum()
    assert np.array_equal(a, before)
