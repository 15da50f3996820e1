"""Builds the Cython kernels and installs kernels/, nets/ and datasets/ as
mpitrain.kernels, mpitrain.nets and mpitrain.datasets, so that the project
never shadows another distribution's top-level `kernels` or `datasets`."""
import glob
import os
import re
import shutil

import numpy
from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

OPENMP = {"extra_compile_args": ["-O3", "-fopenmp"], "extra_link_args": ["-fopenmp"]}

extensions = [
    Extension("mpitrain.kernels._im2col", ["kernels/_im2col.pyx"],
              include_dirs=[numpy.get_include()], **OPENMP),
    Extension("mpitrain.kernels._pool", ["kernels/_pool.pyx"],
              include_dirs=[numpy.get_include()], **OPENMP),
]

# written once, in mpitrain/__init__.py (read, not imported: importing sets the environment)
with open(os.path.join("mpitrain", "__init__.py")) as f:
    VERSION = re.search(r'^__version__ = "(.+)"$', f.read(), re.M).group(1)

mapped = {"mpitrain.kernels": "kernels", "mpitrain.nets": "nets", "mpitrain.datasets": "datasets"}


class BuildExt(build_ext):
    """Takes a kernel that is built in kernels/ already, newer than its sources and than
    the NumPy headers of this environment, instead of compiling its C again: a second
    venv of the checkout (another MPI's) installs in seconds, not half a minute."""
    def build_extension(self, ext):
        target, folder = self.get_ext_fullpath(ext.name), mapped["mpitrain.kernels"]
        built = os.path.join(folder, os.path.basename(target))
        inputs = [*ext.sources, os.path.join(numpy.get_include(), "numpy"),
                  *(f for kind in ("pyx", "pxi", "pxd") for f in glob.glob(f"{folder}/*.{kind}"))]
        if os.path.abspath(built) == os.path.abspath(target) or not os.path.exists(built) \
                or any(os.path.getmtime(f) >= os.path.getmtime(built) for f in inputs):
            return super().build_extension(ext)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(built, target)


setup(
    name="mpitrain",
    version=VERSION,
    description="Parameter-server-free MPI data-parallel training of convolutional networks",
    python_requires=">=3.10",
    packages=find_packages(include=["mpitrain", "mpitrain.*"]) + list(mapped),
    package_dir=mapped,
    package_data={"mpitrain.kernels": ["gpu.cu"]},     # the CUDA C++ that kernels/gpu.py compiles
    cmdclass={"build_ext": BuildExt},
    ext_modules=cythonize(extensions, language_level=3,
                          compiler_directives={"boundscheck": False, "wraparound": False}),
    # NumPy 2's promotion (NEP 50: float32 with a Python scalar stays float32), which the
    # layers' dtypes and bits are tested under; the first h5py, simplejpeg, scikit-learn
    # and onnxruntime releases built for it; threadpoolctl 3.5 finds NumPy 2's OpenBLAS
    # (kernels/gemm.py's team BLAS); mpi4py 4.1 has MPI.FLOAT16_T and the first wheels
    install_requires=["numpy>=2.0", "numba>=0.60", "h5py>=3.11", "pillow>=10",
                      "simplejpeg>=1.7.4", "mpi4py>=4.1", "scikit-learn>=1.4.2", "pyyaml>=6",
                      "threadpoolctl>=3.5", "tqdm>=4.60"],
    extras_require={
        # CUDA 12 or CUDA 13 (the driver's major version): CuPy with the CUDA libraries it
        # loads (ctk), NCCL, cuDNN and Numba's CUDA target built for it; cudnn-frontend
        # serves both. "gpu" is kept as another name for gpu-cu12.
        **dict.fromkeys(("gpu-cu12", "gpu"), [
            "cupy-cuda12x[ctk]>=14", "numba-cuda[cu12]>=0.30", "nvidia-nccl-cu12",
            "nvidia-cudnn-cu12", "nvidia-cudnn-frontend", "nvidia-nvimgcodec-cu12[nvjpeg]"]),
        "gpu-cu13": ["cupy-cuda13x[ctk]>=14", "numba-cuda[cu13]>=0.30", "nvidia-nccl-cu13",
                     "nvidia-cudnn-cu13", "nvidia-cudnn-frontend",
                     "nvidia-nvimgcodec-cu13[nvjpeg]"],
        "test": ["pytest>=7", "pytest-xdist", "matplotlib",
                 "safetensors>=0.4", "onnx>=1.14", "onnxruntime>=1.19"],   # export's tests
        "plot": ["matplotlib"],
        # the CPU's GEMMs on MKL on Intel's CPUs (kernels/gemm.py team_blas), where Intel
        # publishes it
        "mkl": ['mkl>=2024; platform_machine == "x86_64" and sys_platform == "linux"'],
        # `python -m mpitrain export`: one package per format (no torch needed)
        "export": ["safetensors>=0.4", "onnx>=1.14"],
    },
    entry_points={"console_scripts": ["mpitrain=mpitrain.__main__:main"]},
)
