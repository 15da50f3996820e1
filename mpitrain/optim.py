"""Optimizers over the whole parameter arena, and learning-rate schedules.

An optimizer never loops over parameters in Python: each step is one call of
a fused kernel (mpitrain.kernels) over the flat arena, which reads the
segment table to know where each parameter lies and whether weight decay and
the trust ratio apply to it (biases and BatchNorm gamma/beta: neither). The
same call unscales the summed gradient and averages it over the ranks
(inv_scale = Reducer.postscale / loss scale), and
writes the updated master weights into the working copy (fp16 under mixed
precision), so the layers see the new weights without a separate cast.

    SGD    v = m v + lr (g + wd w);  w -= v          (Nesterov: w -= m v + lr (g + wd w))
    LARS   the same with lr * local_lr per parameter,
           local_lr = eta ||w|| / (||g|| + wd ||w|| + eps)
    LAMB   Adam's moments with a per-parameter trust ratio ||w|| / ||r||
    Neumann  m = mu m - lr d;  w += mu m - lr d;  d = g + c (w - v), v the weights' moving average
    NLCG   d = beta d - P g;  w += lr d;  P Adam's diagonal preconditioner, beta Fletcher-Reeves

(formulas in full in kernels/update.py, kernels/lamb.py, kernels/neumann.py and
kernels/nlcg.py). The kernel's
implementation follows the arrays: Numba CPU for NumPy arenas, Numba CUDA for
CuPy arenas.

Under --shard-update an optimizer runs over one rank's shard of the arena
(mpitrain.shard.Shard, which offers the arena's buffers and table for its part)
with `sum_partials` adding the per-parameter sums of squares of the trust ratio
over the ranks: the same kernels, the same formulas.

SGD keeps the learning rate inside the velocity (the LARS paper's form, You et al.):
with a constant rate this equals PyTorch's v' = m v' + d; w -= lr v' with
v = lr v'; when the rate changes, the velocity keeps the rate it was built with
(Goyal et al.'s momentum correction, which would rescale it, is not applied).
"""
import math

from mpitrain.kernels.lamb import lamb_update
from mpitrain.kernels.neumann import neumann_update
from mpitrain.kernels.nlcg import BETA_RULES, nlcg_update
from mpitrain.kernels.update import sgd_update


class SGD:
    """SGD with momentum (and Nesterov) over the arena; weight decay where p.decay.

    step(lr, inv_scale) updates arena.master and arena.momentum (the velocity)
    in place from arena.grad * inv_scale, refreshes arena.working, and returns
    the per-parameter local learning rates (all ones for SGD).
    sum_partials: for an arena that is one rank's shard, the function that adds the
    norms' partial sums over the ranks (kernels.update.sgd_update); None otherwise.
    """

    trust = False

    def __init__(self, arena, momentum=0.9, weight_decay=0.0, nesterov=False, impl=None,
                 sum_partials=None):
        if nesterov and momentum <= 0:
            raise ValueError("Nesterov momentum needs momentum > 0")
        self.arena = arena
        self.sum_partials = sum_partials
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.nesterov = bool(nesterov)
        self.impl = impl            # None: chosen by the arena's array type
        self.eta, self.eps = 0.001, 1e-9     # the trust ratio's; unused while trust is off

    def step(self, lr, inv_scale=1.0):
        a = self.arena
        return sgd_update(a.master, a.working, a.grad, a.momentum, a.segments, lr,
                          momentum=self.momentum, weight_decay=self.weight_decay,
                          inv_scale=inv_scale, nesterov=self.nesterov, trust=self.trust,
                          eta=self.eta, eps=self.eps, impl=self.impl,
                          sum_partials=self.sum_partials)

    def state_dict(self):
        """Optimizer state beyond the arena (the velocity lives in arena.momentum): none."""
        return {}

    def load_state_dict(self, state):
        """Nothing to load: the checkpoint puts the velocity into arena.momentum itself."""


class LARS(SGD):
    """Layer-wise adaptive rate scaling (You et al., 2017) on top of SGD with momentum:
    every parameter with p.lars gets local_lr = eta ||w|| / (||g|| + wd ||w|| + eps),
    with ||g|| the norm of the unscaled fp32 gradient (1 where a norm is 0)."""

    trust = True

    def __init__(self, arena, momentum=0.9, weight_decay=0.0, nesterov=False, eta=0.001,
                 eps=1e-9, impl=None, sum_partials=None):
        super().__init__(arena, momentum, weight_decay, nesterov, impl, sum_partials)
        if eta <= 0:
            raise ValueError(f"the LARS coefficient eta must be positive, got {eta}")
        self.eta, self.eps = float(eta), float(eps)


