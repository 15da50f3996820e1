"""`python -m mpitrain.tools.warm`, the set-up's last step: into an empty Numba cache it
compiles every kernel that an epoch of each of its jobs calls, so that the same jobs
afterwards train without adding to the cache or rewriting a file of it; stopped, it ends
its jobs and leaves no directory behind."""
import os
import signal
import subprocess
import sys
import time

import launcher
from mpitrain.tools import warm


def cache_files(cache):
    return {str(p.relative_to(cache)): p.stat().st_mtime_ns for p in cache.rglob("*")
            if p.is_file()}


def test_after_warm_its_jobs_compile_nothing(tmp_path):
    cache, scratch = tmp_path / "cache", tmp_path / "tmp"
    scratch.mkdir()
    env = dict(launcher.environment(), NUMBA_CACHE_DIR=str(cache), TMPDIR=str(scratch))
    r = subprocess.run([sys.executable, "-m", "mpitrain.tools.warm"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warm: the kernels of an epoch in fp32 with SGD and in fp16 with LARS compiled " \
           "into Numba's cache in " in r.stdout, r.stdout
    # its jobs' directories are gone (Open MPI may keep its session directory there)
    assert not list(scratch.glob("mpitrain-warm-*"))
    compiled = cache_files(cache)
    # the layers' kernels in both precisions, the loader's, SGD's and LARS's updates
    for kernel in ("batchnorm._sums_forward", "augment._resize_normalise", "update._sgd_cpu",
                   "update._piece_sums_cpu", "cast._to_half_loop-", "gemm._team_products"):
        assert any(kernel in name for name in compiled), (kernel, sorted(compiled))
    for i, options in enumerate(warm.JOBS.values()):
        r = subprocess.run(warm.train_command(str(tmp_path / f"job{i}"), options), env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "final validation accuracy" in r.stdout, r.stdout
    assert cache_files(cache) == compiled


def processes_naming(path):
    """The pids of the processes whose command line names `path`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if str(path).encode() in f.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            pass
    return found


def test_a_stopped_warm_ends_its_jobs_and_removes_their_directories(tmp_path):
    """SIGTERM (what launch.sh's set-up sends on Ctrl-C) while the last job's epoch runs
    (the jobs run one after the other): exit 143, no job left running, no directory left.
    (Kernels from the cache: an epoch takes a few seconds, so a run that ended before the
    signal tries again.)"""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(launcher.environment(), TMPDIR=str(scratch))
    for attempt in range(3):
        proc = subprocess.Popen([sys.executable, "-m", "mpitrain.tools.warm"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        end = time.monotonic() + 120
        while len(list(scratch.glob("mpitrain-warm-*/job*/run"))) < len(warm.JOBS) and \
                proc.poll() is None and time.monotonic() < end:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        if proc.returncode != 0 or attempt == 2:
            break
    assert proc.returncode == 143, out + err
    assert "warm: stopped by SIGTERM; the kernels not compiled yet compile at their first " \
           "call" in err, err
    assert not list(scratch.glob("mpitrain-warm-*"))
    assert processes_naming(scratch) == []
