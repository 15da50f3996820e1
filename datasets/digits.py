"""The bundled real data: scikit-learn's handwritten digits as 32x32 RGB images.

scikit-learn ships 1,797 grey 8x8 images of the digits 0-9 (values 0..16)
inside the package, so the default job needs no download. They are turned
into what the ImageNet networks expect:

    upsample  8x8 -> 32x32 bilinearly: img32 = A @ img8 @ A.T, where A (32, 8)
              holds the interpolation weights (half-pixel centres, edges clamped,
              as PIL and torch's align_corners=False)
    channels  the grey plane copied to 3 channels
    normalise (x - mean) / std, one scalar mean and std taken over the
              training split only
    layout    NHWC float32

The validation split is stratified: from each class, round(val_fraction * n_c)
images, chosen by a permutation drawn from `seed`, go to validation and the
rest to training. The same seed gives the same split on every rank.
"""
import numpy as np

SIZE = 32


def interpolation_matrix(n_in, n_out):
    """A (n_out, n_in): row i holds the weights of output pixel i (bilinear, half-pixel centres)."""
    centre = (np.arange(n_out) + 0.5) * n_in / n_out - 0.5
    centre = np.clip(centre, 0, n_in - 1)
    lo = np.floor(centre).astype(int)
    hi = np.minimum(lo + 1, n_in - 1)
    frac = centre - lo
    a = np.zeros((n_out, n_in))
    a[np.arange(n_out), lo] += 1 - frac
    a[np.arange(n_out), hi] += frac
    return a


def upsample(images, size=SIZE):
    """(N, h, w) -> (N, size, size), bilinear."""
    ah = interpolation_matrix(images.shape[1], size)
    aw = interpolation_matrix(images.shape[2], size)
    return np.einsum("ih,nhw,jw->nij", ah, images, aw)


def load_digits_split(seed=0, val_fraction=0.2):
    """(x_train, y_train, x_val, y_val): NHWC float32 images (N, 32, 32, 3), int64 labels."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    from sklearn.datasets import load_digits

    from .split import stratified_val
    digits = load_digits()
    images = digits.images.astype(np.float64)          # (1797, 8, 8), values 0..16
    labels = digits.target.astype(np.int64)

    val = stratified_val(labels, val_fraction, np.random.default_rng(seed))

    x = upsample(images)
    mean, std = x[~val].mean(), x[~val].std()
    x = ((x - mean) / std).astype(np.float32)
    x = np.repeat(x[..., None], 3, axis=3)             # (N, 32, 32, 3)
    return x[~val], labels[~val], x[val], labels[val]
