"""The optimizers (mpitrain.optim) on whole arenas, against computations written out
here in float64, and the learning-rate schedules.

The kernels themselves are tested in test_update_kernels.py; these tests check
the optimizer classes: that each passes the right formula's arguments to its
kernel, on real gradients of a small model built from the layers.
"""
import numpy as np
import pytest

from mpitrain.arena import Arena, Param
from mpitrain.nets.activation import ReLU
from mpitrain.nets.conv import Conv2d
from mpitrain.nets.linear import Linear
from mpitrain.nets.losses import softmax_cross_entropy
from mpitrain.nets.module import Sequential
from mpitrain.nets.pool import GlobalAvgPool2d
from mpitrain.optim import (LAMB, LARS, NLCG, SGD, Neumann, learning_rate, make_optimizer,
                            scaled_lr)


# ----- SGD on a hand-made arena -----
def tiny_arena(dtype, working_dtype=None):
    """A weight with decay (2 elements) and a bias without (3 elements)."""
    w = Param((2,), None, decay=True)
    b = Param((3,), None, decay=False, lars=False)
    arena = Arena([w, b], dtype=dtype, working_dtype=working_dtype)
    w.master[...] = [0.5, -1.5]
    b.master[...] = [2.0, 0.25, -0.75]
    arena.sync_working()
    return arena


GRADS = [[0.1, -0.2, 0.3, 0.4, -0.5], [-0.3, 0.6, 0.05, -0.1, 0.2], [0.2, 0.2, -0.4, 0.0, 0.1]]


def set_grad(arena, g):
    """The five gradient values into the arena's (padded) gradient buffer."""
    arena.unpack(np.asarray(g, arena.dtype), arena.grad)


def packed(arena, buf):
    """The five parameter values of one of the arena's buffers, without the padding."""
    return arena.pack(buf)


def sgd_by_hand(lr, m, wd, nesterov):
    """The same three steps, one scalar at a time, from PyTorch's documented formulas
    (v' = m v' + d; w -= lr v', Nesterov w -= lr (d + m v'))."""
    w = [0.5, -1.5, 2.0, 0.25, -0.75]
    decays = [True, True, False, False, False]
    v = [0.0] * 5
    for g in GRADS:
        for i in range(5):
            d = g[i] + (wd * w[i] if decays[i] else 0.0)
            v[i] = m * v[i] + d
            w[i] -= lr * (d + m * v[i] if nesterov else v[i])
    return np.array(w), np.array(v)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-14), (np.float32, 1e-6)])
def test_sgd_matches_hand_computation(nesterov, dtype, tol):
    # with a constant rate the kernel's velocity (lr inside) is lr times PyTorch's
    lr, m, wd = 0.1, 0.9, 0.05
    arena = tiny_arena(dtype)
    opt = SGD(arena, momentum=m, weight_decay=wd, nesterov=nesterov)
    for g in GRADS:
        set_grad(arena, g)
        opt.step(lr)
    w, v = sgd_by_hand(lr, m, wd, nesterov)
    np.testing.assert_allclose(packed(arena, arena.master), w, rtol=0, atol=tol)
    np.testing.assert_allclose(packed(arena, arena.momentum), lr * v, rtol=0, atol=tol)


def test_sgd_decays_only_flagged_segments():
    # with a zero gradient, only weight decay moves the weights: the bias must stay put
    arena = tiny_arena(np.float64)
    opt = SGD(arena, momentum=0.0, weight_decay=0.5)
    opt.step(1.0)
    np.testing.assert_allclose(packed(arena, arena.master), [0.25, -0.75, 2.0, 0.25, -0.75],
                               rtol=0, atol=0)


def test_sgd_unscales_the_gradient():
    # a gradient scaled by 16 (loss scale 8, two ranks summed) with inv_scale 1/16 takes
    # the step of the plain gradient (powers of two: exactly)
    plain, scaled = tiny_arena(np.float64), tiny_arena(np.float64)
    opts = SGD(plain, weight_decay=0.05), SGD(scaled, weight_decay=0.05)
    for g in GRADS:
        set_grad(plain, g)
        set_grad(scaled, np.array(g) * 16)
        opts[0].step(0.1)
        opts[1].step(0.1, inv_scale=1 / 16)
    np.testing.assert_array_equal(scaled.master, plain.master)


