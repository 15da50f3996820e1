"""Central-difference gradient checks in float64 (Chainer's gradient_check).

The layer is reduced to a scalar L = sum(y * r) with a fixed random r, so
backward(r) must return dL/dx and fill dL/dp for every parameter p; each is
compared with (L(v + eps) - L(v - eps)) / (2 eps), element by element.
"""
import numpy as np


def numerical_grad(f, v, eps=1e-6):
    """dL/dv by central differences; f() reads v, which is perturbed in place."""
    g = np.zeros_like(v)
    flat, gflat = v.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        fp = f()
        flat[i] = old - eps
        fm = f()
        flat[i] = old
        gflat[i] = (fp - fm) / (2 * eps)
    return g


def check_layer(layer, x, train=True, rtol=1e-6, atol=1e-8, seed=0, reseed=None):
    """Compare layer.backward with numerical gradients for x and every parameter.

    The layer must be bound in float64 (`layer.bind(dtype=np.float64)`).
    reseed: a callable run before every forward, for layers that draw random
    numbers (dropout), so each evaluation sees the same mask.
    """
    rng = np.random.default_rng(seed)
    x = np.array(x, dtype=np.float64)

    def run():
        if reseed:
            reseed()
        return layer.forward(x, train)

    y = run()
    r = rng.standard_normal(y.shape)
    dx = layer.backward(r.copy())
    analytic = {name: p.grad.copy() for name, p in layer.named_params()}

    loss = lambda: float(np.sum(run() * r))
    assert_close(dx, numerical_grad(loss, x), rtol, atol, "dx")
    for name, p in layer.named_params():
        assert_close(analytic[name], numerical_grad(loss, p.master), rtol, atol, name)
    return y


def assert_close(actual, expected, rtol, atol, what):
    """Error relative to the largest magnitude of the expected tensor."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = max(np.abs(expected).max(), atol)
    err = np.abs(actual - expected).max() / scale
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:.3g}"
