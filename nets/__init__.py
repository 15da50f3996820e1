"""Layers and networks (NHWC). `build_model(name, ...)` is the entry point.

    from mpitrain.nets import build_model
    model = build_model("resnet50", num_classes=1000, seed=0)
    logits = model.forward(x, train=True)      # x: (N, H, W, 3) in the model's working dtype
    model.backward(dlogits)                    # writes every p.grad into the arena (the
                                               # images' own gradient is not computed)
"""
import numpy as np

from . import alexnet as _alexnet
from . import resnet as _resnet

MODELS = {
    "alexnet": _alexnet.alexnet,
    "alexnet_bn": _alexnet.alexnet_bn,
    "resnet18": _resnet.resnet18,
    "resnet34": _resnet.resnet34,
    "resnet50": _resnet.resnet50,
    "resnet101": _resnet.resnet101,
    "resnet152": _resnet.resnet152,
    "resnet_small": _resnet.resnet_small,
}


def build_model(name, num_classes=1000, seed=0, dtype=np.float32, working_dtype=None,
                zero_init_residual=False, rank=0, **kw):
    """The network `name`, its parameters bound into an arena and initialised from `seed`.

    dtype: master weights and gradients (np.float32, or np.float64 for verification).
    working_dtype: what the layers compute in (np.float16 under mixed precision; default dtype).
    zero_init_residual: ResNets only; the last BN gamma of every block starts at zero.
    kw: passed to the builder (e.g. dropout=0.0 for AlexNet, layers=(2, 2, 2) for resnet_small).
    seed and rank seed AlexNet's dropout masks: the weights are the same on every rank
    (they depend on the seed only), the masks differ from rank to rank.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) \
            or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    if name.startswith("resnet"):
        kw["zero_init_residual"] = zero_init_residual
    elif zero_init_residual:
        raise ValueError(f"zero_init_residual applies to ResNets, not to {name!r}")
    else:
        kw.update(seed=seed, rank=rank)
    model = MODELS[name](num_classes=int(num_classes), **kw)
    return model.bind(dtype, working_dtype, seed)


def describe_parameters(model):
    """'N parameters (K classes)': the model's trainable parameters (BatchNorm's running
    statistics and the arena's padding are not parameters) and its number of classes, the
    last layer's outputs, on which the count depends. Every command that prints a parameter
    count prints it in this form."""
    return f"{model.num_params():,} parameters ({model.num_classes} classes)"


__all__ = ["MODELS", "build_model", "describe_parameters"]
