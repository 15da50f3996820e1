"""Softmax cross-entropy (the training loss) and top-k accuracy counts."""
import numpy as np

from mpitrain.backend import array_module
from mpitrain.kernels import cast


def softmax_cross_entropy(logits, labels, label_smoothing=0.0, scale=1.0):
    """Mean cross-entropy of softmax(logits) against (smoothed) one-hot labels.

    With K classes, batch N and eps = label_smoothing, the target of row n is
        t_n = (1 - eps) * onehot(labels_n) + eps / K      (PyTorch's label_smoothing)
    and with log p = log_softmax(logits) = z - max(z) - log sum exp(z - max(z)),
        loss     = -(1/N) sum_n sum_k t_nk log p_nk
        dlogits  = (softmax(logits) - t) / N.
    Computed in fp32 (float64 for float64 logits) whatever the logits' dtype.
    scale: the loss scale of mixed precision; dlogits is scale * (softmax - t) / N, scaled
    before the cast to the logits' dtype so that fp16 keeps its small values (the loss
    itself is not scaled). A number, or a 0-d array on the logits' device (what a CUDA
    graph reads afresh at each replay, mpitrain.graph).

    Returns (loss, dlogits with the dtype and shape of logits); the loss is a 0-d array
    of the logits' module, so that on a GPU it stays on the device until the caller
    reads it (float(loss) copies it to the host).
    """
    xp = array_module(logits)
    N, K, labels = _check(xp, logits, labels)
    z = logits.astype(np.float64 if logits.dtype == np.float64 else np.float32)   # a copy
    z -= z.max(axis=1, keepdims=True)
    p = xp.exp(z)
    sum_exp = p.sum(axis=1)
    p /= sum_exp[:, None]
    log_sum = xp.log(sum_exp)
    rows = xp.arange(N)
    eps = label_smoothing
    # sum_k t_k log p_k = (1 - eps) log p_label + (eps / K) sum_k log p_k
    nll = log_sum - z[rows, labels]
    smooth = log_sum - z.mean(axis=1)
    loss = ((1 - eps) * nll + eps * smooth).mean()

    p[rows, labels] -= 1 - eps
    if eps:
        p -= eps / K
    p /= N
    if not isinstance(scale, (int, float)) or scale != 1:
        p *= scale
    return loss, cast.astype(p, logits.dtype)


def accuracy_counts(logits, labels, topk=(1, 5)):
    """How many rows have their label among the k largest logits, for each k in topk
    (k capped at the number of classes), as an int64 array of the logits' module (on a
    GPU it stays there until read). The label's rank is the number of logits larger than
    its own plus the number equal to it at a lower class index: ties go to the lower
    class, as argmax breaks them (and predict), so a model whose logits are all equal
    is right only where the label is class 0, not everywhere. A row with a non-finite
    logit counts as wrong at every k: no logit compares larger than a NaN, which would
    otherwise put a NaN row's label first (nonfinite_rows counts them)."""
    xp = array_module(logits)
    N, K, labels = _check(xp, logits, labels)
    own = logits[xp.arange(N), labels][:, None]
    lower = xp.arange(K)[None, :] < labels[:, None]
    rank = ((logits > own) | ((logits == own) & lower)).sum(axis=1)
    finite = xp.isfinite(logits).all(axis=1)
    return xp.stack([((rank < min(k, K)) & finite).sum() for k in topk]).astype(np.int64)


def nonfinite_rows(logits):
    """How many rows of (N, K) logits hold an inf or a NaN, as an int64 0-d array of the
    logits' module."""
    xp = array_module(logits)
    return (~xp.isfinite(logits).all(axis=1)).sum().astype(np.int64)


def _check(xp, logits, labels):
    """(N, K, labels as an array) after checking that logits are (N, K) with N > 0
    and labels are N integers, in [0, K) when they are host arrays (reading device
    labels back to check them would cost a copy every step; the loader has checked
    every label of its file against the number of classes)."""
    if getattr(logits, "ndim", None) != 2 or logits.shape[0] == 0:
        raise ValueError(f"logits must be 2-D (N, classes) with N > 0, got shape "
                         f"{getattr(logits, 'shape', None)}")
    N, K = logits.shape
    labels = xp.asarray(labels)
    if labels.shape != (N,):
        raise ValueError(f"labels must be 1-D with one entry per row of logits ({N}), got shape "
                         f"{labels.shape}")
    if labels.dtype.kind not in "iu":
        raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
    if xp is not np:
        return N, K, labels
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0 or hi >= K:
        raise ValueError(f"labels must lie in [0, {K}) (there are {K} classes), got values from "
                         f"{lo} to {hi}")
    return N, K, labels
