"""The networks: sizes, arena layout, gradient order, `inspect`, and PyTorch twins.

The PyTorch comparisons run in training mode (batch statistics) with identical
weights; dropout is set to p = 0 so that both sides compute the same function.
"""
import numpy as np
import pytest

from mpitrain.tools.inspect import layer_table, report
from mpitrain.nets import MODELS, build_model
from mpitrain.nets.losses import softmax_cross_entropy
from mpitrain.nets.resnet import Bottleneck, ResNet

# torchvision's counts at 1000 classes (AlexNet-BN and resnet_small documented in their modules)
COUNTS = {"alexnet": 61_100_840, "alexnet_bn": 61_101_992, "resnet18": 11_689_512,
          "resnet34": 21_797_672, "resnet50": 25_557_032, "resnet101": 44_549_160}


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_parameter_count(name):
    # counted from the declared shapes: nothing is allocated
    assert MODELS[name](num_classes=1000).num_params() == COUNTS[name]


def test_small_resnet_count_and_output():
    model = build_model("resnet_small", num_classes=10)
    assert model.num_params() == 78_042
    assert [n for n, _ in model.named_params()][:3] == ["conv1.weight", "bn1.weight", "bn1.bias"]
    x = np.random.default_rng(0).standard_normal((3, 32, 32, 3)).astype(np.float32)
    assert model.forward(x, train=True).shape == (3, 10)


def _tiny_bottleneck_resnet(**kw):
    """Bottleneck blocks with and without a downsample, cheap to bind."""
    return ResNet(Bottleneck, (2, 2), num_classes=5, widths=(4, 8), small_stem=True, **kw)


def test_arena_is_reverse_registration_order_with_flags():
    model = build_model("resnet18", num_classes=10)
    named = list(model.named_params())
    assert [p.name for p in model.arena.params] == [n for n, _ in reversed(named)]
    assert model.arena.params[0].name == "fc.bias"
    assert model.arena.params[-1].name == "conv1.weight"
    seg = model.arena.segments
    assert np.all(seg["offset"][1:] >= seg["offset"][:-1] + seg["size"][:-1])   # in order, apart
    for (name, p), (offset, size, decay, lars) in zip(reversed(named), seg):
        assert (offset, size) == (p.offset, p.size)
        is_weight_matrix = name.endswith("weight") and len(p.shape) in (2, 4)   # conv or linear
        assert decay == lars == is_weight_matrix, name
    flags = {n: (p.decay, p.lars) for n, p in named}
    assert flags["layer2.0.downsample.0.weight"] == (True, True)
    assert flags["layer2.0.downsample.1.weight"] == (False, False)
    assert flags["bn1.bias"] == flags["fc.bias"] == (False, False)


@pytest.mark.parametrize("classes", [10, 1000])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_parameter_starts_on_a_256_byte_boundary(name, classes):
    """In every buffer of the arena (master, fp16 working copy, gradient, momentum, LAMB's
    second moment), whatever the number of classes; the padding between parameters is zero
    and takes no part in the segment table."""
    from mpitrain.optim import LAMB
    model = build_model(name, num_classes=classes, working_dtype=np.float16)
    arena = model.arena
    second_moment = LAMB(arena).exp_avg_sq
    views = {"master": "master", "working": "data", "grad": "grad", "momentum": "momentum"}
    for p in arena.params:
        for buffer, attr in views.items():
            assert getattr(p, attr).ctypes.data % 256 == 0, (name, p.name, buffer)
        assert second_moment[p.offset:].ctypes.data % 256 == 0, (name, p.name, "LAMB v")
    used = np.zeros(arena.size, bool)
    for offset, size in arena.segments[["offset", "size"]]:
        used[offset:offset + size] = True
    assert used.sum() == model.num_params() and not arena.master[~used].any()
    for b in model.buffer_arena.buffers:
        assert b.data.ctypes.data % 256 == 0, (name, b.name)


def test_alexnet_dropout_masks_come_from_the_seed_and_the_rank():
    """Every rank starts from the same weights but draws its own dropout masks (else the
    global batch would hold only batch / ranks distinct masks); the same (seed, rank)
    draws the same masks again."""
    masks, weights = {}, {}
    for rank in (0, 1, 0):
        model = build_model("alexnet", num_classes=10, seed=5, rank=rank)
        weights.setdefault(rank, model.arena.master[:1000].copy())
        drop = model.classifier.layers[0]
        drop.forward(np.ones((2, 9216), np.float32))
        masks.setdefault(rank, []).append(drop.mask)
    np.testing.assert_array_equal(weights[0], weights[1])
    np.testing.assert_array_equal(masks[0][0], masks[0][1])
    assert not np.array_equal(masks[0][0], masks[1][0])