def test_sgd_refreshes_the_fp16_working_copy():
    arena = tiny_arena(np.float32, working_dtype=np.float16)
    set_grad(arena, GRADS[0])
    SGD(arena, momentum=0.9, weight_decay=1e-2).step(0.5)
    assert arena.working.dtype == np.float16
    np.testing.assert_array_equal(arena.working, arena.master.astype(np.float16))


PADDING_HYPER = {"sgd": dict(momentum=0.9), "lars": dict(momentum=0.9), "lamb": {},
                 "neumann": dict(momentum=0.9, sgd_steps=1, reset_steps=2), "nlcg": {}}


@pytest.mark.parametrize("name", ["sgd", "lars", "lamb", "neumann", "nlcg"])
@pytest.mark.parametrize("working_dtype", [np.float16, None], ids=["fp16", "fp32"])
def test_optimizers_leave_the_arena_padding_alone(name, working_dtype):
    # the arena aligns every parameter, so the bias starts after a gap of padding; sentinels
    # there (finite in grad, so that nothing counts as an overflow) must survive the steps
    arena = tiny_arena(np.float32, working_dtype=working_dtype)
    opt = make_optimizer(name, arena, weight_decay=1e-2, **PADDING_HYPER[name])
    pad = np.ones(arena.size, bool)
    for offset, size in zip(arena.segments["offset"], arena.segments["size"]):
        pad[offset:offset + size] = False
    assert pad.sum() > 0
    state = [arena.master, arena.momentum] + [v for v in opt.state_dict().values()
                                              if np.ndim(v)]
    for buf in state:
        buf[pad] = 7.0
    arena.grad[pad] = 1e4
    if arena.working is not arena.master:
        arena.working[pad] = 5.0
    for g in GRADS:
        set_grad(arena, g)
        opt.step(0.1)
    for buf in state:
        assert np.all(buf[pad] == 7.0)
    if arena.working is not arena.master:
        assert np.all(arena.working[pad] == 5.0)
    assert np.all(packed(arena, arena.master) != [0.5, -1.5, 2.0, 0.25, -0.75])     # moved


def test_bad_hyperparameters_are_refused():
    with pytest.raises(ValueError, match="momentum"):
        SGD(tiny_arena(np.float32), momentum=0.0, nesterov=True)
    with pytest.raises(ValueError, match="eta"):
        LARS(tiny_arena(np.float32), eta=0.0)
    with pytest.raises(ValueError, match="beta2"):
        LAMB(tiny_arena(np.float32), beta2=1.0)
    with pytest.raises(ValueError, match="Neumann momentum mu must lie in"):
        Neumann(tiny_arena(np.float32), momentum=1.0)
    with pytest.raises(ValueError, match="moving average gamma"):
        Neumann(tiny_arena(np.float32), gamma=1.0)
    with pytest.raises(ValueError, match="reset_steps must be >= 1"):
        Neumann(tiny_arena(np.float32), reset_steps=0)
    with pytest.raises(ValueError, match="NLCG beta2"):
        NLCG(tiny_arena(np.float32), beta2=1.0)
    with pytest.raises(ValueError, match="unknown NLCG beta rule 'dy'"):
        NLCG(tiny_arena(np.float32), beta_rule="dy")
    with pytest.raises(ValueError, match="unknown optimizer 'adam'"):
        make_optimizer("adam", tiny_arena(np.float32))


def test_neumann_phases_burn_in_then_resets_at_doubling_periods():
    # Algorithm 2 after 3 SGD steps: reset at Neumann step 1, then after K, 2K, 4K more
    # steps (K = 2: steps 1, 3, 7, 15); mu(t) = 1 - 1 / (1 + t) up to the momentum
    opt = Neumann(tiny_arena(np.float32), momentum=0.8, sgd_steps=3, reset_steps=2)
    phases = [opt.phase(t) for t in range(1, 20)]
    assert [p for p, _ in phases[:3]] == ["sgd"] * 3
    resets = [t - 3 for t, (p, _) in enumerate(phases, start=1) if p == "reset"]
    assert resets == [1, 3, 7, 15]
    assert all(p == "neumann" for t, (p, _) in enumerate(phases[3:], start=1) if t not in resets)
    assert [mu for _, mu in phases[3:7]] == pytest.approx([0.5, 2 / 3, 0.75, 0.8])
    assert max(mu for _, mu in phases) == 0.8


