"""mpitrain: a parameter-server-free, MPI data-parallel trainer for convolutional networks."""
import os

# How idle worker threads wait, unless the user says otherwise. One OpenMP team runs every
# parallel kernel of a step on the CPU, the GEMMs included (kernels/gemm.py); between two
# kernels its threads spin for a moment, then sleep, so that the next kernel starts without
# waking them and a pause in the work gives the cores back to the data loader, the
# communication thread and the other MPI ranks of the node:
#   GOMP_SPINCOUNT           libgomp's spins before a waiting thread sleeps: 30000, under a
#                            millisecond (docs/benchmarks-record.md measured 3,000 to 100,000);
#                            left alone where the user set it or OMP_WAIT_POLICY (libgomp
#                            reads both once, when the first kernel module loads)
#   OPENBLAS_THREAD_TIMEOUT  where OpenBLAS keeps threads of its own (OPENBLAS_NUM_THREADS
#                            above 1), they spin 2^N cycles after each call before they
#                            sleep: 2^28 (about 0.1 s) by default, 2^4 here (read when NumPy
#                            loads OpenBLAS)
WAITING_THREADS = {"GOMP_SPINCOUNT": "30000", "OPENBLAS_THREAD_TIMEOUT": "4"}
SET_HERE = [k for k in WAITING_THREADS if k not in os.environ   # benchmarks give others the user's
            and not (k == "GOMP_SPINCOUNT" and "OMP_WAIT_POLICY" in os.environ)]
for _name in SET_HERE:
    os.environ[_name] = WAITING_THREADS[_name]

__version__ = "0.1.0"
