"""Compute kernels: Cython CPU kernels (im2col/col2im, pooling) and, in later
modules, Numba kernels for the optimizer, each with a NumPy reference."""
