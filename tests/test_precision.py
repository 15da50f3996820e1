"""Mixed precision: the loss scaler's state machine, skipped steps (weights and BatchNorm
statistics untouched), fp16 activations in the layers, and fp16 training of the digits."""
import json
import re
import subprocess

import numpy as np
import pytest

from mpitrain.nets import build_model
from mpitrain.nets.batchnorm import BatchNorm2d
from mpitrain.nets.conv import Conv2d
from mpitrain.nets.resnet import _Block
from mpitrain.optim import SGD
from mpitrain.precision import LossScaleError, LossScaler, make_scaler
import launcher


# ----- the scaler -----
def steps(scaler, outcomes):
    """Feed outcomes ('o' overflow, '.' clean); return (applied?, scale after) per step."""
    return [(scaler.update(c == "o"), scaler.scale) for c in outcomes]


def test_dynamic_scaler_grows_after_n_clean_steps():
    s = LossScaler("dynamic", init_scale=8.0, growth_interval=3, max_scale=32.0)
    assert s.scale == 8.0 and s.check
    assert steps(s, "...") == [(True, 8.0), (True, 8.0), (True, 16.0)]
    assert steps(s, "......") == [(True, 16.0)] * 2 + [(True, 32.0)] + [(True, 32.0)] * 3  # cap
    assert s.skipped == 0


def test_dynamic_scaler_backs_off_and_skips_and_restarts_the_count():
    s = LossScaler("dynamic", init_scale=64.0, growth_interval=3)
    # two clean steps, an overflow: halved, skipped, and the clean count starts again
    assert steps(s, "..o") == [(True, 64.0), (True, 64.0), (False, 32.0)]
    assert steps(s, "..o...") == [(True, 32.0), (True, 32.0), (False, 16.0),
                                  (True, 16.0), (True, 16.0), (True, 32.0)]
    assert s.skipped == 2


def test_dynamic_scaler_stops_at_the_floor_and_aborts_when_stuck():
    s = LossScaler("dynamic", init_scale=8.0, min_scale=2.0, growth_interval=100, patience=3)
    assert steps(s, "oo") == [(False, 4.0), (False, 2.0)]      # down to the floor
    assert steps(s, "oo.") == [(False, 2.0), (False, 2.0), (True, 2.0)]  # never below; 2 stuck
    assert s.stuck == 0                                         # a clean step clears it
    assert steps(s, "oo") == [(False, 2.0), (False, 2.0)]
    with pytest.raises(LossScaleError, match="3 steps in a row at the smallest loss scale 2"):
        s.update(True)


def test_static_scaler_keeps_its_scale_and_skips_overflows():
    s = LossScaler(1024, patience=2)
    assert s.check and not s.dynamic
    assert steps(s, "o" + "." * 5) == [(False, 1024.0)] + [(True, 1024.0)] * 5
    s.update(True)
    # a static scale above 1 may be too large: the fix is a smaller one, not a lower lr
    with pytest.raises(LossScaleError, match="2 steps in a row at the static loss scale 1024: "
                                             ".* lower --loss-scale, or give --loss-scale dynamic"
                       ) as too_large:
        s.update(True)
    one = LossScaler(1.0, patience=1, check=True)   # at 1 there is no smaller scale to try
    with pytest.raises(LossScaleError, match="smallest loss scale 1: training has diverged") \
            as diverged:
        one.update(True)
    assert (too_large.value.diverged, diverged.value.diverged) == (False, True)
    half = LossScaler(0.5, patience=1, check=True)  # below 1 the gradients overflow at 1 too
    with pytest.raises(LossScaleError, match="smallest loss scale 0.5: training has diverged") \
            as diverged:
        half.update(True)
    assert diverged.value.diverged
    assert not LossScaler(1.0).check                # fp32 default: no checks unless asked
    with pytest.raises(ValueError, match="positive number or 'dynamic'"):
        LossScaler(-1.0)