class LAMB:
    """LAMB (You et al., 2019): Adam's bias-corrected moments, weight decay where p.decay,
    and a per-parameter trust ratio ||w|| / ||r|| where p.lars.

    The first moment lives in arena.momentum, the second in a buffer of the same
    size; `t` counts the steps taken (the bias corrections need it)."""

    def __init__(self, arena, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0, impl=None,
                 sum_partials=None):
        for name, b in (("beta1", beta1), ("beta2", beta2)):
            if not 0 <= b < 1:
                raise ValueError(f"LAMB {name} must lie in [0, 1), got {b}")
        self.arena = arena
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)
        self.weight_decay = float(weight_decay)
        self.impl = impl
        self.sum_partials = sum_partials
        self.exp_avg_sq = arena.zeros()      # aligned like the arena's buffers
        self.t = 0

    def step(self, lr, inv_scale=1.0):
        a = self.arena
        self.t += 1
        return lamb_update(a.master, a.working, a.grad, a.momentum, self.exp_avg_sq, a.segments,
                           lr, self.t, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                           weight_decay=self.weight_decay, inv_scale=inv_scale, impl=self.impl,
                           sum_partials=self.sum_partials)

    def state_dict(self):
        """What a checkpoint needs beyond the arena (the first moment is arena.momentum)."""
        return {"t": self.t, "exp_avg_sq": self.exp_avg_sq}

    def load_state_dict(self, state):
        self.t = int(state["t"])
        self.exp_avg_sq[...] = state["exp_avg_sq"]


class Neumann:
    """The Neumann optimizer (Krishnan et al. 2017, Algorithm 2; kernels/neumann.py).

    Steps 1 to sgd_steps are vanilla SGD (the algorithm's burn-in); Neumann step
    t = 1, 2, ... after them uses mu(t) = min(momentum, 1 - 1 / (1 + t)) and resets the
    Neumann iterate at t = 1 and then after K, 2K, 4K, ... more steps (K = reset_steps,
    doubling after every reset, as the paper's Table 1). alpha, beta, gamma: the cubic and
    repulsive regularisers and the moving average (Table 1's; beta per weight, the paper's
    is beta times the number of weights). The iterate m lives in arena.momentum, the
    moving average v in a buffer of the arena's size, starting at the weights the optimizer
    is made with; `t` counts the steps taken, burn-in included."""

    def __init__(self, arena, momentum=0.9, weight_decay=0.0, alpha=1e-7, beta=1e-5, gamma=0.99,
                 sgd_steps=0, reset_steps=1000, impl=None, sum_partials=None):
        if not 0 <= momentum < 1:
            raise ValueError(f"the Neumann momentum mu must lie in [0, 1), got {momentum}")
        if not 0 <= gamma < 1:
            raise ValueError(f"the Neumann moving average gamma must lie in [0, 1), got {gamma}")
        if reset_steps < 1 or sgd_steps < 0:
            raise ValueError(f"Neumann reset_steps must be >= 1 and sgd_steps >= 0, got "
                             f"{reset_steps} and {sgd_steps}")
        self.arena = arena
        self.momentum, self.weight_decay = float(momentum), float(weight_decay)
        self.alpha, self.beta, self.gamma = float(alpha), float(beta), float(gamma)
        self.sgd_steps, self.reset_steps = int(sgd_steps), int(reset_steps)
        self.impl = impl
        self.sum_partials = sum_partials
        self.average = arena.zeros()
        self.average[...] = arena.master        # v_0 = w_0
        self.t = 0

    def phase(self, t):
        """("sgd" | "reset" | "neumann", mu) of step t (1 for the first)."""
        k = t - self.sgd_steps
        if k < 1:
            return "sgd", 0.0
        mu = min(self.momentum, 1.0 - 1.0 / (1.0 + k))
        since = (k - 1) // self.reset_steps + 1     # resets at 1 + K (2^j - 1)
        at_reset = (k - 1) % self.reset_steps == 0 and (since & (since - 1)) == 0
        return ("reset" if at_reset else "neumann"), mu

    def step(self, lr, inv_scale=1.0):
        a = self.arena
        self.t += 1
        phase, mu = self.phase(self.t)
        return neumann_update(a.master, a.working, a.grad, a.momentum, self.average, a.segments,
                              lr, phase, mu=mu, alpha=self.alpha, beta=self.beta,
                              gamma=self.gamma, weight_decay=self.weight_decay,
                              inv_scale=inv_scale, impl=self.impl, sum_partials=self.sum_partials)

    def state_dict(self):
        """What a checkpoint needs beyond the arena (the iterate m is arena.momentum)."""
        return {"t": self.t, "average": self.average}

    def load_state_dict(self, state):
        self.t = int(state["t"])
        self.average[...] = state["average"]


