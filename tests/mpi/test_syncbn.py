"""Distributed BatchNorm under `mpirun -np N` (any N): with groups of consecutive ranks,
each rank's slice of the output and of dx, the summed gamma/beta gradients and the
running statistics equal single-process BN on the group's concatenated batch (float64)."""
import numpy as np
import pytest
from mpi4py import MPI

from mpitrain.comm import syncbn
from mpitrain.nets.batchnorm import BatchNorm2d
from mpitrain.nets.module import Sequential
from test_data_parallel import agree, reducer_for, serial_steps

WORLD = MPI.COMM_WORLD


def bn(comm=None, group_size=None):
    layer = BatchNorm2d(5)
    net = Sequential(layer).bind(dtype=np.float64, seed=0)
    net.arena.master[:] = np.random.default_rng(7).uniform(0.5, 1.5, net.arena.size)
    net.arena.sync_working()
    if group_size is not None:
        syncbn.attach(net, comm, group_size)
    return net, layer


@pytest.mark.parametrize("size", [None, 2, 3], ids=["all", "2", "3"])
def test_groups_equal_one_process_on_the_group_batch(comm, size):
    """With groups of `size` consecutive ranks (None: all of them; groups of 2 and 3 cross
    the hosts of tests/test_nodes.py), each rank's slice of the output and of dx and the
    running statistics are one process's on its group's batches together, and the
    gamma/beta gradients summed over the ranks are the sum of every group's."""
    n, N = 3, WORLD.size
    G = size or N

    def check():
        rng = np.random.default_rng(0)       # the same global batch on every rank
        x = rng.standard_normal((n * N, 4, 3, 5)) * 3 + 2
        dy = rng.standard_normal(x.shape)
        mine = slice(WORLD.rank * n, (WORLD.rank + 1) * n)

        net, layer = bn(comm, group_size=G)
        y = net.forward(x[mine], train=True)
        dx = net.backward(dy[mine])
        grads = net.arena.grad.copy()
        WORLD.Allreduce(MPI.IN_PLACE, grads, op=MPI.SUM)    # what the gradient all-reduce does

        ref_grads = 0
        for first in range(0, N, G):           # every group's batch in one process
            rows = slice(first * n, min(first + G, N) * n)
            ref, _ = bn()
            y_ref, dx_ref = ref.forward(x[rows], train=True), ref.backward(dy[rows])
            ref_grads = ref_grads + ref.arena.grad
            if first == WORLD.rank // G * G:
                at = slice((WORLD.rank - first) * n, (WORLD.rank - first + 1) * n)
                expect = dict(y=y_ref[at], dx=dx_ref[at], stats=ref.buffer_arena.data.copy())
        failures = []
        for name, a, b in (("y", y, expect["y"]), ("dx", dx, expect["dx"]),
                           ("gamma/beta grads", grads, ref_grads),
                           ("running stats", net.buffer_arena.data, expect["stats"])):
            err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
            if err > 1e-12:
                failures.append(f"{name} differ by {err:.1e}")
        # without the group the same rank's output differs (unless the rank is its group)
        alone, _ = bn()
        grouped = layer.group is not None and layer.group.size > 1
        if grouped and np.allclose(alone.forward(x[mine], train=True), y):
            failures.append("per-rank BN gave the same output: the test would prove nothing")
        return "; ".join(failures) or None
    agree(check)


def test_one_value_per_channel_on_each_rank_is_enough_in_a_group(comm):
    """Batch 1 on a 1x1 map is one value per channel: per-rank BN refuses it, as PyTorch
    does, but a group of two or more ranks takes its statistics over all their values, so
    each rank's output and dx are one process's on the group's batch."""
    N = WORLD.size

    def check():
        rng = np.random.default_rng(0)
        x = rng.standard_normal((N, 1, 1, 5)) * 3 + 2      # rank r holds row r
        dy = rng.standard_normal(x.shape)
        net, _ = bn(comm, group_size=N)
        mine = slice(WORLD.rank, WORLD.rank + 1)
        if N == 1:
            try:
                net.forward(x, train=True)
            except ValueError as e:
                return None if "more than one value per channel" in str(e) else str(e)
            return "one value per channel was accepted outside a group"
        y = net.forward(x[mine], train=True)
        dx = net.backward(dy[mine])
        ref, _ = bn()
        y_ref, dx_ref = ref.forward(x, train=True), ref.backward(dy)
        failures = [f"{name} differ by {np.abs(a - b).max():.1e}"
                    for name, a, b in (("y", y, y_ref[mine]), ("dx", dx, dx_ref[mine]),
                                       ("running stats", net.buffer_arena.data,
                                        ref.buffer_arena.data))
                    if not np.allclose(a, b, rtol=1e-12, atol=1e-12)]
        return "; ".join(failures) or None
    agree(check)


def test_group_of_one_is_per_rank_batchnorm(comm):
    def check():
        x = np.random.default_rng(WORLD.rank).standard_normal((2, 3, 3, 5))
        net, layer = bn(comm, group_size=1)
        ref, _ = bn()
        if layer.group is not None:
            return "a group of one must leave BN per rank"
        return None if np.array_equal(net.forward(x), ref.forward(x)) else "outputs differ"
    agree(check)


def test_ranks_with_a_bn_group_of_all_match_one_process_with_the_whole_batch(comm):
    """Training with BatchNorm: N ranks x 2 images with --bn-group N and the bucketed,
    overlapped gradient sum reach the weights and running statistics of one process
    training on the concatenated batches."""
    from mpitrain.nets.activation import ReLU
    from mpitrain.nets.conv import Conv2d
    from mpitrain.nets.linear import Linear
    from mpitrain.nets.pool import GlobalAvgPool2d
    from mpitrain.optim import SGD
    from mpitrain.train import train_step

    def net():
        return Sequential(Conv2d(3, 6, 3, padding=1), BatchNorm2d(6), ReLU(), GlobalAvgPool2d(),
                          Linear(6, 4)).bind(dtype=np.float64, seed=3)

    def optimizer(arena):
        return SGD(arena, momentum=0.9)

    local, steps, N = 2, 3, WORLD.size

    def check():
        rng = np.random.default_rng(5)
        x = rng.standard_normal((steps * local * N, 6, 6, 3))
        y = rng.integers(0, 4, steps * local * N)
        parallel = net()
        syncbn.attach(parallel, comm, N)
        reducer = reducer_for(parallel, comm, threshold=64)
        opt = optimizer(parallel.arena)
        for s in range(steps):
            part = slice((s * N + WORLD.rank) * local, (s * N + WORLD.rank + 1) * local)
            train_step(parallel, opt, reducer, x[part], y[part], lr=0.1)
        reducer.close()
        serial = serial_steps(net(), x, y, steps, N * local, optimizer)
        failures = []
        for name, a, b in (("weights", parallel.arena.master, serial.arena.master),
                           ("running stats", parallel.buffer_arena.data, serial.buffer_arena.data)):
            err = np.abs(a - b).max() / np.abs(b).max()
            if err > 1e-10:
                failures.append(f"{name} differ from the serial run by {err:.1e}")
        return "; ".join(failures) or None
    agree(check)
