"""scripts/install.sh picks a flavour (cpu, or cuda for NCCL on GPU) and, with --dry-run, prints the
commands a fresh install would run. These tests read those plans, so the CUDA flavour's build flags
are checked on a machine without a GPU (the CUDA build itself only runs on one)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "install.sh"
PYVER = f"{sys.version_info.major}.{sys.version_info.minor}"
CP = f"cp{sys.version_info.major}{sys.version_info.minor}"
KEY = f"horovod-0.28.1-p2-torch2.13.0-tf2.21.0-{CP}"   # the cpu key of the wheels already cached
TOOLS = ("numpy mpi4py scikit-learn pytest pytest-timeout pytest-xdist hypothesis tqdm matplotlib cffi "
         "cloudpickle psutil pyyaml packaging setuptools wheel")


def dry_run(tmp_path, *args, path_prepend=None, **env):
    """Runs the script with --dry-run against a venv and cache under tmp_path; returns its stdout."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("PIPESGD_")}
    full.update(PIPESGD_VENV=str(tmp_path / "venv"), PIPESGD_CACHE=str(tmp_path / "cache"),
                PYTHON=sys.executable, **env)
    if path_prepend:
        full["PATH"] = f"{path_prepend}:{full['PATH']}"
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], env=full,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # A dry run changes nothing: not even the venv or cache folder it names.
    assert not (tmp_path / "venv").exists() and not (tmp_path / "cache").exists()
    return proc.stdout


def command(out, needle):
    """The one printed command line that contains needle."""
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith("$") and needle in line]
    assert len(lines) == 1, f"expected one command with {needle!r}, got {lines}\n{out}"
    return lines[0]


def build_env(out):
    """VAR=value pairs of the Horovod build command (`env A=1 B=2 python -m pip wheel ...`)."""
    line = command(out, "pip wheel")
    words = line.split(" && ", 1)[1].split()
    assert words[0] == "env", line
    pairs = {}
    for word in words[1:]:
        m = re.fullmatch(r"'?([A-Z_]+)=(.*?)'?", word)
        if not m:
            break
        pairs[m.group(1)] = m.group(2)
    return pairs


def site(tmp_path):
    return f"{tmp_path}/venv/lib/python{PYVER}/site-packages"


def test_cpu_plan_is_todays_install(tmp_path):
    out = dry_run(tmp_path, PIPESGD_DEVICE="cpu")
    assert "cpu (PIPESGD_DEVICE=cpu)" in out
    pip = command(out, "tensorflow-cpu")
    assert pip.endswith(f"install -q --disable-pip-version-check torch==2.13.0 tensorflow-cpu==2.21.0 {TOOLS}")
    assert f"cache key {KEY}\n" in out
    env = build_env(out)
    assert re.fullmatch(r"-j[0-9]+", env.pop("MAKEFLAGS"))   # -j$(nproc)
    assert env == {"HOROVOD_WITH_PYTORCH": "1", "HOROVOD_WITH_TENSORFLOW": "1", "HOROVOD_WITHOUT_MXNET": "1",
                   "HOROVOD_WITH_GLOO": "1", "HOROVOD_WITH_MPI": "1", "HOROVOD_GPU_OPERATIONS": ""}
    assert command(out, "pip wheel").endswith(f"-w {tmp_path}/cache/wheels/{KEY}")
    # The three source patches of the CPU build, and nothing CUDA.
    assert "CMAKE_CXX_STANDARD 17" in command(out, "CMAKE_CXX_STANDARD")
    assert "tensorflow/CMakeLists.txt" in command(out, "xla_mpi_ops.cc")
    assert command(out, "sed -i 's/^EXTENSIONS").endswith("horovod/common/util.py")
    for absent in ("NCCL", "nvidia", "cuda", "AsGpuStreamValue", "rpath"):
        assert absent not in out, absent
    assert "must list [X] TensorFlow PyTorch MPI Gloo\n" in out


