"""Optimizers over the whole parameter arena, and learning-rate schedules.

The optimizer never loops over parameters: it updates the flat master buffer
in a few whole-array operations. Which elements get weight decay is data, a
per-element vector built once from the arena's segment table, so biases and
BatchNorm gamma/beta (decay=False) are skipped without a branch.
"""
import math

import numpy as np

from . import backend


class SGD:
    """SGD with momentum, PyTorch's formulas (dampening 0):

        d = g + wd * w                  (wd is 0 where the segment's decay flag is off)
        v = m * v + d
        w = w - lr * v                  (plain)
        w = w - lr * (d + m * v)        (Nesterov)

    on arena.master, arena.grad and arena.momentum; the working copy is
    refreshed afterwards (arena.sync_working()). The momentum buffer starts at
    zero, so the first step gives v = d, as PyTorch's does.
    """

    def __init__(self, arena, momentum=0.9, weight_decay=0.0, nesterov=False):
        if nesterov and momentum <= 0:
            raise ValueError("Nesterov momentum needs momentum > 0")
        self.arena = arena
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.nesterov = nesterov
        xp = backend.array_module(arena.master)
        seg = arena.segments
        decay = np.repeat(np.where(seg["decay"], self.weight_decay, 0.0), seg["size"])
        self.decay = xp.asarray(decay.astype(arena.dtype))     # (arena.size,)
        self.scratch = xp.empty_like(arena.master)              # d, reused every step

    def step(self, lr):
        a, d = self.arena, self.scratch      # whole-arena passes, no temporaries
        xp = backend.array_module(a.master)
        xp.multiply(self.decay, a.master, out=d)
        d += a.grad
        a.momentum *= self.momentum
        a.momentum += d
        if self.nesterov:                    # w -= lr * d, then w -= lr * m * v
            d *= lr
            a.master -= d
            xp.multiply(a.momentum, lr * self.momentum, out=d)
        else:
            xp.multiply(a.momentum, lr, out=d)
        a.master -= d
        a.sync_working()


def learning_rate(epoch, base_lr, total_epochs, warmup_epochs=0.0, kind="cosine",
                  milestones=(), gamma=0.1):
    """The learning rate at a fractional epoch.

    Callers pass the epoch reached at the end of the step, (step + 1) /
    steps_per_epoch, so that the first warm-up step has a non-zero rate.
        warm-up  base_lr * epoch / warmup_epochs while epoch < warmup_epochs
                 (linear, Goyal et al.)
    then
        cosine   base_lr * (1 + cos(pi * t)) / 2, t = progress through the epochs after warm-up
        step     base_lr * gamma ** (number of milestones passed)
        constant base_lr
    """
    if epoch < warmup_epochs:
        return base_lr * epoch / warmup_epochs
    if kind == "cosine":
        t = (epoch - warmup_epochs) / max(total_epochs - warmup_epochs, 1e-12)
        return base_lr * 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))
    if kind == "step":
        return base_lr * gamma ** sum(epoch >= m for m in milestones)
    if kind == "constant":
        return base_lr
    raise ValueError(f"unknown schedule {kind!r}; choose cosine, step or constant")
