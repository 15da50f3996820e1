import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))   # tests/gradcheck.py and friends


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "launches: starts its own MPI job through tests/launcher.py (CI runs these "
                   "again under a second MPI: ./launch.sh test-mpi)")
    config.addinivalue_line(
        "markers", "one_mpi: a `launches` test of what a training option, a benchmark or "
                   "a study produces, whose collectives tests/mpi checks under every MPI and "
                   "whose launch the other `launches` tests check: the second MPI's round "
                   "(./launch.sh test-mpi) leaves it out")
    config._shm_before = shared_memory_files()


# Shared-memory segments of MPI jobs on this host: MPICH's (named after the job's world id:
# a later job with the same id attaches to a stale one and fails in MPI_Init) and Open
# MPI's. Ranks killed with SIGKILL, as tests kill them, cannot remove theirs.
SHM_DIR, SHM_NAMES = "/dev/shm", ("mpich_shm_", "mpich_vci_", "vader_segment.")


def shared_memory_files():
    try:
        return {e.name for e in os.scandir(SHM_DIR)
                if e.name.startswith(SHM_NAMES) and e.stat().st_uid == os.getuid()}
    except OSError:
        return set()


def pytest_unconfigure(config):
    """Remove the segments the session's jobs left behind: created during it, and mapped
    by no process any more."""
    from mpitrain.launcher import launched_size
    before = getattr(config, "_shm_before", None)
    if before is None or launched_size() is not None:      # under mpirun: the launcher's
        return
    left = shared_memory_files() - before
    if not left:
        return
    mapped = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                mapped.update(line.rsplit("/", 1)[-1].strip() for line in f if SHM_DIR in line)
        except OSError:
            continue
    for name in left - mapped:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass


def pytest_collection_modifyitems(config, items):
    from mpitrain.backend import gpu_available
    no_gpu = pytest.mark.skip(reason="no GPU visible to CuPy")
    no_torch = pytest.mark.skip(reason="torch is not installed (.ci/run installs it)")
    has_gpu = gpu_available()
    has_torch = importlib.util.find_spec("torch") is not None
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(no_gpu)
        if "torch" in item.keywords and not has_torch:
            item.add_marker(no_torch)


@pytest.fixture(autouse=True)
def cpu_unless_chosen():
    """Each test starts on the CPU: one that selects the GPU cannot leave it selected for
    the next (whose layers would be bound to CuPy arrays)."""
    from mpitrain import backend
    yield
    if backend.device != "cpu":
        backend.use_device("cpu")


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """The bundled digits converted once: digits_train.h5 and digits_val.h5 in a directory."""
    from mpitrain.datasets.convert import convert_digits
    path = tmp_path_factory.mktemp("digits")
    convert_digits(str(path))
    return path