def test_neumann_keeps_the_weights_on_a_reset_and_moves_them_after():
    arena = tiny_arena(np.float64)
    start = packed(arena, arena.master).copy()
    opt = Neumann(arena, reset_steps=10)
    set_grad(arena, GRADS[0])
    opt.step(0.1)                                    # step 1: the reset, m = -lr g
    np.testing.assert_array_equal(packed(arena, arena.master), start)
    np.testing.assert_allclose(packed(arena, arena.momentum), -0.1 * np.array(GRADS[0]),
                               rtol=1e-15)
    np.testing.assert_array_equal(packed(arena, opt.average), start)     # v_0 = w_0
    set_grad(arena, GRADS[1])
    opt.step(0.1)                                    # step 2: mu = 2/3, no regulariser (w = v)
    m = 2 / 3 * -0.1 * np.array(GRADS[0]) - 0.1 * np.array(GRADS[1])
    np.testing.assert_allclose(packed(arena, arena.momentum), m, rtol=1e-14)
    np.testing.assert_allclose(packed(arena, arena.master),
                               start + 2 / 3 * m - 0.1 * np.array(GRADS[1]), rtol=1e-14)


# ----- LARS and LAMB on a tiny model, against float64 formulas -----
def tiny_model():
    """Conv with a bias (decay and LARS off for the bias), ReLU, pooling, linear, in float64."""
    return Sequential(Conv2d(3, 4, 3, padding=1, bias=True), ReLU(), GlobalAvgPool2d(),
                      Linear(4, 3)).bind(dtype=np.float64, seed=1)


def batches(steps=3):
    rng = np.random.default_rng(7)
    return [(rng.standard_normal((4, 5, 5, 3)), rng.integers(0, 3, 4)) for _ in range(steps)]


def gradients(model, x, y, scale=1.0):
    """Fill model.arena.grad with scale times the gradient of the loss at (x, y)."""
    _, dlogits = softmax_cross_entropy(model.forward(x, train=True), y, scale=scale)
    model.backward(dlogits)


def lars_by_hand(params, state, lr, m, wd, eta, eps):
    """One LARS step (You et al. 2017) per parameter, on float64 copies:
    local_lr = eta |w| / (|g| + wd |w| + eps) where p.lars (else 1);
    v = m v + lr local_lr (g + wd w), wd only where p.decay; w -= v."""
    for name, p in params:
        w, g = state[name]["w"], p.grad.copy()
        d = wd if p.decay else 0.0
        local = 1.0
        if p.lars:
            local = eta * np.linalg.norm(w) / (np.linalg.norm(g) + d * np.linalg.norm(w) + eps)
        state[name]["v"] = m * state[name]["v"] + lr * local * (g + d * w)
        state[name]["w"] = w - state[name]["v"]


def lamb_by_hand(params, state, lr, t, wd, b1=0.9, b2=0.999, eps=1e-6):
    """One LAMB step (You et al. 2019) per parameter: Adam's bias-corrected moments,
    r = m_hat / (sqrt(v_hat) + eps) + wd w (wd where p.decay), trust |w| / |r| where
    p.lars, w -= lr trust r."""
    for name, p in params:
        s, g = state[name], p.grad.copy()
        s["m"] = b1 * s["m"] + (1 - b1) * g
        s["v"] = b2 * s["v"] + (1 - b2) * g * g
        r = (s["m"] / (1 - b1 ** t)) / (np.sqrt(s["v"] / (1 - b2 ** t)) + eps)
        r = r + (wd if p.decay else 0.0) * s["w"]
        trust = np.linalg.norm(s["w"]) / np.linalg.norm(r) if p.lars else 1.0
        s["w"] = s["w"] - lr * trust * r


