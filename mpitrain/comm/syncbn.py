"""Distributed BatchNorm (Ying et al. 2018): batch statistics over groups of G ranks.

`attach(model, mpi_comm, G)` splits the ranks into groups of G consecutive
ranks (0..G-1, G..2G-1, ...; the last group may be smaller) and gives every
BatchNorm2d of the model that group. In train mode nets.batchnorm then sums
the per-channel sums (of x, then of (x - mean)^2) over the group in forward
and dbeta, dgamma in backward, so the statistics are those of the group's
batches together; G=1 leaves BN per rank. Every rank of a group must have the
same number of images (the trainer gives all ranks the same batch).
"""
import numpy as np
from mpi4py import MPI

from mpitrain import backend


class Group:
    """G consecutive ranks of `mpi_comm`: .size, and .sum(v) -> the sum of a per-channel
    vector over the group (a new array on v's device)."""

    def __init__(self, mpi_comm, group_size):
        if int(group_size) < 1:
            raise ValueError(f"the BatchNorm group size must be positive, got {group_size}")
        self.comm = mpi_comm.Split(color=mpi_comm.rank // int(group_size), key=mpi_comm.rank)
        self.size = self.comm.size

    def sum(self, v):
        host = np.array(backend.to_numpy(v), copy=True)     # a few channels: staging is cheap
        self.comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
        return backend.array_module(v).asarray(host)

    def free(self):
        self.comm.Free()


def attach(model, mpi_comm, group_size):
    """Make every BatchNorm2d of `model` compute its statistics over groups of `group_size`
    ranks of `mpi_comm`. Returns the Group (None for group_size 1: per-rank BN)."""
    from mpitrain.nets.batchnorm import BatchNorm2d
    if group_size == 1:
        return None
    group = Group(mpi_comm, group_size)
    for _, m in model.named_modules():
        if isinstance(m, BatchNorm2d):
            m.group = group
    return group