def test_alexnet_names_and_flags():
    model = MODELS["alexnet"](num_classes=1000)
    names = [n for n, _ in model.named_params()]
    assert names[:2] == ["features.0.weight", "features.0.bias"]
    assert names[-2:] == ["classifier.6.weight", "classifier.6.bias"]
    assert dict(model.named_params())["features.3.weight"].shape == (192, 5, 5, 64)   # OHWI
    bn = MODELS["alexnet_bn"](num_classes=1000)
    convs = [n for n, p in bn.named_params() if len(p.shape) == 4]
    assert convs == [f"features.{i}.weight" for i in (0, 4, 8, 11, 14)]
    assert all(not n.endswith("bias") for n in convs)
    assert "features.1.running_var" in dict(bn.named_buffers())


@pytest.mark.parametrize("zero", [False, True])
def test_zero_init_residual(zero):
    for model, last_bn in (
            (build_model("resnet18", num_classes=10, zero_init_residual=zero), "bn2"),
            (_tiny_bottleneck_resnet(zero_init_residual=zero).bind(), "bn3")):
        gammas = {n: p.master for n, p in model.named_params()
                  if n.endswith("weight") and len(p.shape) == 1}
        last = [n for n in gammas if n.endswith(f"{last_bn}.weight") and n.startswith("layer")]
        assert len(last) == sum(model.layers)
        for name, g in gammas.items():
            expected = 0.0 if (zero and name in last) else 1.0
            assert np.all(g == expected), name


def test_zero_init_residual_rejected_for_alexnet():
    with pytest.raises(ValueError, match="ResNets"):
        build_model("alexnet", zero_init_residual=True)


def _record_backward_order(model):
    """The names of the parameters, in the order backward says their gradients are final
    (the arena's on_grad_ready listener, which the gradient Reducer uses)."""
    written = []
    model.arena.on_grad_ready = lambda p: written.append(p.name)
    return written


@pytest.mark.parametrize("make", [lambda: _tiny_bottleneck_resnet().bind(),
                                  lambda: build_model("resnet_small", num_classes=10)],
                         ids=["bottleneck", "basicblock"])
def test_backward_writes_gradients_in_arena_order(make):
    model = make()
    written = _record_backward_order(model)
    for p in model.arena.params:
        p.grad[...] = np.nan
    x = np.random.default_rng(0).standard_normal((2, 16, 16, 3)).astype(np.float32)
    y = model.forward(x, train=True)
    model.backward(np.ones_like(y))
    assert written == [p.name for p in model.arena.params]
    for p in model.arena.params:                        # every gradient was written
        assert np.all(np.isfinite(p.grad)), p.name
    # within a block with a shortcut: the downsample's gradients come before conv1's
    assert written.index("layer2.0.downsample.0.weight") < written.index("layer2.0.conv1.weight")


@pytest.mark.parametrize("name,size", [("resnet_small", 16), ("resnet18", 32), ("alexnet_bn", 64)])
def test_nothing_holds_an_activation_after_backward(name, size):
    """Each layer caches in forward what its backward needs and lets go of it in backward,
    so that between steps the activations of the last one are not kept alive: after
    backward, every array a layer holds (per-channel statistics, constant pooling bins)
    has the same shape at batch 2 and batch 3."""
    model = build_model(name, num_classes=10)
    held = []
    for batch in (2, 3):
        x = np.random.default_rng(0).standard_normal((batch, size, size, 3)).astype(np.float32)
        y = model.forward(x, train=True)
        model.backward(np.ones_like(y))
        held.append({f"{prefix}{attr}": v.shape for prefix, m in model.named_modules()
                     for attr, v in vars(m).items() if isinstance(v, np.ndarray)})
    assert held[0] == held[1]


def test_inspect_resnet50():
    rows, model = layer_table("resnet50", image_size=224)
    assert sum(r[3] for r in rows) == model.num_params() == 25_557_032
    macs = sum(r[4] for r in rows)
    assert abs(macs - 4.1e9) / 4.1e9 < 0.02
    by_name = {r[0]: r for r in rows}
    assert by_name["conv1"][2] == (112, 112, 64)
    assert by_name["layer4.2.conv3"][2] == (7, 7, 2048)
    assert by_name["fc"][2] == (1000,) and by_name["fc"][4] == 2048 * 1000
    text = report("resnet_small", image_size=32, num_classes=10)
    assert "layer3.0.downsample.0" in text and "78,042" in text


def test_bad_input_names_what_is_expected():
    model = build_model("resnet_small", num_classes=10)
    with pytest.raises(ValueError, match=r"\(N, H, W, 3\)"):
        model.forward(np.zeros((2, 3, 32, 32), np.float32))          # NCHW
    with pytest.raises(TypeError, match="float32"):
        model.forward(np.zeros((2, 32, 32, 3), np.float64))
    with pytest.raises(ValueError, match="resnet50") as err:
        build_model("resnet51")
    assert "alexnet_bn" in str(err.value) and "resnet_small" in str(err.value)
    with pytest.raises(ValueError, match="num_classes"):
        build_model("resnet_small", num_classes=1)


