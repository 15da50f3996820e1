"""mpitrain: a parameter-server-free, MPI data-parallel trainer for convolutional networks."""
import os

# Idle worker threads sleep instead of spinning, unless the user says otherwise. A spinning
# pool steals the cores that the next kernel, the data loader, the communication thread and
# the other MPI ranks of the node need:
#   OMP_WAIT_POLICY          the OpenMP teams of the Cython and Numba kernels (libgomp reads
#                            it once, when the first kernel module loads)
#   OPENBLAS_THREAD_TIMEOUT  OpenBLAS's GEMM threads spin 2^N cycles after each call before
#                            they sleep: 2^28 (about 0.1 s) by default, 2^4 here, so they sleep
#                            between the GEMMs of a step (read when NumPy loads OpenBLAS;
#                            docs/benchmarks.md has the step with and without it)
SLEEPING_THREADS = {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_THREAD_TIMEOUT": "4"}
SET_HERE = [k for k in SLEEPING_THREADS if k not in os.environ]   # benchmarks give others the user's
for _name in SET_HERE:
    os.environ[_name] = SLEEPING_THREADS[_name]

__version__ = "0.1.0"
