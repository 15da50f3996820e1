"""Replica consistency under `mpirun -np N` (any N): the replica check names the ranks
whose weights differ. (A rank that raises during an overlapped gradient sum is
tests/test_failures.py's: it starts its own job, which no MPI allows from inside one.)"""
import numpy as np
from mpi4py import MPI

from mpitrain.comm import Communicator
from mpitrain.comm.replicas import ReplicaMismatch, check_replicas
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
