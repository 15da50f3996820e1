"""--layers plain: a network trained on the plain layers of nets/plain.py (PlainNetwork),
in its own arena and buffers. One step of resnet_small against the fast layers from the
same seed (float32: the same loss, gradients, BatchNorm statistics and update to float32
rounding, and the gradients announced in the fast layers' order), several steps in
float64 (the same to float64 rounding: nothing drifts), the digits job trained from the
command line on either layers, its checkpoint scored on the fast layers, and what
--layers plain refuses."""
import collections
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from gradcheck import assert_close
from launcher import environment
from mpitrain.checks import ConfigError, check_layers
from mpitrain.nets import build_model
from mpitrain.nets.conv import Conv2d
from mpitrain.nets.module import Module, Sequential
from mpitrain.nets.plain import PlainNetwork
from mpitrain.optim import make_optimizer
from mpitrain.options import Config
from mpitrain.train import train_step


def solo_reducer(arena, threshold):
    """The gradient Reducer of a one-process run, its buckets summed during backward."""
    from mpi4py import MPI

    from mpitrain.comm import Communicator
    from mpitrain.comm.buckets import Reducer
    return Reducer(arena, Communicator(MPI.COMM_SELF), threshold, overlap=True)


def batches(dtype, steps, n=32, seed=0):
    """`steps` random digits-sized batches (n, 32, 32, 3) with labels."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((n, 32, 32, 3)).astype(dtype), rng.integers(0, 10, n))
            for _ in range(steps)]


def train(plain, dtype, data, lr=0.05):
    """resnet_small from seed 0 trained on `data` with the fast or the plain layers, as a
    run does (train_step, SGD with momentum and weight decay, a Reducer of 4 buckets).
    Returns the model, the losses, the gradient of the first step, and the parameters in
    the order its backward announced their gradients (arena.on_grad_ready)."""
    model = build_model("resnet_small", num_classes=10, dtype=dtype)
    net = PlainNetwork(model) if plain else model
    optimizer = make_optimizer("sgd", model.arena, momentum=0.9, weight_decay=5e-4)
    reducer = solo_reducer(model.arena, threshold=model.arena.size * dtype().itemsize // 4)
    announced = []
    model.arena.on_grad_ready = lambda p: (announced.append(p), reducer.ready(p))
    losses, first_grad = [], None
    for x, y in data:
        losses.append(train_step(net, optimizer, reducer, x, y, lr))
        if first_grad is None:
            first_grad = model.arena.grad.copy()
    model.arena.on_grad_ready = reducer.ready
    reducer.close()
    return model, np.array(losses), first_grad, announced[:len(model.arena.params)]


def test_one_step_of_resnet_small_is_the_fast_layers_step():
    data = batches(np.float32, 1)
    fast, fast_loss, fast_grad, fast_order = train(False, np.float32, data)
    plain, plain_loss, plain_grad, plain_order = train(True, np.float32, data)
    assert_close(plain_loss, fast_loss, 5e-5, 0, "loss")
    for p in fast.arena.params:                     # the same layout: the same offsets
        where = slice(p.offset, p.offset + p.size)
        assert_close(plain_grad[where], fast_grad[where], 5e-5, 1e-12, f"gradient of {p.name}")
    # the running statistics moved in the buffer arena, alike
    start = build_model("resnet_small", num_classes=10).buffer_arena.data
    assert not np.allclose(plain.buffer_arena.data, start)
    assert_close(plain.buffer_arena.data, fast.buffer_arena.data, 5e-5, 0, "BatchNorm statistics")
    assert_close(plain.arena.master, fast.arena.master, 5e-5, 0, "updated weights")
    # every gradient announced once, in the fast layers' (the arena's) order
    assert [p.name for p in plain_order] == [p.name for p in fast_order] \
        == [p.name for p in fast.arena.params]


def test_steps_in_float64_follow_the_fast_layers_to_rounding():
    """Five steps: the weights, the momentum and the statistics the update and the next
    forward read are the fast run's to float64 rounding, and so is evaluation."""
    data = batches(np.float64, 5, n=8, seed=1)
    fast, fast_losses, _, _ = train(False, np.float64, data, lr=0.1)
    plain, plain_losses, _, _ = train(True, np.float64, data, lr=0.1)
    assert_close(plain_losses, fast_losses, 1e-10, 0, "losses")
    for what in ("master", "momentum"):
        assert_close(getattr(plain.arena, what), getattr(fast.arena, what), 1e-10, 0, what)
    assert_close(plain.buffer_arena.data, fast.buffer_arena.data, 1e-10, 0, "statistics")
    x = data[0][0]
    assert_close(PlainNetwork(plain).forward(x, train=False), fast.forward(x, train=False),
                 1e-10, 0, "eval logits")


def test_the_plain_layers_share_the_models_memory():
    model = build_model("resnet_small", num_classes=10)
    net = PlainNetwork(model)
    (_, stem), (_, bn) = net.pairs[:2]
    assert stem.W is model.conv1.weight.data and bn.gamma is model.bn1.weight.data
    assert bn.running_mean is model.bn1.running_mean.data
    before = model.buffer_arena.data.copy()
    x = batches(np.float32, 1, n=4)[0][0]
    net.forward(x, train=False)
    np.testing.assert_array_equal(model.buffer_arena.data, before)     # eval: left alone
    net.forward(x, train=True)
    assert (model.buffer_arena.data != before).any()


