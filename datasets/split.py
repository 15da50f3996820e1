"""The validation split every converter and the digits share: stratified by class."""
import numpy as np


def stratified_val(labels, val_fraction, rng):
    """Boolean mask: round(val_fraction * n_c) members of each class c, drawn with rng."""
    labels = np.asarray(labels)
    val = np.zeros(len(labels), bool)
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        val[members[:int(round(val_fraction * len(members)))]] = True
    return val