def run_against_reference(opt_name, hyper, by_hand, scale):
    """Three steps of the optimizer on a model, and the same steps by hand on a twin whose
    weights are set from the hand-computed state before each gradient. Returns the
    largest difference of the weights relative to their size, and how far they moved."""
    model, twin = tiny_model(), tiny_model()
    opt = make_optimizer(opt_name, model.arena, **hyper)
    params = list(twin.named_params())
    state = {n: {"w": p.master.copy(), "v": np.zeros(p.shape), "m": np.zeros(p.shape)}
             for n, p in params}
    start = model.arena.master.copy()
    for t, (x, y) in enumerate(batches(), start=1):
        gradients(model, x, y, scale)
        opt.step(0.5, inv_scale=1 / scale)
        for n, p in params:
            p.master[...] = state[n]["w"]
        gradients(twin, x, y)
        by_hand(params, state, t)
    ours = dict(model.named_params())
    error = max(np.abs(ours[n].master - state[n]["w"]).max() / np.abs(state[n]["w"]).max()
                for n, _ in params)
    return error, np.abs(model.arena.master - start).max()


def test_lars_matches_hand_computed_reference():
    hyper = dict(momentum=0.9, weight_decay=0.01, eta=0.02, eps=1e-9)
    error, moved = run_against_reference(
        "lars", hyper, lambda params, state, t: lars_by_hand(params, state, 0.5, 0.9, 0.01,
                                                             0.02, 1e-9), scale=1024.0)
    assert moved > 1e-3
    assert error < 1e-12


def test_lamb_matches_hand_computed_reference():
    error, moved = run_against_reference(
        "lamb", dict(weight_decay=0.01),
        lambda params, state, t: lamb_by_hand(params, state, 0.5, t, 0.01), scale=8.0)
    assert moved > 1e-3
    assert error < 1e-12


def test_sgd_equals_lars_with_the_trust_ratio_off():
    x, y = batches(1)[0]
    runs = {}
    for lars_flags in (False, True):
        for name in ("sgd", "lars"):
            model = tiny_model()
            if not lars_flags:
                model.arena.segments["lars"] = False      # no parameter takes the trust ratio
            opt = make_optimizer(name, model.arena, momentum=0.9, weight_decay=1e-3,
                                 nesterov=True)
            for _ in range(3):
                gradients(model, x, y)
                opt.step(0.1)
            runs[name, lars_flags] = model.arena.master.copy()
    np.testing.assert_array_equal(runs["sgd", False], runs["lars", False])
    assert np.abs(runs["sgd", True] - runs["lars", True]).max() > 1e-3   # trust on: it matters


ROUND_TRIP = {"lamb": dict(weight_decay=0.01),
              "neumann": dict(weight_decay=0.01, sgd_steps=1, reset_steps=2),
              "nlcg": dict(weight_decay=0.01, beta_rule="pr")}


@pytest.mark.parametrize("name", list(ROUND_TRIP))
def test_state_round_trip(name):
    # an optimizer restored from state_dict (plus the arena) continues exactly as the original
    x, y = batches(1)[0]
    a, b = tiny_model(), tiny_model()
    opt_a = make_optimizer(name, a.arena, **ROUND_TRIP[name])
    for _ in range(4):                  # Neumann: burn-in, reset, step, reset; then a step
        gradients(a, x, y)
        opt_a.step(0.1)
    b.arena.master[...] = a.arena.master
    b.arena.momentum[...] = a.arena.momentum
    opt_b = make_optimizer(name, b.arena, **ROUND_TRIP[name])
    opt_b.load_state_dict({k: np.copy(v) for k, v in opt_a.state_dict().items()})
    for model, opt in ((a, opt_a), (b, opt_b)):
        gradients(model, x, y)
        opt.step(0.1)
    np.testing.assert_array_equal(a.arena.master, b.arena.master)