def test_scaler_defaults_per_precision():
    fp16, fp32 = make_scaler(None, "fp16"), make_scaler(None, "fp32")
    assert (fp16.dynamic, fp16.scale, fp16.growth_interval, fp16.min_scale, fp16.check) == \
        (True, 2.0 ** 16, 2000, 1.0, True)
    assert (fp32.dynamic, fp32.scale, fp32.check) == (False, 1.0, False)
    assert make_scaler(1.0, "fp16").check           # fp16 always checks, even at scale 1
    assert make_scaler("dynamic", "fp32").check
    # fp16 on the wire: each rank's share of the gradient in fp16, scaled up and checked
    wire = make_scaler(None, "fp32", comm_dtype="fp16")
    assert (wire.dynamic, wire.scale, wire.check) == (True, 2.0 ** 16, True)
    assert make_scaler(1.0, "fp32", comm_dtype="fp16").check
    with pytest.raises(ValueError, match="unknown precision"):
        make_scaler(None, "bf16")


def test_scaler_state_round_trip():
    a = LossScaler("dynamic", init_scale=16.0, growth_interval=4)
    steps(a, "..o..")
    b = LossScaler("dynamic", init_scale=16.0, growth_interval=4)
    b.load_state_dict(a.state_dict())
    assert steps(a, "...o...") == steps(b, "...o...")
    assert a.state_dict() == b.state_dict()
    with pytest.raises(ValueError, match="static"):
        LossScaler(8.0).load_state_dict(a.state_dict())


def solo_reducer(model):
    """The gradient Reducer of a one-process run (its sums are the identity)."""
    from mpi4py import MPI

    from mpitrain.comm import Communicator
    from mpitrain.comm.buckets import Reducer
    return Reducer(model.arena, Communicator(MPI.COMM_SELF))


@pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")   # the overflows
def test_overflowing_steps_are_skipped_until_the_scale_fits():
    # at 2^24 the scaled dlogits already overflow fp16 (max 65504): the scaler halves
    # the scale and the weights, their fp16 copy, the momentum and the BatchNorm
    # statistics stay put, until a scale fits and a step is applied
    from mpitrain.train import train_step
    model = build_model("resnet_small", num_classes=10, working_dtype=np.float16)
    arena = model.arena
    opt = SGD(arena, momentum=0.9)
    reducer = solo_reducer(model)
    scaler = LossScaler("dynamic", init_scale=2.0 ** 24)
    x = np.random.default_rng(0).standard_normal((4, 32, 32, 3)).astype(np.float16)
    before = arena.master.copy(), arena.working.copy(), model.buffer_arena.data.copy()
    scales = []
    while scaler.skipped == len(scales) and len(scales) < 24:
        scales.append(scaler.scale)
        train_step(model, opt, reducer, x, np.arange(4), lr=0.1, scaler=scaler)
        if scaler.skipped == len(scales):
            np.testing.assert_array_equal(arena.master, before[0])
            np.testing.assert_array_equal(arena.working, before[1])
            np.testing.assert_array_equal(model.buffer_arena.data, before[2])
            assert not arena.momentum.any()
    assert scales[:2] == [2.0 ** 24, 2.0 ** 23]          # halved after each overflow
    assert scales == [2.0 ** (24 - i) for i in range(len(scales))]
    assert scaler.skipped == len(scales) - 1 >= 1          # the last step was applied
    assert np.abs(arena.master - before[0]).max() > 0
    np.testing.assert_array_equal(arena.working, arena.master.astype(np.float16))
    assert not np.array_equal(model.buffer_arena.data, before[2])   # the applied step moved them


@pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")   # the overflows
def test_a_forward_overflow_leaves_the_batchnorm_statistics_alone():
    """fp16 activations that overflow in forward give the batch inf/NaN statistics; the
    step is skipped, and the running statistics must stay what they were, bit for bit,
    instead of taking the inf/NaN in."""
    from mpitrain.train import train_step
    model = build_model("resnet_small", num_classes=10, working_dtype=np.float16)
    opt = SGD(model.arena, momentum=0.9)
    reducer = solo_reducer(model)
    scaler = LossScaler("dynamic", init_scale=1.0)
    x = np.random.default_rng(0).standard_normal((4, 32, 32, 3)).astype(np.float16)
    x[1, 5, 5, 0] = np.inf                               # forward overflows from here on
    stats = model.buffer_arena.data.copy()
    train_step(model, opt, reducer, x, np.arange(4), lr=0.1, scaler=scaler)
    assert scaler.skipped == 1
    np.testing.assert_array_equal(model.buffer_arena.data, stats)


