"""Replica consistency and failure under `mpirun -np N` (any N): the replica check names
the ranks whose weights differ, and a rank that raises during an overlapped gradient sum
ends the whole job instead of leaving the others waiting in the collective."""
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from mpi4py import MPI

from mpitrain.comm import Communicator
from mpitrain.comm.replicas import ReplicaMismatch, check_replicas
from launcher import mpiexec
from test_data_parallel import agree, small_net

WORLD = MPI.COMM_WORLD


def test_check_replicas_passes_equal_replicas_and_names_the_ones_that_differ():
    comm = Communicator(WORLD)

    def check():
        model = small_net(seed=0)
        try:
            check_replicas(model.arena, comm, step=1)
        except ReplicaMismatch as e:
            return f"equal replicas reported as different: {e}"
        if WORLD.size == 1:
            return None
        bad = WORLD.size - 1
        if WORLD.rank == bad:
            w = model.arena.master
            w[3] = np.nextafter(w[3], np.float32(np.inf))      # one bit of one weight
        try:
            check_replicas(model.arena, comm, step=7)
        except ReplicaMismatch as e:
            expected = f"rank(s) [{bad}] differ"
            return None if expected in str(e) and "step 7" in str(e) else f"message: {e}"
        return "a differing replica was not detected"
    agree(check)
    comm.free()


FAILING = textwrap.dedent("""
    import numpy as np
    from mpi4py import MPI
    from mpitrain.comm import Communicator
    from mpitrain.comm.buckets import Reducer
    from mpitrain.nets.conv import Conv2d
    from mpitrain.nets.linear import Linear
    from mpitrain.nets.module import Sequential
    from mpitrain.nets.pool import GlobalAvgPool2d
    from mpitrain.nets.losses import softmax_cross_entropy

    comm = Communicator(MPI.COMM_WORLD)
    conv = Conv2d(3, 4, 3, padding=1)
    model = Sequential(conv, GlobalAvgPool2d(), Linear(4, 3)).bind()
    reducer = Reducer(model.arena, comm, threshold=16)
    if comm.rank == 1:                       # fails after the first buckets went out
        def broken(dy):
            raise RuntimeError("rank 1 fails in backward")
        conv.backward = broken
    x = np.ones((2, 4, 4, 3), np.float32)
    loss, dlogits = softmax_cross_entropy(model.forward(x), np.array([0, 1]))
    reducer.begin()
    model.backward(dlogits)
    reducer.finish()
    print("rank", comm.rank, "finished: the failure went unnoticed")
""")


@pytest.mark.skipif(WORLD.size != 1, reason="starts its own 2-rank job; run once, under -np 1")
def test_a_rank_that_raises_during_the_gradient_sum_ends_the_job(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAILING)
    # the job must not see this test's own MPI launch
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDI_", "HYDRA_", "MPI_LOCAL"))}
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = "1"
    t = time.perf_counter()
    done = subprocess.run([mpiexec(), "-np", "2", sys.executable, "-m", "mpi4py", str(script)],
                          capture_output=True, text=True, timeout=60, env=env)
    took = time.perf_counter() - t
    assert done.returncode != 0, done.stdout + done.stderr
    assert "rank 1 fails in backward" in done.stderr
    assert "unnoticed" not in done.stdout
    assert took < 30
