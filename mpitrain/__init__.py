"""mpitrain: a parameter-server-free, MPI data-parallel trainer for convolutional networks."""
import os

# Idle OpenMP threads (the Cython kernels' teams) sleep instead of spinning: a spinning
# team steals the cores that OpenBLAS's GEMM right after im2col, and the other MPI ranks
# of the node, need. libgomp reads this once, when the first kernel module loads.
OMP_WAIT_POLICY_SET = "OMP_WAIT_POLICY" not in os.environ   # benchmarks give others the user's
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