def test_cuda13_plan_builds_horovod_with_nccl(tmp_path):
    out = dry_run(tmp_path, PIPESGD_DEVICE="cuda", PIPESGD_CUDA="13")
    assert "cu130 (PIPESGD_DEVICE=cuda; PIPESGD_CUDA=13)" in out
    pip = command(out, "tensorflow==")
    words = pip.split()
    # PyPI's CUDA 13 torch, by exact version (not a local 2.13.0+cpu), and the GPU TensorFlow.
    assert "torch===2.13.0" in words and "tensorflow==2.21.0" in words
    assert not any(w.startswith("tensorflow-cpu") or re.match(r"torch==[^=]", w) for w in words)
    assert "nvidia-nccl-cu13" in words and "cuda-toolkit[nvcc,crt,nvvm,cccl]==13.0.*" in words
    assert f"cache key {KEY}-cu130\n" in out
    env = build_env(out)
    assert env["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert env["HOROVOD_NCCL_INCLUDE"] == f"{site(tmp_path)}/nvidia/nccl/include"
    assert env["HOROVOD_NCCL_LIB"] == f"{site(tmp_path)}/nvidia/nccl/lib"
    assert env["HOROVOD_NCCL_LINK"] == "SHARED"
    assert env["HOROVOD_CUDA_HOME"] == env["CUDA_HOME"] == f"{tmp_path}/venv/cuda"
    assert env["PATH"].startswith(f"{tmp_path}/venv/cuda/bin:")
    assert env["LDFLAGS"].endswith("-Wl,-rpath,$ORIGIN/../../nvidia/nccl/lib")
    assert command(out, "pip wheel").endswith(f"-w {tmp_path}/cache/wheels/{KEY}-cu130")
    # The CUDA home is laid out from pip's toolkit; CMake finds the wheel's NCCL through a -dev link.
    assert command(out, "ln -s lib ").endswith(f"{tmp_path}/venv/cuda/lib64")
    assert command(out, "libnccl.so.2").endswith(f"{site(tmp_path)}/nvidia/nccl/lib/libnccl.so")
    assert "platform_specific_handle().stream" in command(out, "sed -i 's|^GpuStreamHandle AsGpuStreamValue")
    assert "must list [X] TensorFlow PyTorch MPI Gloo NCCL\n" in out


def test_cuda12_plan_is_one_cuda12_stack(tmp_path):
    out = dry_run(tmp_path, PIPESGD_DEVICE="cuda", PIPESGD_CUDA="12", PIPESGD_CUDA_HOME="/opt/cuda-12.8")
    words = command(out, "tensorflow[and-cuda]==2.21.0").split()
    assert words[words.index("--extra-index-url") + 1].endswith("/whl/cu128")
    assert "torch==2.13.0+cu128" in words and "nvidia-nccl-cu12" in words
    assert f"cache key {KEY}-cu128\n" in out
    env = build_env(out)
    assert env["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert env["HOROVOD_CUDA_HOME"] == "/opt/cuda-12.8"
    assert env["HOROVOD_NCCL_LIB"] == f"{site(tmp_path)}/nvidia/nccl/lib"


def test_system_nccl_replaces_the_wheel(tmp_path):
    env = build_env(dry_run(tmp_path, PIPESGD_DEVICE="cuda", PIPESGD_CUDA="13", PIPESGD_NCCL_HOME="/opt/nccl"))
    assert env["HOROVOD_NCCL_HOME"] == "/opt/nccl"
    assert "HOROVOD_NCCL_LIB" not in env and "LDFLAGS" not in env


def fake_nvidia_smi(tmp_path, cuda):
    """An nvidia-smi that lists one GPU and reports a driver for CUDA `cuda`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n"
                   'if [ "$1" = -L ]; then echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"; exit 0; fi\n'
                   f'echo "| NVIDIA-SMI 999.00   Driver Version: 999.00   CUDA Version: {cuda}     |"\n')
    smi.chmod(0o755)
    return str(bin_dir)


@pytest.mark.parametrize("driver_cuda,flavour", [("13.0", "cu130"), ("12.4", "cu128")])
def test_gpu_is_detected_and_the_driver_picks_the_cuda_version(tmp_path, driver_cuda, flavour):
    out = dry_run(tmp_path, path_prepend=fake_nvidia_smi(tmp_path, driver_cuda),
                  PIPESGD_CUDA_HOME="/opt/cuda")
    assert f"    {flavour} (an NVIDIA GPU is visible; the driver runs CUDA" in out
    assert build_env(out)["HOROVOD_GPU_OPERATIONS"] == "NCCL"


@pytest.mark.skipif(os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi"), reason="a GPU machine")
def test_no_gpu_means_cpu(tmp_path):
    out = dry_run(tmp_path)
    assert "    cpu (no NVIDIA GPU is visible)" in out
    assert build_env(out)["HOROVOD_GPU_OPERATIONS"] == ""


def test_an_old_driver_and_a_bad_setting_are_refused(tmp_path):
    base = {k: v for k, v in os.environ.items() if not k.startswith("PIPESGD_")}
    for env, message in [({"PIPESGD_DEVICE": "rocm"}, "PIPESGD_DEVICE must be cpu or cuda"),
                         ({"PIPESGD_DEVICE": "cuda", "PIPESGD_CUDA": "11"}, "PIPESGD_CUDA must be 12 or 13"),
                         ({"PATH": f"{fake_nvidia_smi(tmp_path, '11.8')}:{base['PATH']}"},
                          "the NVIDIA driver runs CUDA 11 only")]:
        proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env={**base, **env},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and message in proc.stderr, (env, proc.stdout, proc.stderr)
    proc = subprocess.run(["bash", str(SCRIPT), "--frobnicate"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage:" in proc.stderr
