"""Which BLAS the CPU kernels' GEMMs call (kernels/gemm.py's team): MPITRAIN_BLAS's
choice, else MKL on the CPU makers of MKL_VENDORS where the mkl package is installed,
else NumPy's OpenBLAS. Decided without loading Numba or any BLAS: the command line checks
the choice before each rank sizes its thread pools, which Numba fixes when it loads
(mpitrain.launcher.size_thread_pools)."""
import os
import sys

# The CPU makers on which MKL is the team's BLAS unless MPITRAIN_BLAS says otherwise: MKL
# picks its kernels by the CPU, and on an AMD EPYC its products ran at half the speed of
# OpenBLAS's (docs/benchmarks.md, "The BLAS by CPU")
MKL_VENDORS = ("GenuineIntel",)


def blas_choice():
    """"mkl" or "openblas": MPITRAIN_BLAS's choice, else MKL where the mkl package is
    installed (`pip install mpitrain[mkl]`) and the CPU's maker is one of MKL_VENDORS."""
    given = os.environ.get("MPITRAIN_BLAS", "").lower()
    if given:
        return given
    return "mkl" if mkl_installed() and cpu_vendor() in MKL_VENDORS else "openblas"


def cpu_vendor():
    """The CPU's maker as the kernel names it (/proc/cpuinfo's vendor_id: GenuineIntel,
    AuthenticAMD, ...); None where it does not say."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def blas_choice_problem():
    """Why MPITRAIN_BLAS cannot be followed (None: it can), with the fix."""
    given = os.environ.get("MPITRAIN_BLAS", "")
    if given.lower() not in ("", "mkl", "openblas"):
        return f"MPITRAIN_BLAS={given!r}: expected mkl or openblas (or unset)"
    if given.lower() == "mkl" and not mkl_installed():
        return (f"MPITRAIN_BLAS=mkl, but MKL is not installed here: `{sys.executable} -m pip "
                "install mkl` installs it, or unset MPITRAIN_BLAS")
    return None


def mkl_installed():
    """Whether the mkl package (libmkl_rt) is installed, without loading it."""
    import importlib.metadata
    try:
        return any(f.name.startswith("libmkl_rt.so") for f in importlib.metadata.files("mkl") or [])
    except importlib.metadata.PackageNotFoundError:
        return False
