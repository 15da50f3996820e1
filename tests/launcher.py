"""The MPI launcher for tests that start their own jobs."""
import shutil
import sys
from pathlib import Path

import pytest


def mpiexec():
    """The mpiexec beside this Python (the virtual environment's MPICH), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.fail("no mpiexec: run ./launch.sh setup")
    return found