@pytest.mark.parametrize("name, size", [("resnet_small", 32), ("alexnet_bn", 64), ("plain", 32)])
def test_a_backward_without_its_training_forward_is_refused_by_name(name, size):
    """After an eval forward, or a second time after one training forward, backward has no
    cache: it failed inside a Numba kernel's typing (the fast layers) or took the eval
    forward's values (the plain layers)."""
    from mpitrain.nets.plain import PlainNetwork
    model = build_model("resnet_small" if name == "plain" else name, num_classes=10)
    net = PlainNetwork(model) if name == "plain" else model
    x = np.zeros((2, size, size, 3), np.float32)
    for forward in (lambda: net.forward(x, train=False),
                    lambda: net.backward(np.ones_like(net.forward(x, train=True)))):
        forward()
        with pytest.raises(RuntimeError, match=r"needs a forward\(x, train=True\) just "
                                               r"before it .* call forward\(x, train=True\)"):
            net.backward(np.ones((2, 10), np.float32))
    model.arena.grad[...] = np.nan
    net.forward(x, train=True)
    net.backward(np.ones((2, 10), np.float32))       # each parameter's gradient written
    assert all(np.isfinite(p.grad).all() for _, p in model.named_params())


# ----- PyTorch twins -----
# (batch, image size). ResNets at 32x32 reach 1x1 in layer4, so batch 4 gives BN
# four values per channel there; AlexNet at 64x64 ends its features at 1x1 and the
# adaptive pool repeats that to 6x6.
FLOAT64 = {"resnet18": (4, 32), "resnet50": (4, 32), "alexnet": (2, 64), "alexnet_bn": (2, 64),
           "resnet_small": (2, 32)}
# In float32 a randomly initialised ResNet-50 on a tiny batch is ill-conditioned:
# with batch 4 at 32x32 torch's own float32 gradient is 8% away from float64's.
# Batch 8 brings that to about 2%, ours and torch's alike.
FLOAT32 = {"resnet18": (4, 32), "resnet50": (8, 32), "alexnet": (2, 64)}


def _train_step_both(name, n, size, dtype, tdtype):
    import torch

    from mpitrain.tools.bench import reference_torch as rt
    kw = {"dropout": 0.0} if name.startswith("alexnet") else {}
    model = build_model(name, num_classes=10, dtype=dtype, seed=1, **kw)
    tmodel = rt.to_torch(model, tdtype).train()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, size, size, 3)).astype(dtype)
    labels = rng.integers(0, 10, n)

    model.arena.grad[...] = np.nan
    logits = model.forward(x, train=True)
    _, dlogits = softmax_cross_entropy(logits, labels)
    model.backward(dlogits)

    tlogits = tmodel(rt.input_to_torch(x, tdtype))
    tlogits.backward(torch.from_numpy(dlogits))
    return model, tmodel, logits, tlogits.detach().numpy(), rt.grads_to_ours(model, tmodel)


def _rel(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(FLOAT64))
def test_matches_torch_float64(name):
    import torch

    from mpitrain.tools.bench import reference_torch as rt
    model, tmodel, logits, tlogits, tgrads = _train_step_both(name, *FLOAT64[name], np.float64,
                                                              torch.float64)
    assert _rel(logits, tlogits) < 1e-6
    for pname, p in model.named_params():
        assert _rel(p.grad, tgrads[pname]) < 1e-6, pname
    for bname, b in rt.buffers_to_ours(tmodel).items():
        assert _rel(dict(model.named_buffers())[bname].data, b) < 1e-6, bname


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(FLOAT32))
def test_matches_torch_float32(name):
    import torch
    model, _, logits, tlogits, tgrads = _train_step_both(name, *FLOAT32[name], np.float32,
                                                         torch.float32)
    assert logits.dtype == np.float32
    assert _rel(logits, tlogits) < 1e-3
    ours = np.concatenate([p.grad.ravel() for _, p in model.named_params()]).astype(np.float64)
    theirs = np.concatenate([tgrads[n].ravel() for n, _ in model.named_params()]).astype(np.float64)
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 3e-2


def test_mixed_precision_small_resnet_follows_float32():
    """fp16 working weights and activations, fp32 master weights and gradients."""
    rng = np.random.default_rng(0)
    x, labels = rng.standard_normal((8, 32, 32, 3)), rng.integers(0, 10, 8)
    fp32 = build_model("resnet_small", num_classes=10)
    fp16 = build_model("resnet_small", num_classes=10, working_dtype=np.float16)
    grads = []
    for model, dtype in ((fp32, np.float32), (fp16, np.float16)):
        logits = model.forward(x.astype(dtype), train=True)
        assert logits.dtype == dtype
        model.backward(softmax_cross_entropy(logits, labels)[1])
        assert model.arena.grad.dtype == np.float32
        grads.append((logits.astype(np.float32), model.arena.grad))
    (l32, g32), (l16, g16) = grads
    assert np.all(np.isfinite(g16))
    assert _rel(l16, l32) < 1e-2
    assert np.linalg.norm(g16 - g32) / np.linalg.norm(g32) < 0.1