class NLCG:
    """Stochastic preconditioned nonlinear conjugate gradients (Adya et al. 2018;
    kernels/nlcg.py): Adam's diagonal preconditioner, a Fletcher-Reeves ("fr") or
    Polak-Ribiere ("pr") beta over the whole weight vector, kept in [0, 1].

    The direction d lives in arena.momentum; the second moment and the previous
    preconditioned gradient in buffers of the arena's size; `t` counts the steps taken and
    `rho` is the last step's r . P r."""

    def __init__(self, arena, beta2=0.999, eps=1e-8, weight_decay=0.0, beta_rule="fr", impl=None,
                 sum_partials=None):
        if not 0 <= beta2 < 1:
            raise ValueError(f"NLCG beta2 must lie in [0, 1), got {beta2}")
        if beta_rule not in BETA_RULES:
            raise ValueError(f"unknown NLCG beta rule {beta_rule!r}; choose one of "
                             f"{', '.join(BETA_RULES)}")
        self.arena = arena
        self.beta2, self.eps, self.weight_decay = float(beta2), float(eps), float(weight_decay)
        self.beta_rule = beta_rule
        self.impl = impl
        self.sum_partials = sum_partials
        self.exp_avg_sq = arena.zeros()
        self.precond_grad = arena.zeros()
        self.rho = arena.xp.zeros(1)
        self.t = 0

    def step(self, lr, inv_scale=1.0):
        a = self.arena
        self.t += 1
        return nlcg_update(a.master, a.working, a.grad, a.momentum, self.exp_avg_sq,
                           self.precond_grad, self.rho, a.segments, lr, self.t, beta2=self.beta2,
                           eps=self.eps, weight_decay=self.weight_decay, inv_scale=inv_scale,
                           beta_rule=self.beta_rule, impl=self.impl,
                           sum_partials=self.sum_partials)

    def state_dict(self):
        """What a checkpoint needs beyond the arena (the direction is arena.momentum)."""
        return {"t": self.t, "rho": float(self.rho[0]), "exp_avg_sq": self.exp_avg_sq,
                "precond_grad": self.precond_grad}

    def load_state_dict(self, state):
        self.t = int(state["t"])
        self.rho[...] = float(state["rho"])
        self.exp_avg_sq[...] = state["exp_avg_sq"]
        self.precond_grad[...] = state["precond_grad"]


OPTIMIZERS = {"sgd": SGD, "lars": LARS, "lamb": LAMB, "neumann": Neumann, "nlcg": NLCG}


def make_optimizer(name, arena, **hyper):
    """The optimizer `name` (a key of OPTIMIZERS) over `arena`; hyper: its keyword arguments
    (SGD: momentum, weight_decay, nesterov; LARS: also eta, eps; LAMB: beta1, beta2, eps,
    weight_decay; Neumann: momentum, weight_decay, alpha, beta, gamma, sgd_steps,
    reset_steps; NLCG: beta2, eps, weight_decay, beta_rule; any: impl, sum_partials)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](arena, **hyper)


# ----- learning rate -----
SCHEDULES = ("cosine", "poly", "step", "constant")


def scaled_lr(base_lr, global_batch, ref_batch=None):
    """The linear scaling rule (Goyal et al.): base_lr * global_batch / ref_batch;
    base_lr itself when ref_batch is None."""
    return base_lr if ref_batch is None else base_lr * global_batch / ref_batch


def learning_rate(epoch, base_lr, total_epochs, warmup_epochs=0.0, kind="cosine",
                  milestones=(), gamma=0.1, power=2.0):
    """The learning rate at a fractional epoch.

    Callers pass the epoch reached at the end of the step, (step + 1) /
    steps_per_epoch, so that the first warm-up step has a non-zero rate.
        warm-up  base_lr * epoch / warmup_epochs while epoch < warmup_epochs
                 (linear, Goyal et al.)
    then, with t = progress through the epochs after warm-up (0 to 1),
        cosine   base_lr * (1 + cos(pi * t)) / 2
        poly     base_lr * (1 - t) ** power          (power 2: the large-batch LARS recipe)
        step     base_lr * gamma ** (number of milestones passed; milestones in epochs)
        constant base_lr
    """
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
    if epoch < warmup_epochs:
        return base_lr * epoch / warmup_epochs
    t = min((epoch - warmup_epochs) / max(total_epochs - warmup_epochs, 1e-12), 1.0)
    if kind == "cosine":
        return base_lr * 0.5 * (1.0 + math.cos(math.pi * t))
    if kind == "poly":
        return base_lr * (1.0 - t) ** power
    if kind == "step":
        return base_lr * gamma ** sum(epoch >= m for m in milestones)
    return base_lr
