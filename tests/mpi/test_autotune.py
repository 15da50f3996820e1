"""--fusion-threshold auto across real ranks: the candidates are the distinct bucket
layouts, each measured in turn with its first step not counted, rank 0's fastest is
adopted by every rank, and a tuner continued from its state_dict ends the same way."""
import numpy as np
import pytest

from mpitrain.comm.autotune import FusionTuner
from mpitrain.comm.buckets import bucket_bounds


def arena():
    """Weights of 128 KiB, 1 MiB and 16 KiB (and biases): three bucket layouts between
    16 KiB and 64 MiB."""
    from mpitrain.nets.linear import Linear
    from mpitrain.nets.module import Sequential
    return Sequential(Linear(64, 512), Linear(512, 512), Linear(512, 8)).bind(
        np.float32, seed=0).arena


def test_candidates_are_the_distinct_layouts(comm):
    a = arena()
    tuner = FusionTuner(a, comm)
    layouts = [tuple(bucket_bounds(a, t)) for t in tuner.candidates]
    assert len(set(layouts)) == len(layouts) == 3
    # every threshold from 16 KiB to 64 MiB gives one of those layouts
    assert {tuple(bucket_bounds(a, 1 << s)) for s in range(14, 28, 2)} == set(layouts)
    # the largest candidate is the one bucket of the whole arena
    assert len(bucket_bounds(a, tuner.candidates[-1])) == 1
    assert tuner.chosen is None


def drive(tuner, times, comm, start=0):
    """Feed tuner step times: times[candidate index][k] for its k-th step. Returns the
    thresholds the steps used and the steps whose record() ended a candidate."""
    used, changed, counts = [], [], {}
    step = start
    while tuner.chosen is None:
        t = tuner.threshold
        i = tuner.candidates.index(t)
        k = counts.get(i, len(tuner.times[i]))
        used.append(t)
        if tuner.record(times[i][k]):
            changed.append(step)
        counts[i] = k + 1
        step += 1
    return used, changed


def test_every_rank_adopts_rank_0s_fastest_with_first_steps_not_counted(comm):
    tuner = FusionTuner(arena(), comm, steps=3)
    n = len(tuner.candidates)
    fastest = n - 2 if comm.rank == 0 else 0    # the other ranks would choose differently
    times = [[1.0 + 0.1 * i] * 3 for i in range(n)]
    times[fastest] = [9.0, 0.5, 0.6]            # slowest first step: not counted
    used, changed = drive(tuner, times, comm)
    assert used == [t for t in tuner.candidates for _ in range(3)]
    assert changed == [3 * (i + 1) - 1 for i in range(n)]   # after each candidate's last step
    assert tuner.chosen == tuner.candidates[n - 2]          # rank 0's choice, on every rank
    assert comm.allgather(tuner.chosen) == [tuner.chosen] * comm.size
    assert tuner.median(tuner.chosen) == pytest.approx(0.55 if comm.rank == 0
                                                       else 1.0 + 0.1 * (n - 2))
    assert "chose" in tuner.describe() and tuner.record(0.1) is False


def test_state_dict_continues_where_it_left_off(comm):
    whole = FusionTuner(arena(), comm)
    n = len(whole.candidates)
    times = [[2.0 - 0.1 * i + 0.01 * k for k in range(whole.steps)] for i in range(n)]
    drive(whole, times, comm)

    first = FusionTuner(arena(), comm)
    for _ in range(first.steps + 1):            # into the second candidate
        i = first.candidates.index(first.threshold)
        first.record(times[i][len(first.times[i])])
    state = comm.bcast(first.state_dict(), root=0)     # as a checkpoint carries rank 0's
    second = FusionTuner(arena(), comm)
    second.load_state_dict(state)
    assert second.threshold == whole.candidates[1]
    _, changed = drive(second, times, comm, start=first.steps + 1)
    assert changed[-1] == len(times) * first.steps - 1      # the choice: the size just measured
    assert second.chosen == whole.chosen == whole.candidates[-1]
    assert second.state_dict() == whole.state_dict() if comm.rank == 0 else True


def test_state_of_another_model_is_refused(comm):
    tuner = FusionTuner(arena(), comm)
    state = tuner.state_dict()
    state["candidates"] = state["candidates"][1:]
    with pytest.raises(ValueError, match="not this model's"):
        FusionTuner(arena(), comm).load_state_dict(state)
