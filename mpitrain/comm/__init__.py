"""Communication: the node topology and the all-reduce algorithms (MPI, and NCCL on GPUs).

    from mpitrain.comm import Communicator
    comm = Communicator(MPI.COMM_WORLD, ranks_per_node=None)
    comm.allreduce(grad[a:b], algorithm="hybrid")     # in place, same bits on every rank
"""
from .algorithms import ALGORITHMS, choose
from .topology import Communicator

__all__ = ["ALGORITHMS", "Communicator", "choose"]
