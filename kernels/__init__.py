"""Compute kernels: Cython CPU kernels (im2col/col2im, pooling) and Numba kernels for
the optimizer (update: norms, the non-finite check, SGD/LARS; lamb: LAMB; cast:
fp32 <-> fp16; segments: how they walk the arena), for sparsified gradients (topk:
top-k selection, the sum of the ranks' picks), each with a NumPy reference, for the
GEMMs of a fully connected layer at a small batch (gemm), Winograd's F(2x2, 3x3)
transforms of 3x3 convolutions (winograd), and the layers' passes of BatchNorm
(batchnorm) and ReLU and the residual add (elementwise); these, Winograd's and the casts
run on the calling thread alone where their arrays are small (team)."""