# ----- fp16 activations -----
def test_fp16_model_holds_fp16_activations_and_half_size_working_weights():
    model = build_model("resnet_small", num_classes=10, working_dtype=np.float16)
    arena = model.arena
    assert arena.master.dtype == np.float32 and arena.working.dtype == np.float16
    assert arena.working.nbytes * 2 == arena.master.nbytes
    assert model.buffer_arena.data.dtype == np.float32          # BN statistics stay fp32
    x = np.random.default_rng(0).standard_normal((4, 32, 32, 3)).astype(np.float16)
    logits = model.forward(x, train=True)
    assert logits.dtype == np.float16
    kinds = set()
    for name, m in model.named_modules():
        if isinstance(m, Conv2d):
            assert (m.x if m.col is None else m.col).dtype == np.float16, name
        elif isinstance(m, _Block):
            assert m.y.dtype == np.float16, name
        elif isinstance(m, BatchNorm2d):
            assert m.x.dtype == np.float16, name          # the input it keeps stays fp16
        else:
            continue
        kinds.add(type(m).__name__)
        # nothing activation-sized is held in fp32: only per-channel vectors may be
        for attr, v in vars(m).items():
            if isinstance(v, np.ndarray) and v.dtype.kind == "f" and v.dtype != np.float16:
                assert v.ndim == 1 and v.size <= 64, (name, attr, v.dtype, v.shape)
    assert kinds == {"Conv2d", "BasicBlock", "BatchNorm2d"}     # (its ReLUs are fused into BN)
    # and the gradients land in the fp32 arena
    from mpitrain.nets.losses import softmax_cross_entropy
    _, dlogits = softmax_cross_entropy(logits, np.arange(4), scale=1024.0)
    assert dlogits.dtype == np.float16
    assert model.backward(dlogits) is None       # the images need no gradient
    assert arena.grad.dtype == np.float32 and np.isfinite(arena.grad).all()
    assert np.abs(arena.grad).max() > 0


# ----- fp16 training -----
def run_default_job(tmp_path, *args):
    """The default job (resnet_small on the digits, 8 epochs, 2 ranks) with `args`, under
    mpirun with each rank's share of the cores (as launch.sh runs it). Returns stdout."""
    r = subprocess.run(launcher.mpitrain_command(2, "train", "--data-dir", str(tmp_path),
                                                 "--checkpoint-every", "0", *args),
                       capture_output=True, text=True, timeout=600, env=launcher.environment(2))
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_fp16_digits_training_reaches_the_default_jobs_accuracy(tmp_path):
    """The default job in fp16 (loss-scaled) reaches the accuracy the fp32 default job must
    reach (tests/test_train.py), and skips few of its 352 steps."""
    out = run_default_job(tmp_path, "--precision", "fp16", "--run-dir", str(tmp_path / "fp16"))
    final = re.findall(r"final validation accuracy: ([\d.]+)% top-1", out)
    assert len(final) == 1, out
    assert float(final[0]) >= 95.0, out
    skipped = int(re.search(r"loss scale [\d.]+ at the end; (\d+) step", out).group(1))
    assert skipped < 35, out
    # each step record says the steps skipped so far and the scale the next step takes
    records = [json.loads(line) for line in open(tmp_path / "fp16" / "metrics.jsonl")]
    counts = [r["skipped_steps"] for r in records if r["kind"] == "step"]
    assert counts == sorted(counts) and counts[-1] <= skipped == records[-1]["skipped_steps"]
    assert all(r["loss_scale"] >= 1 for r in records if r["kind"] == "step")


def test_the_step_that_grows_the_scale_is_unscaled_by_the_scale_it_was_made_with():
    """A dynamic scaler doubles its scale after growth_interval clean steps: that step's
    gradient was made with the old scale and must be divided by it (in float64: the same
    update as without loss scaling, to rounding)."""
    from mpitrain.train import train_step
    x = np.random.default_rng(0).standard_normal((4, 8, 8, 3))
    after = []
    for scaler in (None, LossScaler("dynamic", init_scale=4.0, growth_interval=1)):
        model = build_model("resnet_small", num_classes=10, dtype=np.float64)
        opt = SGD(model.arena, momentum=0.9)
        train_step(model, opt, solo_reducer(model), x, np.arange(4), lr=0.1, scaler=scaler)
        after.append(model.arena.master.copy())
    assert scaler.scale == 8.0                    # the step grew the scale
    np.testing.assert_allclose(after[1], after[0], rtol=1e-12, atol=1e-15)