def test_what_has_no_plain_twin_is_refused():
    class Odd(Module):
        def forward(self, x, train=True):
            return x

    with pytest.raises(TypeError, match="Odd has no plain twin"):
        PlainNetwork(Sequential(Conv2d(3, 4, 3), Odd()).bind())
    with pytest.raises(ValueError, match="fp16"):
        PlainNetwork(build_model("resnet_small", num_classes=10, working_dtype=np.float16))


@pytest.mark.parametrize("option,value", [("precision", "fp16"), ("device", "gpu"),
                                          ("decode", "gpu"), ("cuda_graph", True),
                                          ("bn_group", 2)])
def test_check_layers_names_what_plain_layers_cannot_run(option, value):
    check_layers(Config(**{option: value}))                    # the fast layers can
    check_layers(Config(layers="plain", device="cpu"))
    flag = "--" + option.replace("_", "-")
    with pytest.raises(ConfigError, match=f"--layers plain cannot run with {flag}.*drop {flag} "
                                          f"or use --layers fast"):
        check_layers(Config(**{"layers": "plain", option: value}))
    with pytest.raises(ValueError, match="--layers: 'numpy': choose from fast, plain"):
        Config(layers="numpy")


# ----- the command, one process -----
# the digits job's files, converted on first use
DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


def mpitrain(*args, timeout=120):
    """`python -m mpitrain ARGS`: one process, no mpiexec (MPI starts as a singleton)."""
    return subprocess.run([sys.executable, "-m", "mpitrain", *args], capture_output=True,
                          text=True, timeout=timeout, env=environment(1))


@pytest.mark.parametrize("args,named", [
    (["--precision", "fp16"], "--precision fp16"), (["--device", "gpu"], "--device gpu"),
    (["--cuda-graph"], "--cuda-graph"), (["--bn-group", "2"], "--bn-group 2")])
def test_refusals_exit_2_naming_the_option(args, named, tmp_path):
    r = mpitrain("train", "--layers", "plain", *args, "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"--layers plain cannot run with {named}" in r.stderr, r.stderr
    assert "epoch" not in r.stdout and not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def digits_runs(tmp_path_factory):
    """The digits job for 3 epochs, on the fast and on the plain layers: {layers: (the
    command's result, its run directory)}, each with a trace in the run directory's
    parent. (After 2 epochs the accuracy is still climbing fast, and the two runs,
    parted by rounding, may differ by 6 points.)"""
    runs = {}
    for layers in ("fast", "plain"):
        run_dir = tmp_path_factory.mktemp(layers) / "run"
        r = mpitrain("train", "--layers", layers, "--data", "digits", "--epochs", "3",
                     "--data-dir", DATA, "--run-dir", str(run_dir),
                     "--trace", str(run_dir.parent) + "/", timeout=300)
        runs[layers] = r, run_dir
    return runs


def final_top1(r):
    assert r.returncode == 0, r.stdout + r.stderr
    return float(re.search(r"final validation accuracy: ([\d.]+)% top-1", r.stdout).group(1))


def test_the_digits_job_trains_on_the_plain_layers(digits_runs):
    """Rounding makes the two runs part after a few steps; their accuracy stays close
    (measured: within 1 point after 3 epochs, and after the default job's 8)."""
    (fast, run_dir), (plain, _) = digits_runs["fast"], digits_runs["plain"]
    assert "resnet_small on the plain layers of nets/plain.py" in plain.stdout
    assert fast.stdout.rstrip().endswith(f"\ntimeline {run_dir.parent}/trace.rank0.json: open "
                                         f"in https://ui.perfetto.dev or chrome://tracing")
    assert "plain layers" not in fast.stdout
    assert final_top1(plain) >= 93 and abs(final_top1(plain) - final_top1(fast)) <= 3


def test_the_trace_shows_the_layers_each_network_runs(digits_runs):
    """--trace: the fast network's top-level layers, the plain layers one by one (a
    residual block whole, a fused ReLU as the ReLU of its own), each forward and backward
    once a step (44 steps of 32 a training epoch, 3 epochs)."""
    names = {}
    for layers, (r, run_dir) in digits_runs.items():
        assert r.returncode == 0, r.stdout + r.stderr
        with open(run_dir.parent / "trace.rank0.json") as f:
            spans = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "layers"]
        names[layers] = collections.Counter(e["name"] for e in spans)
    assert set(names["fast"]) == {f"{phase} {name}" for phase in ("forward", "backward")
                                  for name in ("conv1", "bn1", "layer1", "layer2", "layer3",
                                               "avgpool", "fc")}
    blocks = {"layer1.0", "layer2.0", "layer3.0"}
    assert {f"forward {name}" for name in blocks | {"conv1", "bn1", "ReLU", "fc"}} \
        <= set(names["plain"])
    for layers in names:
        assert names[layers]["backward conv1"] == 3 * 44, names[layers]
        assert names[layers]["forward fc"] >= 3 * 44            # and evaluation's forward


def test_a_checkpoint_of_the_plain_layers_is_the_fast_layers_network(digits_runs):
    """The plain run's checkpoint, scored by `eval` on the fast layers: its own accuracy
    (the logits differ by rounding; at most one image may change its top class)."""
    plain, run_dir = digits_runs["plain"]
    r = mpitrain("eval", "--checkpoint", str(run_dir), "--data",
                 os.path.join(DATA, "digits_val.h5"), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert abs(100 * result["top1"] - final_top1(plain)) <= 100 / result["images"] + 1e-9
