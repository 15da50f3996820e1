"""The fully connected layer and the flatten in front of it."""
import numpy as np

from mpitrain.arena import Param
from mpitrain.kernels.elementwise import column_sums

from .conv import matmul
from .module import Module, uniform


class Linear(Module):
    """y = x W^T + b,  W: (out, in), x: (N, in).

    Backward: dW = dy^T x,  db = sum_n dy,  dx = dy W.
    Initialised as PyTorch: W and b ~ U(-1/sqrt(in), 1/sqrt(in)). The bias has
    no weight decay and no LARS trust ratio.
    """

    def __init__(self, in_features, out_features, bias=True):
        self.in_features = in_features
        self.out_features = out_features
        bound = 1.0 / np.sqrt(in_features)
        self.weight = Param((out_features, in_features), uniform(bound))
        self.bias = (Param((out_features,), uniform(bound), decay=False, lars=False)
                     if bias else None)

    def forward(self, x, train=True):
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"Linear({self.in_features}, {self.out_features}) expects input "
                             f"(N, {self.in_features}), got shape {x.shape}")
        self.x = x              # (N, in)
        y = matmul(x, self.weight.data.T)
        if self.bias is not None:
            y += self.bias.data
        return y

    def backward(self, dy):
        if self.bias is not None:
            column_sums(dy, self.bias.grad)
            self.bias.grad_ready()
        matmul(dy.T, self.x, out=self.weight.grad, fp16_product=True)    # into the fp32 arena
        self.weight.grad_ready()
        self.x = None
        return matmul(dy, self.weight.data)

    def macs(self, x_shape, y_shape):
        return x_shape[0] * self.in_features * self.out_features


class Flatten(Module):
    """(N, H, W, C) -> (N, H*W*C) in (H, W, C) order; backward reshapes dy back."""

    def forward(self, x, train=True):
        self.shape = x.shape    # (N, H, W, C), a tuple
        return x.reshape(x.shape[0], -1)

    def backward(self, dy):
        return dy.reshape(self.shape)

