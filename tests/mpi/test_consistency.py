"""Replica consistency under `mpirun -np N` (any N): the replica check names the ranks
whose weights differ; a resume on another number of ranks keeps the ranks' dropout masks
apart. (A rank that raises during an overlapped gradient sum is
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


def dropout_net(rank):
    """A linear layer and two dropout layers, seeded per rank as build_model seeds
    AlexNet's."""
    from mpitrain.nets.activation import Dropout
    from mpitrain.nets.linear import Linear
    from mpitrain.nets.module import Sequential
    return Sequential(Linear(4, 2), Dropout(0.5, seed=(0, rank, 0)),
                      Dropout(0.5, seed=(0, rank, 1))).bind(seed=0)


def test_dropout_masks_differ_between_ranks_after_a_resume_on_another_rank_count(tmp_path):
    """A checkpoint written by one rank holds one generator state per dropout layer.
    Restored on one rank, those states go on; on more ranks, every rank's draws differ
    from every other rank's (each reseeded from the run's seed, its rank and the step)."""
    from mpitrain import checkpoint

    def check():
        path = WORLD.bcast(str(tmp_path / "c.h5") if WORLD.rank == 0 else None, root=0)
        solo, comm = Communicator(MPI.COMM_SELF), Communicator(WORLD)
        written = dropout_net(rank=0)
        if WORLD.rank == 0:
            checkpoint.write(path, checkpoint.collect(written, solo, 0, 3, 3, {"seed": 0}))
        WORLD.barrier()
        resumed = dropout_net(rank=WORLD.rank)
        checkpoint.restore(path, resumed, comm)
        solo.free()
        draws = [layer.rng.random(8) for layer in checkpoint.dropout_layers(resumed)]
        every = WORLD.allgather(np.concatenate(draws))
        if WORLD.size == 1:
            goes_on = [layer.rng.random(8) for layer in checkpoint.dropout_layers(written)]
            return None if np.array_equal(every[0], np.concatenate(goes_on)) else \
                "one rank: the saved generators did not go on"
        if draws[0].tolist() == draws[1].tolist():
            return "two dropout layers of one rank draw alike"
        alike = [(a, b) for a in range(WORLD.size) for b in range(a)
                 if np.array_equal(every[a], every[b])]
        return f"ranks {alike} draw the same masks" if alike else None
    agree(check)


def test_a_refusal_read_on_one_rank_alone_is_raised_on_every_rank():
    """A check made from a rank's own reading (its host's free memory) that refuses on the
    last rank alone: every rank raises that refusal (checks.agreed), none is left waiting
    for the others; where no rank refuses, each gets its own result."""
    from mpitrain.checks import ConfigError, agreed
    comm = Communicator(WORLD)
    last = WORLD.size - 1

    def reading(rank):
        if rank == last:
            raise ConfigError(f"rank {rank}'s host has too little memory")
        return rank

    def check():
        try:
            agreed(comm, reading, WORLD.rank)
        except ConfigError as e:
            if str(e) != f"rank {last}'s host has too little memory":
                return f"raised {e}"
        else:
            return "no refusal"
        mine = agreed(comm, lambda rank: rank, WORLD.rank)
        return None if mine == WORLD.rank else f"result {mine}"
    agree(check)
    comm.free()
