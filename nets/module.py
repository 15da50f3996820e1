"""Module: the shape every layer and network shares.

A module has `forward(x, train)` -> y and `backward(dy)` -> dx. It caches in
forward only what backward needs, and writes weight gradients into its
parameters' arena views (`p.grad[...] = ...`, overwriting, never accumulating),
calling `p.grad_ready()` as soon as a gradient is final, so that its bucket can
be summed across ranks while backward goes on.

Attributes that are `Module`, `Param` or `Buffer` register themselves in
assignment order, which gives torchvision's state_dict names
(`layer1.0.conv1.weight`). `Module.bind()` on the top-level network lays every
parameter into one arena (mpitrain.arena) and initialises it from the seed.
"""
import numpy as np

from mpitrain.arena import Arena, Buffer, BufferArena, Param
from mpitrain.backend import array_module


def run_layer(layer, phase, *args, **options):
    """A container's run_layer by default: layer.forward(*args, **options), or backward."""
    return getattr(layer, phase)(*args, **options)


class Module:
    # the hook through which a container runs each of its layers:
    # `y = self.run_layer(layer, "forward", x, train)`. A tool that watches layers sets its
    # own on the containers it watches: mpitrain.metrics.Timeline.trace_layers on a network,
    # to draw its top-level layers in the trace; bench layers' profile and
    # mpitrain.checks.leaf_shapes (inspect, train's checks) on every module, to time or
    # measure each layer.
    run_layer = staticmethod(run_layer)
    backward_ready = False          # a network's: check_backward

    def __setattr__(self, name, value):
        if isinstance(value, (Module, Param, Buffer)):
            self.__dict__.setdefault("_members", {})[name] = value
        object.__setattr__(self, name, value)

    def _items(self):
        return self.__dict__.get("_members", {}).items()

    # ----- traversal, in registration (forward) order -----
    def named_modules(self, prefix=""):
        yield prefix, self
        for name, m in self._items():
            if isinstance(m, Module):
                yield from m.named_modules(f"{prefix}{name}.")

    def named_params(self, prefix=""):
        for name, m in self._items():
            if isinstance(m, Param):
                yield prefix + name, m
            elif isinstance(m, Module):
                yield from m.named_params(f"{prefix}{name}.")

    def named_buffers(self, prefix=""):
        for name, m in self._items():
            if isinstance(m, Buffer):
                yield prefix + name, m
            elif isinstance(m, Module):
                yield from m.named_buffers(f"{prefix}{name}.")

    def children(self):
        return [m for _, m in self._items() if isinstance(m, Module)]

    def num_params(self):
        return sum(p.size for _, p in self.named_params())

    # ----- the layer contract -----
    def forward(self, x, train=True):
        raise NotImplementedError

    def backward(self, dy):
        raise NotImplementedError

    def macs(self, x_shape, y_shape):
        """Multiply-adds of one forward pass (for `inspect`); zero unless a layer says otherwise."""
        return 0

    # ----- turning declared parameters into arena views -----
    def bind(self, dtype=np.float32, working_dtype=None, seed=0, xp=None):
        """Allocate the arena for every parameter below this module and initialise it.

        Initialisation draws from one generator seeded by `seed`, in forward
        order, so the same seed gives the same weights on every rank. The arena
        itself is laid out in reverse (backward) order.
        """
        params = list(self.named_params())
        for name, p in params:
            p.name = name
        self.arena = Arena([p for _, p in reversed(params)], dtype, working_dtype, xp)
        rng = np.random.default_rng(seed)
        for _, p in params:
            p.master[...] = array_module(p.master).asarray(p.init(rng, p.shape))
        self.arena.sync_working()
        buffers = list(self.named_buffers())
        for name, b in buffers:
            b.name = name
        # BatchNorm statistics stay fp32 (float64 in checks) whatever the working dtype
        self.buffer_arena = BufferArena([b for _, b in buffers], dtype, xp)
        self.dtype = np.dtype(working_dtype or dtype)
        return self


class Sequential(Module):
    """Children named "0", "1", ... (torchvision's nn.Sequential names), run in order."""

    def __init__(self, *layers):
        for i, layer in enumerate(layers):
            setattr(self, str(i), layer)
        self.layers = list(layers)

    def forward(self, x, train=True):
        for layer in self.layers:
            x = self.run_layer(layer, "forward", x, train)
        return x

    def backward(self, dy):
        for layer in reversed(self.layers):
            dy = self.run_layer(layer, "backward", dy)
        return dy


# ----- initialisers: callables (rng, shape) -> array, stored on each Param -----
def he_normal(fan):
    """N(0, 2/fan): He et al. 2015 for layers followed by ReLU."""
    std = np.sqrt(2.0 / fan)
    return lambda rng, shape: rng.normal(0.0, std, shape)


def uniform(bound):
    """U(-bound, bound): PyTorch's default for linear layers uses bound = 1/sqrt(fan_in)."""
    return lambda rng, shape: rng.uniform(-bound, bound, shape)


def constant(value):
    return lambda rng, shape: np.full(shape, value)


def check_backward(net):
    """Refuse a network's backward with no forward(x, train=True) of its own just before
    it: an eval forward caches nothing, and a backward consumes its forward's cache (the
    layers would fail deep inside a kernel). The network's forward sets
    `net.backward_ready = train`."""
    if not net.backward_ready:
        raise RuntimeError(f"{type(net).__name__}.backward needs a forward(x, train=True) "
                           f"just before it (the last forward was in eval mode, or its "
                           f"backward has run): call forward(x, train=True) first")
    net.backward_ready = False


def check_input(x, channels, dtype):
    """Reject what a network cannot take, naming what it expects."""
    if getattr(x, "ndim", None) != 4 or x.shape[3] != channels:
        raise ValueError(f"expected an NHWC batch of shape (N, H, W, {channels}), "
                         f"got shape {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype != dtype:
        raise TypeError(f"expected input of dtype {np.dtype(dtype).name} "
                        f"(the model's working dtype), "
                        f"got {x.dtype}; convert with x.astype(np.{np.dtype(dtype).name})")
