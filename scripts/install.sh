#!/usr/bin/env bash
# One unattended, idempotent set-up for a fresh machine: Debian packages, the repo's .venv,
# Horovod 0.28.1 built from its sdist for today's PyTorch/TensorFlow (wheel cached outside the
# repo), and this package in editable mode. Each step prints its name; a failure names the step.
set -euo pipefail
export TF_CPP_MIN_LOG_LEVEL=3   # TensorFlow logs a page at every import; errors still show

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
PYTHON="${PYTHON:-python3}"

TORCH_VERSION="2.13.0"        # the CPU build that lies on this machine's disk
TF_VERSION="2.21.0"
HOROVOD_VERSION="0.28.1"
CACHE_DIR="${PIPESGD_CACHE:-$HOME/.cache/pipesgd_hvd}"

step_name=""
step() { step_name="$1"; echo "==> [install] $step_name"; }
trap 'rc=$?; [ $rc -ne 0 ] && echo "!! [install] step failed: $step_name (exit $rc)" >&2' EXIT

step "Debian packages (OpenMPI, iproute2)"
need_apt=()
dpkg -s libopenmpi-dev >/dev/null 2>&1 || need_apt+=(libopenmpi-dev)
dpkg -s openmpi-bin >/dev/null 2>&1 || need_apt+=(openmpi-bin)
dpkg -s iproute2 >/dev/null 2>&1 || need_apt+=(iproute2)
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
else
  echo "    already installed"
fi

step "virtual environment at .venv"
[ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
# pip warns about every package its extra local indexes lack; those lines say nothing.
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }; }

step "Python packages (torch $TORCH_VERSION CPU, tensorflow-cpu $TF_VERSION, tools)"
# Horovod's run-time needs (cloudpickle, psutil, pyyaml, packaging, cffi) are installed here
# because its wheel is installed with --no-deps below (its metadata would pull a CUDA torch).
if ! "$PY" - <<PYEOF 2>/dev/null
import importlib.metadata as m
want = {"torch": "$TORCH_VERSION", "tensorflow-cpu": "$TF_VERSION"}
assert all(m.version(k).split("+")[0] == v for k, v in want.items())
for k in ["numpy", "mpi4py", "scikit-learn", "pytest", "pytest-timeout", "hypothesis", "tqdm",
          "matplotlib", "cffi", "cloudpickle", "psutil", "pyyaml", "packaging", "setuptools", "wheel"]:
    m.version(k)
PYEOF
then
  pip_install "torch==$TORCH_VERSION" "tensorflow-cpu==$TF_VERSION" numpy mpi4py scikit-learn \
    pytest pytest-timeout hypothesis tqdm matplotlib cffi cloudpickle psutil pyyaml packaging \
    setuptools wheel
else
  echo "    already installed"
fi

step "Horovod $HOROVOD_VERSION (PyTorch, TensorFlow, Gloo, MPI)"
key="horovod-$HOROVOD_VERSION-p2-torch$TORCH_VERSION-tf$TF_VERSION-$("$PY" -c 'import sys;print(f"cp{sys.version_info.major}{sys.version_info.minor}")')"
wheel_dir="$CACHE_DIR/wheels/$key"
if "$PY" -c "import horovod, horovod.torch, horovod.tensorflow" 2>/dev/null; then
  echo "    already installed"
else
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    echo "    no cached wheel at $wheel_dir: building from the sdist (several minutes)"
    build="$(mktemp -d)"
    "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$build"
    tar -xzf "$build"/horovod-"$HOROVOD_VERSION".tar.gz -C "$build"
    src="$build/horovod-$HOROVOD_VERSION"
    # Today's PyTorch and TensorFlow headers need C++17; Horovod 0.28.1 asks for C++14.
    sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/g; s/-std=c++14/-std=c++17/g' \
      "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    # TensorFlow 2.21 removed the XLA custom-call API that xla_mpi_ops.cc builds on.
    sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
    # horovodrun asks "was Horovod built with MPI?" by importing its first extension in a
    # subprocess: TensorFlow first costs ~3.5 s on every launch; PyTorch answers the same in ~1 s.
    sed -i "s/^EXTENSIONS = \['tensorflow', 'torch', 'mxnet'\]/EXTENSIONS = ['torch', 'tensorflow', 'mxnet']/" \
      "$src/horovod/common/util.py"
    grep -q "^EXTENSIONS = \['torch'" "$src/horovod/common/util.py" || { echo "patching horovod/common/util.py failed" >&2; exit 1; }
    mkdir -p "$wheel_dir"
    (cd "$src" && HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
       HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 HOROVOD_GPU_OPERATIONS= \
       MAKEFLAGS="-j$(nproc)" \
       "$PY" -m pip wheel -q --no-build-isolation --no-deps . -w "$wheel_dir")
    rm -rf "$build"
  else
    echo "    using cached wheel in $wheel_dir"
  fi
  "$PY" -m pip install -q --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
fi

step "check the Horovod build"
check="$(TF_CPP_MIN_LOG_LEVEL=3 "$VENV/bin/horovodrun" --check-build 2>/dev/null)"
echo "$check" | sed -n '/Available/,$p' | sed 's/^ */    /'
for want in TensorFlow PyTorch MPI Gloo; do
  echo "$check" | grep -Eq "\[X\] +$want" || { echo "Horovod was built without $want" >&2; exit 1; }
done

step "pipesgd_hvd (editable)"
(cd / && "$PY" -c "import pipesgd_hvd" 2>/dev/null) || pip_install --no-deps --no-build-isolation -e "$ROOT"

step "done"
