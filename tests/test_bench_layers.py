"""bench step's layer profile (mpitrain.tools.bench.layers), on the CPU's host clock: the
accounting of own times, bytes and floating-point operations that the GPU's CUDA-event
profile shares."""
import numpy as np
import pytest

from mpitrain.tools.bench.layers import (BYTES, HostClock, Recorder, format_profile, own_times,
                                   peaks, profile_layers)
from mpitrain.tools.bench.step import OneStep, build_on_device
from mpitrain.nets.conv import Conv2d


def test_own_times_subtract_the_intervals_nested_directly_inside():
    """(sequence, time) marks: A [1, 10] holds B [2, 5] and C [6, 9]; B holds D [3, 4]
    (recorded as they close: D, B, C, A); times are the squares of the sequence."""
    def iv(name, s, e):
        return (name, "forward", (s, s * s), (e, e * e), None)
    got = {m: ms for m, _, ms, _ in own_times([iv("D", 3, 4), iv("B", 2, 5), iv("C", 6, 9),
                                                iv("A", 1, 10)], lambda a, b: b - a)}
    assert got == {"D": 16 - 9, "B": (25 - 4) - (16 - 9), "C": 81 - 36,
                   "A": (100 - 1) - (25 - 4) - (81 - 36)}


def steps(step, x, y, n):
    for _ in range(n):
        step.forward(x, y)
        step.backward()
        step.update()


@pytest.fixture(scope="module")
def profiled():
    """A model after one step and two profiled steps, and its twin after three plain ones."""
    model, x, y = build_on_device("resnet_small", 16, 4, 10, 0)
    step = OneStep(model)
    steps(step, x, y, 1)                 # compiles the kernels outside the profile
    twin, _, _ = build_on_device("resnet_small", 16, 4, 10, 0)
    steps(OneStep(twin), x, y, 3)
    return model, x, y, twin, profile_layers(step, x, y, 2, HostClock())


def test_layer_profile_partitions_the_step_and_leaves_the_model_as_it_was(profiled):
    model, x, _, twin, p = profiled
    rows = {(r["layer"], r["phase"]): r for r in p["rows"]}
    for key in [("Conv2d", "forward"), ("Conv2d", "backward"), ("BatchNorm2d", "forward"),
                ("BatchNorm2d", "backward"), ("BasicBlock", "backward"), ("loss", "loss"),
                ("update", "update"), ("Linear", "backward")]:
        assert rows[key]["ms"] > 0, key
    # the own times cover the step but for the glue between the model's backward and
    # the marks around it
    covered = sum(r["ms"] for r in p["rows"])
    assert 0.9 * p["device_ms"] <= covered <= p["device_ms"] * (1 + 1e-9)
    assert all(r["ms"] >= -1e-6 for r in p["rows"])
    assert not any("run_layer" in m.__dict__ for _, m in model.named_modules())
    np.testing.assert_array_equal(model.arena.master, twin.arena.master)
    np.testing.assert_array_equal(model.forward(x, train=False), twin.forward(x, train=False))


def test_layer_profile_counts_the_bytes_and_products_of_each_layer(profiled):
    model, x, _, _, p = profiled
    rows = {(r["layer"], r["phase"]): r for r in p["rows"]}
    shapes = {}
    with Recorder(model, HostClock()) as recorder:
        model.forward(x, train=True)
    for m, phase, _, _, io in recorder.intervals:
        shapes.setdefault(type(m).__name__, []).append((m, io))
    macs = sum(m.macs(io[2], io[3]) for m, io in shapes["Conv2d"])
    assert rows[("Conv2d", "forward")]["flops"] == 2 * macs
    first = shapes["Conv2d"][0]         # the stem: its input needs no gradient, no dx
    assert rows[("Conv2d", "backward")]["flops"] == 4 * macs - 2 * first[0].macs(*first[1][2:4])
    assert rows[("Conv2d", "forward")]["calls"] == sum(isinstance(m, Conv2d)
                                                       for _, m in model.named_modules())
    k_in, k_out = BYTES[("BatchNorm2d", "forward")]
    bn = sum(k_in * io[0] + k_out * io[1] + io[4] for _, io in shapes["BatchNorm2d"])
    assert rows[("BatchNorm2d", "forward")]["bytes"] == bn
    assert any(io[4] for _, io in shapes["BatchNorm2d"])          # the blocks' residuals


def test_profile_text_reads_each_row_against_the_peaks(profiled):
    *_, p = profiled
    p = dict(p, clock="host clock",
             peaks=peaks(np, HostClock(), copy_bytes=1 << 20, n=64, dtype="float32", repeats=2))
    assert p["peaks"]["copy_gbs"] > 0 and p["peaks"]["product_tflops"] > 0
    text = "\n".join(format_profile(dict(p, kernels={"error": "no GPU"})))
    assert "BatchNorm2d       backward" in text and "of copy" in text
    assert "kernels per step: not counted (no GPU)" in text
