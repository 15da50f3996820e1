"""Ranks sharing a GPU under `mpirun -np N` (any N), as far as a CPU can check it: the
device index and the collectives each real rank takes from its node-local rank and
the node's size (backend.pick_device, backend.collectives_for), and the refusals,
alike on every rank of the node. A node is a host (on emulated hosts too:
tests/test_nodes.py), so each node's ranks are gathered and checked, whatever the job."""
import pytest

from mpitrain import backend
from mpitrain.backend import DeviceError, pick_device


def chosen(comm, gpus, k):
    """(device index, collectives) of every rank of this node, gathered on each of them."""
    index = pick_device("gpu", gpus, comm.host_rank, comm.host_size, {}, ranks_per_gpu=k)
    return comm.node_comm.allgather((index, backend.collectives_for(k)))


def test_all_ranks_of_a_node_share_one_gpu_through_mpi(comm):
    n = comm.host_size
    assert n == comm.local_size
    assert chosen(comm, 1, n) == [(0, "nccl" if n == 1 else "mpi")] * n


def test_consecutive_ranks_share_each_gpu(comm):
    n = comm.host_size
    if n % 2:
        pytest.skip("needs an even number of ranks")
    got = chosen(comm, n // 2, 2)
    assert [index for index, _ in got] == [r // 2 for r in range(n)]
    assert {how for _, how in got} == {"mpi"}


def test_a_gpu_per_rank_keeps_nccl(comm):
    n = comm.host_size
    assert chosen(comm, n, None) == [(r, "nccl") for r in range(n)]
    assert chosen(comm, n, 1) == [(r, "nccl") for r in range(n)]


def test_sharing_is_refused_on_every_rank_unless_asked_and_possible(comm):
    n = comm.host_size

    def refusal(gpus, k):
        try:
            pick_device("gpu", gpus, comm.host_rank, n, {}, ranks_per_gpu=k)
        except DeviceError as e:
            return str(e)
        return None

    # K does not divide the node's ranks
    messages = comm.node_comm.allgather(refusal(n + 1, n + 1))
    assert messages == [messages[0]] * n
    assert f"--ranks-per-gpu {n + 1} does not divide the {n} ranks" in messages[0]
    if n > 1:
        # two ranks on one GPU, not asked for
        messages = comm.node_comm.allgather(refusal(1, None))
        assert messages == [messages[0]] * n
        assert f"{n} ranks on this node but only 1 visible GPU(s)" in messages[0]
        assert "--ranks-per-gpu K" in messages[0]
        messages = comm.node_comm.allgather(refusal(1, 1))           # K = 1 is a GPU per rank
        assert f"need {n} GPUs, but only 1" in messages[0]
