"""pipesgd_hvd: pipelined (Pipe-SGD) data-parallel training for Horovod."""
from setuptools import Extension, find_packages, setup

# The fused codec kernels: plain C against Python's API only (no framework headers), so they build
# in a second and serve PyTorch and numpy alike. optional: without a compiler the package still
# installs and the codecs run their unfused tensor-op reference (pipesgd_hvd.compression.kernels
# says which). -ffp-contract=off and no -ffast-math: the kernels must give the reference's bits.
KERNELS = Extension(
    "pipesgd_hvd.compression._kernels",
    sources=["pipesgd_hvd/compression/_kernels.c"],
    extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"],
    optional=True,
)

setup(
    name="pipesgd_hvd",
    version="0.1.0",
    description="Pipelined, compressed data-parallel training for Horovod (Pipe-SGD, NeurIPS 2018)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["pipesgd_hvd", "pipesgd_hvd.*"]),
    ext_modules=[KERNELS],
    python_requires=">=3.9",
    install_requires=["numpy"],
    # Horovod itself is not listed: it must be built against the installed PyTorch/TensorFlow
    # (scripts/install.sh does that); a pip dependency would pull an incompatible build.
    extras_require={
        "torch": ["torch>=2.0"],
        "tensorflow": ["tensorflow>=2.16", "keras>=3"],
        "mpi": ["mpi4py>=3.1"],
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "scikit-learn"],
    },
)
