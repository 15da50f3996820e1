"""Loss scaling for fp16 training, and the overflow flag every rank agrees on.

fp16 has 5 exponent bits: gradients smaller than 2^-24 round to zero. The
trainer multiplies the loss gradient (dlogits) by `scale` before backward, so
every gradient in the chain is `scale` times larger and small ones survive;
the update kernel multiplies by inv_scale = 1 / (scale * ranks) as it reads
the summed fp32 gradient, which undoes the scale and averages over the ranks
(1 / scale alone when the ranks' gradients were divided before the sum, as
with fp16 on the wire: Reducer.postscale).

Too large a scale overflows: some gradient becomes inf or NaN. The step is
then skipped on every rank, and a dynamic scaler halves the scale. The ranks
need no vote on it: the trainer checks the summed gradient, which holds the
same bits on every rank (an inf or NaN on any rank makes the sum non-finite
everywhere), so every replica sees the same flag:

    dynamic   start at init_scale (2^16)
              overflow   -> scale = max(scale / 2, min_scale), skip the step,
                            clean-step count back to 0
              clean step -> count += 1; after growth_interval clean steps in a
                            row, scale = min(2 scale, max_scale), count = 0
    static    scale never changes; an overflow still skips the step

After `patience` overflows in a row at the floor the scaler raises LossScaleError
rather than skip steps for ever. For a dynamic scale (or a static 1) that means the
gradients are not finite whatever the scale: training has diverged. A static scale
above 1 may instead be too large for every step's gradients, and the error says so.
"""
import numbers


class LossScaleError(RuntimeError):
    """The gradients keep overflowing at the smallest loss scale: training has diverged
    (`diverged`), or a static scale above 1 is too large for them."""

    def __init__(self, message, diverged):
        super().__init__(message)
        self.diverged = diverged


class LossScaler:
    """Static (`LossScaler(1024)`) or dynamic (`LossScaler("dynamic")`) loss scaling.

    check: run the overflow check each step (default: for a dynamic scaler, or a static
    scale other than 1; the trainer asks for it under fp16 whatever the scale).
    Attributes: scale (the current multiplier), dynamic, check, skipped (steps skipped).
    """

    def __init__(self, scale=1.0, init_scale=2.0 ** 16, growth_interval=2000, min_scale=1.0,
                 max_scale=2.0 ** 24, patience=10, check=None):
        self.dynamic = scale == "dynamic"
        if not self.dynamic and not (isinstance(scale, numbers.Real) and scale > 0):
            raise ValueError(f"loss scale must be a positive number or 'dynamic', got {scale!r}")
        if growth_interval < 1 or patience < 1:
            raise ValueError("growth_interval and patience must be at least 1")
        if not 0 < min_scale <= init_scale <= max_scale:
            raise ValueError(f"need 0 < min_scale <= init_scale <= max_scale, got "
                             f"{min_scale}, {init_scale}, {max_scale}")
        self.scale = float(init_scale if self.dynamic else scale)
        self.min_scale = float(min_scale if self.dynamic else self.scale)
        self.max_scale = float(max_scale)
        self.growth_interval = int(growth_interval)
        self.patience = int(patience)
        self.check = (self.dynamic or self.scale != 1.0) if check is None else bool(check)
        self.clean_steps = 0        # clean steps since the last overflow or growth
        self.stuck = 0              # overflows in a row at the floor
        self.skipped = 0            # steps skipped in all

    def __repr__(self):
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={self.scale:g}, skipped={self.skipped})"

    def update(self, overflow):
        """Record one step's outcome (overflow: every rank's combined flag) and move the
        scale; returns True when the step is to be applied, False when it is skipped."""
        if not overflow:
            self.stuck = 0
            if self.dynamic:
                self.clean_steps += 1
                if self.clean_steps == self.growth_interval:
                    self.scale = min(2.0 * self.scale, self.max_scale)
                    self.clean_steps = 0
            return True
        self.skipped += 1
        self.clean_steps = 0
        if self.scale <= self.min_scale:
            self.stuck += 1
            if self.stuck >= self.patience:
                raise LossScaleError(self._stuck_message(), self._diverged())
        if self.dynamic:
            self.scale = max(0.5 * self.scale, self.min_scale)
        return False

    def _diverged(self):
        """Overflows at the floor are the gradients' own (a dynamic scale's floor, or a
        static scale of 1 or less), not a static scale's above 1, which may be too large."""
        return self.dynamic or self.scale <= 1.0

    def _stuck_message(self):
        said = f"the gradients overflowed (inf or NaN) in {self.stuck} steps in a row at "
        if self._diverged():
            return (said + f"the smallest loss scale {self.scale:g}: training has diverged; "
                    f"lower the learning rate (under --precision fp16, a run in fp32 shows "
                    f"where it breaks)")
        return (said + f"the static loss scale {self.scale:g}: the scale may be too large for "
                f"these gradients; lower --loss-scale, or give --loss-scale dynamic, which "
                f"finds one (if the overflows go on at 1, training has diverged)")

    def state_dict(self):
        """Everything needed to resume the scaler exactly (plain Python numbers)."""
        return {"scale": self.scale, "dynamic": self.dynamic, "clean_steps": self.clean_steps,
                "stuck": self.stuck, "skipped": self.skipped}

    def load_state_dict(self, state):
        if bool(state["dynamic"]) != self.dynamic:
            raise ValueError(f"the saved loss scaler is "
                             f"{'dynamic' if state['dynamic'] else 'static'}, "
                             f"this one is {'dynamic' if self.dynamic else 'static'}")
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.stuck = int(state["stuck"])
        self.skipped = int(state["skipped"])


# --precision: (the dtype of master weights, gradients and optimizer state; the dtype
# the layers compute in). fp64 is for checking a run against a float64 reference.
DTYPES = {"fp32": ("float32", "float32"),
          "fp16": ("float32", "float16"),
          "fp64": ("float64", "float64")}


def make_scaler(loss_scale, precision, comm_dtype="fp32"):
    """The trainer's scaler: loss_scale is a number, 'dynamic', or None for the default:
    'dynamic' where fp16 carries gradients (fp16 precision, or fp16 on the wire), else 1.
    Gradients sent in fp16 are each rank's share (divided by the ranks) of the step's: at
    scale 1 the small ones fall into fp16's subnormals and lose their bits, and a large
    one overflows unseen. So fp16 in either place always checks for overflow; fp32 only
    when the scale is dynamic or not 1."""
    if precision not in DTYPES:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(DTYPES)}")
    half = "fp16" in (precision, comm_dtype)
    if loss_scale is None:
        loss_scale = "dynamic" if half else 1.0
    return LossScaler(loss_scale, check=True if half else None)
