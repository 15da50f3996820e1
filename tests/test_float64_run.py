"""`train --precision fp64` against an independent float64 replay in PyTorch.

The whole training loop (data order and sharding, forward and loss, backward, the sum
across ranks, the schedule, the optimizer, BatchNorm statistics averaged before each
evaluation) is written out here from the documented formulas, on PyTorch's twin of the
network, and the checkpoint the run writes must hold the replay's weights, momentum and
running statistics to float64 rounding. Only the initial weights are mpitrain's: the
replay starts from the network that `build_model` gives for the run's seed."""
import math
import subprocess

import h5py
import numpy as np
import pytest

from launcher import environment, mpitrain_command
from mpitrain import checkpoint
from mpitrain.nets import build_model

pytestmark = [pytest.mark.torch, pytest.mark.launches]

HYPER = dict(lr=0.1, momentum=0.9, weight_decay=5e-4, label_smoothing=0.1, warmup_epochs=1.0,
             lars_eta=0.001, lars_eps=1e-9, seed=0)
EPOCHS, BATCH = 2, 64


def learning_rate(position, epochs, lr, warmup_epochs, **_):
    """Linear warm-up to lr, then cosine to 0, at the epoch position a step ends at."""
    if position < warmup_epochs:
        return lr * position / warmup_epochs
    t = min((position - warmup_epochs) / (epochs - warmup_epochs), 1.0)
    return lr * 0.5 * (1 + math.cos(math.pi * t))


def replay(digits, ranks, optimizer):
    """The twin of rank 0 after the run, and its velocities by parameter name."""
    import torch

    from mpitrain.tools.bench.reference_torch import to_torch
    h = HYPER
    with h5py.File(digits / "digits_train.h5", "r") as f:
        labels = torch.from_numpy(f["labels"][...])
        images = (f["pixels"][...] - f["mean"][...]) / f["std"][...]      # (N, H, W, 3)
    images = torch.from_numpy(images.transpose(0, 3, 1, 2).copy())       # (N, 3, H, W)
    n, per_rank = len(labels), BATCH // ranks
    steps = n // BATCH                                  # the remainder is dropped
    start = build_model("resnet_small", num_classes=10, seed=h["seed"], dtype=np.float64)
    twins = [to_torch(start, torch.float64).train() for _ in range(ranks)]
    params = [dict(t.named_parameters()) for t in twins]
    velocity = {name: torch.zeros_like(p) for name, p in params[0].items()}
    loss = torch.nn.CrossEntropyLoss(label_smoothing=h["label_smoothing"])
    for epoch in range(EPOCHS):
        order = torch.from_numpy(np.random.default_rng([h["seed"], epoch]).permutation(n))
        for step in range(steps):
            grads = {name: torch.zeros_like(p) for name, p in params[0].items()}
            for rank, twin in enumerate(twins):
                first = step * BATCH + rank * per_rank
                mine = order[first:first + per_rank]
                twin.zero_grad()
                loss(twin(images[mine]), labels[mine]).backward()
                for name, p in params[rank].items():
                    grads[name] += p.grad / ranks
            lr = learning_rate(epoch + (step + 1) / steps, EPOCHS, **h)
            with torch.no_grad():
                for name, w in params[0].items():
                    g, decayed = grads[name], w.dim() > 1     # not biases, not BatchNorm
                    trust = 1.0
                    if optimizer == "lars" and decayed:
                        wn, gn = float(w.norm()), float(g.norm())
                        trust = h["lars_eta"] * wn / (gn + h["weight_decay"] * wn
                                                      + h["lars_eps"])
                    if decayed:
                        g = g + h["weight_decay"] * w
                    velocity[name] = h["momentum"] * velocity[name] + lr * trust * g
                    for rank in range(ranks):
                        params[rank][name] -= velocity[name]
        with torch.no_grad():                # evaluation averages the running statistics
            buffers = [dict(t.named_buffers()) for t in twins]
            for name in buffers[0]:
                if not name.endswith("num_batches_tracked"):
                    mean = sum(b[name] for b in buffers) / ranks
                    for b in buffers:
                        b[name].copy_(mean)
    return twins[0], velocity


def in_torch_layout(state, key):
    """A checkpoint's packed arena array (master or momentum) with rank 0's running
    statistics, named and laid out as the torch twin's state_dict."""
    from mpitrain.tools.export import torch_state_dict
    model = build_model("resnet_small", num_classes=10, dtype=np.float64)
    model.arena.unpack(state[key], model.arena.master)
    model.buffer_arena.unpack(state["buffers"][0], model.buffer_arena.data)
    return torch_state_dict(model)


@pytest.mark.parametrize("ranks, optimizer", [(1, "sgd"), (2, "lars")])
def test_a_float64_run_holds_the_weights_of_its_replay_in_torch(digits, tmp_path, ranks,
                                                               optimizer):
    h = HYPER
    run = tmp_path / "run"
    argv = ["train", "--data", "digits", "--data-dir", str(digits), "--precision", "fp64",
            "--optimizer", optimizer,
            "--epochs", str(EPOCHS), "--batch-size", str(BATCH), "--run-dir", str(run),
            "--label-smoothing", str(h["label_smoothing"]), "--lr", str(h["lr"])]
    job = subprocess.run(mpitrain_command(ranks, *argv), env=environment(ranks),
                         capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stdout + job.stderr
    state = checkpoint.read(str(checkpoint.latest(str(run))))
    assert state["master"].dtype == np.float64
    twin, velocity = replay(digits, ranks, optimizer)

    ours, theirs = in_torch_layout(state, "master"), twin.state_dict()
    for name, t in theirs.items():
        if name.endswith("num_batches_tracked"):
            continue
        t = t.numpy()
        assert np.abs(ours[name] - t).max() <= 1e-9 * np.abs(t).max(), name
    momentum = in_torch_layout(state, "momentum")
    for name, v in velocity.items():
        v = v.numpy()
        assert np.abs(momentum[name] - v).max() <= 1e-9 * np.abs(v).max(), name