# ----- schedules -----
def test_learning_rate_schedule():
    # linear warm-up to the peak, then cosine to zero at the end
    assert learning_rate(0.5, 0.4, 10, warmup_epochs=2) == pytest.approx(0.1)
    assert learning_rate(2.0, 0.4, 10, warmup_epochs=2) == pytest.approx(0.4)
    assert learning_rate(6.0, 0.4, 10, warmup_epochs=2) == pytest.approx(0.2)
    assert learning_rate(10.0, 0.4, 10, warmup_epochs=2) == pytest.approx(0.0, abs=1e-12)
    # poly, power 2: (1 - t)^2 after warm-up
    assert learning_rate(1.0, 0.4, 10, warmup_epochs=2, kind="poly") == pytest.approx(0.2)
    assert learning_rate(6.0, 0.4, 10, warmup_epochs=2, kind="poly") == pytest.approx(0.1)
    assert learning_rate(10.0, 0.4, 10, warmup_epochs=2, kind="poly") == 0.0
    assert learning_rate(7.0, 1.0, 10, kind="step", milestones=(3, 6)) == pytest.approx(0.01)
    assert learning_rate(2.0, 1.0, 10, kind="step", milestones=(3, 6)) == 1.0
    assert learning_rate(9.0, 0.3, 10, kind="constant") == 0.3
    with pytest.raises(ValueError, match="unknown schedule"):
        learning_rate(1.0, 1.0, 10, kind="exp")


def test_linear_scaling_rule():
    assert scaled_lr(0.1, 1024, 256) == pytest.approx(0.4)
    assert scaled_lr(0.1, 1024) == 0.1             # no reference batch: no scaling


# ----- the train flags of the optimizer, schedule and precision -----
@pytest.mark.parametrize("argv,message", [
    (["--optimizer", "adam"], "argument --optimizer: invalid choice: 'adam'"),
    (["--schedule", "exp"], "argument --schedule: invalid choice: 'exp'"),
    (["--lr-ref-batch", "0"], "argument --lr-ref-batch: 0 must be >= 1"),
    (["--lars-eta", "0"], "argument --lars-eta: 0 must be > 0.0"),
    (["--precision", "bf16"], "argument --precision: invalid choice: 'bf16'"),
    (["--loss-scale", "-8"],
     "argument --loss-scale: '-8' is neither a positive number nor 'dynamic'"),
    (["--loss-scale", "auto"], "argument --loss-scale: 'auto' is neither a positive number"),
])
def test_bad_train_flags_exit_2(argv, message, capsys):
    from mpitrain.cli import main
    with pytest.raises(SystemExit) as exit_:
        main(["train", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_train_flags_reach_the_trainer_options():
    from mpitrain.cli import build_parser
    from mpitrain.options import DEFAULTS
    args = build_parser().parse_args(
        ["train", "--optimizer", "lars", "--lars-eta", "0.002", "--lr-ref-batch", "256",
         "--schedule", "step", "--milestones", "3", "6", "--precision", "fp16",
         "--loss-scale", "1024"])
    options = vars(args)
    assert (options["optimizer"], options["lars_eta"], options["lr_ref_batch"]) == \
        ("lars", 0.002, 256)
    assert (options["schedule"], options["milestones"]) == ("step", [3.0, 6.0])
    assert (options["precision"], options["loss_scale"]) == ("fp16", 1024.0)
    for key in ("optimizer", "lr_ref_batch", "lars_eta", "lars_eps", "schedule", "milestones",
                "precision", "loss_scale"):
        assert key in DEFAULTS
    assert build_parser().parse_args(["train", "--loss-scale", "dynamic"]).loss_scale == "dynamic"


def test_neumann_and_nlcg_are_train_choices_with_their_options():
    from mpitrain.cli import build_parser
    from mpitrain.options import DEFAULTS, Config
    from mpitrain.train import NEUMANN_RESET_EPOCHS, optimizer_options
    for name in ("neumann", "nlcg"):
        assert build_parser().parse_args(["train", "--optimizer", name]).optimizer == name
    cfg = Config(optimizer="neumann", momentum=0.8, warmup_epochs=2.5)
    assert optimizer_options(cfg, 44) == dict(momentum=0.8, weight_decay=DEFAULTS["weight_decay"],
                                              sgd_steps=110, reset_steps=NEUMANN_RESET_EPOCHS * 44)
    assert optimizer_options(Config(optimizer="nlcg"), 44) == dict(
        weight_decay=DEFAULTS["weight_decay"])


def test_overlap_flag_defaults_to_auto():
    from mpitrain.cli import build_parser
    parse = build_parser().parse_args
    assert parse(["train"]).overlap == "auto"
    assert parse(["train", "--overlap"]).overlap is True
    assert parse(["train", "--no-overlap"]).overlap is False
