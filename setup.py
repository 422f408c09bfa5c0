"""pipesgd_hvd: pipelined (Pipe-SGD) data-parallel training for Horovod."""
from setuptools import find_packages, setup

setup(
    name="pipesgd_hvd",
    version="0.1.0",
    description="Pipelined, compressed data-parallel training for Horovod (Pipe-SGD, NeurIPS 2018)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["pipesgd_hvd", "pipesgd_hvd.*"]),
    python_requires=">=3.9",
    install_requires=["numpy"],
    # Horovod itself is not listed: it must be built against the installed PyTorch/TensorFlow
    # (scripts/install.sh does that); a pip dependency would pull an incompatible build.
    extras_require={
        "torch": ["torch>=2.0"],
        "tensorflow": ["tensorflow>=2.16", "keras>=3"],
        "mpi": ["mpi4py>=3.1"],
        "test": ["pytest", "pytest-timeout", "hypothesis", "scikit-learn"],
    },
)
