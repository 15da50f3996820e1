"""CUDA graphs of the training step (mpitrain/graph.py): which steps are captured and why
the others run eagerly, checked here; on a GPU, captured steps equal to eager steps bit
for bit, fp16 loss scale changes included."""
import numpy as np
import pytest

from mpitrain import backend
from mpitrain.graph import refusal
from mpitrain.nets import build_model


FP16 = {"working_dtype": np.float16}


@pytest.mark.parametrize("name,kw,ranks,device,reason", [
    ("resnet_small", FP16, 1, "cpu", "runs on the CPU"),
    ("resnet_small", FP16, 1, "cuda:0", None),
    ("resnet_small", FP16, 4, "cuda:0", "4 ranks: each bucket's all-reduce starts from backward"),
    ("resnet_small", {}, 1, "cuda:0", "float32 fully connected layers multiply through cuBLAS"),
    ("alexnet", FP16, 1, "cuda:0", None),                   # dropout: its keys on the device
    ("alexnet", {"dropout": 0.0, **FP16}, 1, "cuda:0", None),
    ("alexnet", {}, 1, "cuda:0", "float32 fully connected layers multiply through cuBLAS"),
])
def test_which_steps_are_captured_and_why_the_others_are_not(name, kw, ranks, device, reason):
    model = build_model(name, num_classes=10, seed=0, **kw)
    got = refusal(model, ranks, device)
    assert got is None if reason is None else reason in got


def test_a_number_or_a_device_value_scales_the_loss_gradient_alike():
    """softmax_cross_entropy's scale as a Python number (the eager step) or a 0-d array
    (what a graph reads at each replay): the same bits."""
    from mpitrain.nets.losses import softmax_cross_entropy
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((8, 5)).astype(np.float16)
    y = rng.integers(0, 5, 8)
    for scale in (1.0, 2.0 ** 16, 1000.0):
        loss_a, da = softmax_cross_entropy(logits, y, scale=scale)
        loss_b, db = softmax_cross_entropy(logits, y, scale=np.array(scale, np.float32))
        assert loss_a == loss_b and da.dtype == db.dtype == np.float16
        np.testing.assert_array_equal(da.view(np.uint16), db.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("name,kw,precision", [
    ("resnet_small", {}, "fp16"), ("alexnet", {"dropout": 0.0}, "fp16"), ("alexnet", {}, "fp16"),
])
def test_a_captured_step_equals_the_eager_step_bit_for_bit(name, kw, precision):
    """Six steps of the same model from the same seed, eagerly and with graphs (steps 1-2
    eager, 3 captured and replayed, 4-6 replayed) on a new batch each step, the loss scale
    halved before step 5: every step's loss, gradient, weights and BatchNorm statistics
    are the same bits, and so are the dropout generators' states. AlexNet at 224x224,
    where its adaptive pooling is the identity (at other sizes it copies its bins from
    the host, and the step stays eager); with its dropout (p = 0.5), every replay draws
    the eager step's masks from keys the graph writes before it."""
    import cupy

    from mpitrain.checkpoint import rng_states
    from mpitrain.tools.bench.step import OneStep, random_batch
    try:
        backend.use_device("gpu")
        size = 224 if name == "alexnet" else 32
        working = np.float16 if precision == "fp16" else None
        steps = [OneStep(build_model(name, num_classes=10, seed=3, working_dtype=working, **kw),
                         precision, graph=graph) for graph in (False, True)]
        for i in range(6):
            x, y = random_batch(steps[0].model, 16, size, 10, seed=i)
            if i == 4:
                for step in steps:
                    step.scaler.scale /= 2
            got = []
            for step in steps:
                _, loss = step.forward(cupy.asarray(x), cupy.asarray(y))
                step.backward()
                grad = cupy.asnumpy(step.model.arena.grad)
                step.update()
                got.append((float(loss), grad, cupy.asnumpy(step.model.arena.master),
                            cupy.asnumpy(step.model.buffer_arena.data)))
            (la, *a), (lb, *b) = got
            assert la == lb, (i, la, lb)
            for what, u, v in zip(("gradient", "weights", "BatchNorm statistics"), a, b):
                np.testing.assert_array_equal(u, v, err_msg=f"step {i + 1}: {what}")
            assert rng_states(steps[0].model) == rng_states(steps[1].model), i
        assert steps[1].graph_outcome() == "captured"
    finally:
        backend.use_device("cpu")


def train(tmp_path, name, *options):
    import subprocess
    import sys

    import launcher
    run_dir = tmp_path / name
    r = subprocess.run([sys.executable, "-m", "mpitrain", "train", "--data", "digits",
                        "--data-dir", str(tmp_path / "data"), "--epochs", "1",
                        "--run-dir", str(run_dir), *options], capture_output=True, text=True,
                       timeout=600, env=launcher.environment())
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout, (run_dir / "metrics.jsonl").read_text()


def test_cuda_graph_asked_for_on_the_cpu_is_refused_by_name_and_the_run_trains(tmp_path):
    out, metrics = train(tmp_path, "cpu", "--device", "cpu", "--cuda-graph")
    assert "--cuda-graph: the step runs eagerly: the step runs on the CPU" in out
    assert '"kind": "eval"' in metrics


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16"])
def test_training_with_cuda_graphs_logs_the_eager_runs_losses_and_accuracy(tmp_path, precision):
    """`train --cuda-graph` against `train` on the GPU: the same metrics.jsonl losses,
    training top-1 (counted inside the graph) and validation top-1, bit for bit (timings
    aside)."""
    import json

    def figures(metrics):
        records = [json.loads(line) for line in metrics.splitlines()]
        return [{k: v for k, v in r.items()
                 if k in ("kind", "loss", "top1", "top5", "global_step", "skipped_steps")}
                for r in records]

    def training_top1(metrics):
        return [r["top1"] for r in map(json.loads, metrics.splitlines()) if r["kind"] == "step"]
    common = ("--device", "gpu", "--precision", precision, "--model", "resnet_small")
    out, with_graph = train(tmp_path, "graph", *common, "--cuda-graph")
    assert "CUDA graphs: captured at step 3" in out, out
    _, eager = train(tmp_path, "eager", *common)
    assert figures(with_graph) == figures(eager)
    assert all(0 < a <= 1 for a in training_top1(with_graph))
