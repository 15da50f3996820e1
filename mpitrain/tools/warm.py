"""`python -m mpitrain.tools.warm`: the CPU kernels compiled before the first run
(`./launch.sh setup` ends with it).

Numba compiles a kernel at its first call with new argument types, and keeps the
machine code of those marked cache=True in the `__pycache__` beside their source,
where every later process finds it. Without this, the first run compiles them
itself: about half a minute, in every rank of the job at once. This trains one epoch
of the bundled digits in each of JOBS, one after the other, each process with a thread
per core (the GEMM team's kernels compile only where a run has several threads), in
scratch directories that are removed. A kernel that only other options call (another
optimizer or dtype, top-k) still compiles on its first call, once; so does every
kernel whose source file has changed since.

One after the other, because Numba's cache is not safe for two processes that compile
one kernel for different argument types at once: each rewrites the kernel's index from
what it read before, so one entry is lost, or names the other's machine code, which
then fails every later call with those types ("can't unbox array"; numba/numba#10128).
The ranks of one job compile the same types, which is safe.

Exit status: 0, or 1 with the failed run's output; stopped by SIGINT or SIGTERM, it
ends its jobs and removes their directories first.
"""
import os
import signal
import subprocess
import sys
import tempfile
import time

from mpitrain.launcher import cores, job_environment

# train's options for each job: the bundled job as ./launch.sh trains it, and the
# paper's recipe (fp16 forward and backward, LARS)
JOBS = {"fp32 with SGD": [], "fp16 with LARS": ["--precision", "fp16", "--optimizer", "lars"]}


def train_command(scratch, options):
    """One epoch of the digits, converted into `scratch`, its run directory there too."""
    return [sys.executable, "-m", "mpitrain", "train", "--epochs", "1", "--data-dir", scratch,
            "--run-dir", os.path.join(scratch, "run"), *options]


class Stopped(Exception):
    """SIGINT or SIGTERM (launch.sh's step passes Ctrl-C on as SIGTERM); args: (signum,)."""


def stop(signum, frame):
    for name in ("SIGINT", "SIGTERM"):      # once: the jobs' ending is not cut short
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    raise Stopped(signum)


def main():
    start = time.monotonic()
    env = job_environment(None, cores())
    for name in ("SIGINT", "SIGTERM"):
        signal.signal(getattr(signal, name), stop)
    runs, outputs = {}, {}
    try:
        with tempfile.TemporaryDirectory(prefix="mpitrain-warm-") as scratch:
            try:
                for i, (name, options) in enumerate(JOBS.items()):
                    runs[name] = subprocess.Popen(
                        train_command(os.path.join(scratch, f"job{i}"), options), env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                    outputs[name] = runs[name].communicate()[0]
                    if runs[name].returncode != 0:
                        break
            finally:
                for run in runs.values():       # stopped: the job ends (a train stops
                    if run.poll() is None:      # at its next step on SIGTERM) before its
                        run.terminate()         # directory goes
                        run.communicate()
    except Stopped as stopped:
        print(f"warm: stopped by {signal.Signals(stopped.args[0]).name}; the kernels not "
              f"compiled yet compile at their first call", file=sys.stderr)
        return 128 + stopped.args[0]
    for name, run in runs.items():
        if run.returncode != 0:
            print(outputs[name], end="")
            print(f"warm: the {name} epoch failed (exit {run.returncode}; its output above)",
                  file=sys.stderr)
            return 1
    print(f"warm: the kernels of an epoch in {' and in '.join(JOBS)} compiled into Numba's cache "
          f"in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
