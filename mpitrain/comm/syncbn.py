"""Distributed BatchNorm (Ying et al. 2018): batch statistics over groups of G ranks.

`attach(model, comm, G)` takes a Group of G consecutive ranks from the
Communicator (0..G-1, G..2G-1, ...; the last group may be smaller) and gives
it to every BatchNorm2d of the model. In train mode nets.batchnorm then sums
the per-channel sums (of x, then of (x - mean)^2) over the group in forward
and dbeta, dgamma in backward, so the statistics are those of the group's
batches together; G=1 leaves BN per rank. Every rank of a group must have the
same number of images (the trainer gives all ranks the same batch).
"""


def attach(model, comm, group_size):
    """Make every BatchNorm2d of `model` compute its statistics over groups of `group_size`
    ranks of `comm` (an mpitrain.comm.Communicator, which frees the group with itself).
    Returns the Group (None for group_size 1: per-rank BN)."""
    from mpitrain.nets.batchnorm import BatchNorm2d
    if group_size == 1:
        return None
    group = comm.group(group_size)
    for _, m in model.named_modules():
        if isinstance(m, BatchNorm2d):
            m.group = group
    return group
