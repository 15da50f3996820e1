"""`python -m mpitrain.tools.warm`, the set-up's last step: into an empty Numba cache it
compiles every kernel that an epoch of each of its jobs calls, so that the same jobs
afterwards train without adding to the cache or rewriting a file of it."""
import subprocess
import sys

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
    assert not list(scratch.iterdir())                   # its jobs' directories are gone
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
