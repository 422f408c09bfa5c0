#!/usr/bin/env bash
# One unattended, idempotent set-up for a fresh machine: Debian packages, the repo's .venv,
# Horovod 0.28.1 built from its sdist for today's PyTorch/TensorFlow (wheel cached outside the
# repo), and this package in editable mode. Each step prints its name; a failure names the step.
#
# Two flavours, decided once under "Flavour" below: cpu (Gloo and MPI) and cuda (NCCL on GPU).
#   scripts/install.sh             install the flavour this machine calls for
#   scripts/install.sh --dry-run   print every command a fresh install would run, with its
#                                  environment variables, and run none that changes the machine
# Settings (environment):
#   PIPESGD_DEVICE=cpu|cuda   the flavour (default: cuda when an NVIDIA GPU is visible)
#   PIPESGD_CUDA=13|12        the cuda flavour's CUDA major version (default: the driver's)
#   PIPESGD_CUDA_HOME=DIR     the CUDA toolkit that compiles Horovod (default: pip's for CUDA 13,
#                             nvcc on PATH or /usr/local/cuda for CUDA 12)
#   PIPESGD_NCCL_HOME=DIR     a system NCCL (include/, lib/) instead of the nvidia-nccl wheel
#   PIPESGD_VENV=DIR          the virtual environment (default: the repo's .venv)
#   PIPESGD_CACHE=DIR         where built Horovod wheels are kept (default: ~/.cache/pipesgd_hvd)
set -euo pipefail
export TF_CPP_MIN_LOG_LEVEL=3   # TensorFlow logs a page at every import; errors still show

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PIPESGD_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
PYTHON="${PYTHON:-python3}"

TORCH_VERSION="2.13.0"        # the CPU build lies on this machine's disk; PyPI's is CUDA 13
TF_VERSION="2.21.0"
HOROVOD_VERSION="0.28.1"
CACHE_DIR="${PIPESGD_CACHE:-$HOME/.cache/pipesgd_hvd}"
TORCH_CU12_INDEX="https://download.pytorch.org/whl/cu128"   # PyPI's torch is CUDA 13 only

DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac

step_name=""
step() { step_name="$1"; echo "==> [install] $step_name"; }
trap 'rc=$?; [ $rc -ne 0 ] && echo "!! [install] step failed: $step_name (exit $rc)" >&2' EXIT
fail() { echo "$*" >&2; exit 1; }
# A missing prerequisite: a real run stops, a dry run says so and goes on.
stop() { if [ "$DRY_RUN" = 1 ]; then echo "    (a real run would stop here: $*)"; else fail "$@"; fi; }

# A command as a shell would read it back: plain words bare, others in single quotes.
show() {
  local a out=""
  for a in "$@"; do
    if [[ "$a" =~ ^[][A-Za-z0-9_./:=+@%,*-]+$ ]]; then out+=" $a"
    else out+=" '${a//\'/\'\\\'\'}'"; fi
  done
  echo "${out# }"
}
# Runs a command; under --dry-run prints it instead.
run() { if [ "$DRY_RUN" = 1 ]; then echo "    \$ $(show "$@")"; else "$@"; fi; }
run_quiet() { if [ "$DRY_RUN" = 1 ]; then run "$@"; else "$@" >/dev/null; fi; }
# Same, in another directory (which a dry run has not made).
run_in() { local dir="$1"; shift
  if [ "$DRY_RUN" = 1 ]; then echo "    \$ cd $(show "$dir") && $(show "$@")"; else (cd "$dir" && "$@"); fi; }
# Fails unless a patched file holds the pattern (a dry run prints the check).
check_patched() {
  if [ "$DRY_RUN" = 1 ]; then echo "    \$ grep -q $(show "$2") $(show "$1")"
  else grep -q "$2" "$1" || fail "patching $1 failed"; fi
}
# pip warns about every package its extra local indexes lack; those lines say nothing.
pip_install() { run "$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }; }

step "Flavour"
# Every later step follows the variables set here.
gpu_visible() { { nvidia-smi -L 2>/dev/null | grep -q '^GPU'; } || [ -e /dev/nvidia0 ]; }
# The newest CUDA the driver runs ("CUDA Version: 13.0" in nvidia-smi's header), major only.
driver_cuda_major() { nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\).*/\1/p' | head -n 1; }

DEVICE="${PIPESGD_DEVICE:-}"
if [ -n "$DEVICE" ]; then why="PIPESGD_DEVICE=$DEVICE"
elif gpu_visible; then DEVICE=cuda; why="an NVIDIA GPU is visible"
else DEVICE=cpu; why="no NVIDIA GPU is visible"; fi
case "$DEVICE" in cpu|cuda) ;; *) fail "PIPESGD_DEVICE must be cpu or cuda, not '$DEVICE'" ;; esac

CUDA_MAJOR=""
if [ "$DEVICE" = cuda ]; then
  CUDA_MAJOR="${PIPESGD_CUDA:-}"
  if [ -n "$CUDA_MAJOR" ]; then why+="; PIPESGD_CUDA=$CUDA_MAJOR"
  else
    driver="$(driver_cuda_major || true)"
    if [ -z "$driver" ]; then CUDA_MAJOR=13; why+="; CUDA 13 (no driver answered: the default)"
    elif [ "$driver" -ge 13 ]; then CUDA_MAJOR=13; why+="; the driver runs CUDA $driver"
    elif [ "$driver" -eq 12 ]; then CUDA_MAJOR=12; why+="; the driver runs CUDA 12 only"
    else fail "the NVIDIA driver runs CUDA $driver only; the cuda flavour needs CUDA 12 or 13 (update the driver, or PIPESGD_DEVICE=cpu)"
    fi
  fi
fi

# Shared by every flavour: the tools, the build switches, the frameworks the build check wants.
TOOLS=(numpy mpi4py scikit-learn pytest pytest-timeout pytest-xdist hypothesis tqdm matplotlib cffi cloudpickle
       psutil pyyaml packaging setuptools wheel)
BUILT_WITH=(TensorFlow PyTorch MPI Gloo)
GPU_PIP=()          # extra pip requirements of the GPU build (NCCL, CUDA compiler)
GPU_DISTS=()        # the distributions those install, for the "already installed" check
case "$DEVICE${CUDA_MAJOR:+/$CUDA_MAJOR}" in
  cpu)
    FLAVOUR=cpu
    TORCH_PIP=("torch==$TORCH_VERSION")
    TORCH_MATCH=release            # accept 2.13.0+cpu
    TORCH_WANT="$TORCH_VERSION"
    TF_DIST=tensorflow-cpu
    TF_REQ="tensorflow-cpu==$TF_VERSION"
    GPU_OPERATIONS=""              # no NCCL
    KEY_SUFFIX=""                  # the cache key of the wheels built before flavours existed
    ;;
  cuda/13)
    FLAVOUR=cu130
    # PyPI's Linux torch is the CUDA 13.0 build. "===" asks for exactly that version string:
    # "==" would also accept, and prefer, a 2.13.0+cpu wheel in a local find-links folder.
    TORCH_PIP=("torch===$TORCH_VERSION")
    TORCH_MATCH=exact
    TORCH_WANT="$TORCH_VERSION"
    # Plain tensorflow (the GPU-capable build): its [and-cuda] extra brings CUDA 12 libraries
    # whose nvidia-nccl-cu12 writes the same nvidia/nccl/lib/libnccl.so.2 as torch's
    # nvidia-nccl-cu13. TensorFlow uses the GPU when CUDA 12 libraries are on the loader path.
    TF_DIST=tensorflow
    TF_REQ="tensorflow==$TF_VERSION"
    # NCCL: unpinned, so torch's pin decides (the NCCL torch runs with is the one Horovod links).
    # nvcc of the CUDA torch was built with (13.0), from pip: no system toolkit needed.
    GPU_PIP=(nvidia-nccl-cu13 "cuda-toolkit[nvcc,crt,nvvm,cccl]==13.0.*")
    GPU_DISTS=(nvidia-nccl-cu13 nvidia-cuda-nvcc nvidia-cuda-crt nvidia-nvvm nvidia-cuda-cccl)
    CUDA_TOOLKIT=pip               # site-packages/nvidia/cu13
    GPU_OPERATIONS=NCCL
    KEY_SUFFIX="-cu130"
    ;;
  cuda/12)
    FLAVOUR=cu128
    # PyTorch's own index has CUDA 12 builds (PyPI's needs a CUDA 13 driver). One CUDA 12 stack:
    # torch and tensorflow[and-cuda] share the nvidia-*-cu12 wheels, NCCL included.
    TORCH_PIP=(--extra-index-url "$TORCH_CU12_INDEX" "torch==$TORCH_VERSION+cu128")
    TORCH_MATCH=exact
    TORCH_WANT="$TORCH_VERSION+cu128"
    TF_DIST=tensorflow
    TF_REQ="tensorflow[and-cuda]==$TF_VERSION"
    GPU_PIP=(nvidia-nccl-cu12)
    GPU_DISTS=(nvidia-nccl-cu12)
    CUDA_TOOLKIT=system            # the CUDA 12 pip wheels hold no static runtime to build with
    GPU_OPERATIONS=NCCL
    KEY_SUFFIX="-cu128"
    ;;
  *) fail "PIPESGD_CUDA must be 12 or 13, not '$CUDA_MAJOR'" ;;
esac
[ -n "$GPU_OPERATIONS" ] && BUILT_WITH+=(NCCL)
echo "    $FLAVOUR ($why)"

# The venv's interpreter once it exists; before that, the one that will make it.
PYVER_BIN="$PY"; [ -x "$PY" ] || PYVER_BIN="$PYTHON"
PYVER="$("$PYVER_BIN" -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")')"
SITE="$VENV/lib/python$PYVER/site-packages"
FLAVOUR_FILE="$VENV/pipesgd-flavour"

step "Debian packages (OpenMPI, iproute2)"
need_apt=()
if [ "$DRY_RUN" = 1 ]; then
  need_apt=(libopenmpi-dev openmpi-bin iproute2 cmake g++)
else
  dpkg -s libopenmpi-dev >/dev/null 2>&1 || need_apt+=(libopenmpi-dev)
  dpkg -s openmpi-bin >/dev/null 2>&1 || need_apt+=(openmpi-bin)
  dpkg -s iproute2 >/dev/null 2>&1 || need_apt+=(iproute2)
  command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
  command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=(); [ "$(id -u)" -ne 0 ] && SUDO=(sudo)
  run "${SUDO[@]}" apt-get update -qq
  run_quiet "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
else
  echo "    already installed"
fi

step "virtual environment at $VENV"
if [ "$DRY_RUN" = 0 ] && [ -x "$PY" ]; then
  # A venv made before flavours existed holds the cpu flavour; one venv never mixes two.
  have="$(cat "$FLAVOUR_FILE" 2>/dev/null || echo cpu)"
  [ "$have" = "$FLAVOUR" ] || fail "$VENV holds the $have flavour, not $FLAVOUR: remove it (make clean) or set PIPESGD_DEVICE"
else
  run "$PYTHON" -m venv "$VENV"
  if [ "$DRY_RUN" = 1 ]; then echo "    \$ echo $FLAVOUR > $(show "$FLAVOUR_FILE")"; else echo "$FLAVOUR" > "$FLAVOUR_FILE"; fi
fi

step "Python packages (torch $TORCH_VERSION $FLAVOUR, $TF_REQ, tools)"
# Horovod's run-time needs (cloudpickle, psutil, pyyaml, packaging, cffi) are installed here
# because its wheel is installed with --no-deps below (its metadata would pull a CUDA torch).
if [ "$DRY_RUN" = 1 ] || ! "$PY" - <<PYEOF 2>/dev/null
import importlib.metadata as m
torch = m.version("torch")
assert (torch if "$TORCH_MATCH" == "exact" else torch.split("+")[0]) == "$TORCH_WANT"
assert m.version("$TF_DIST").split("+")[0] == "$TF_VERSION"
for k in "${TOOLS[*]} ${GPU_DISTS[*]}".split():
    m.version(k)
PYEOF
then
  pip_install "${TORCH_PIP[@]}" "$TF_REQ" "${GPU_PIP[@]}" "${TOOLS[@]}"
else
  echo "    already installed"
fi

step "Horovod $HOROVOD_VERSION (PyTorch, TensorFlow, Gloo, MPI${GPU_OPERATIONS:+, $GPU_OPERATIONS})"
key="horovod-$HOROVOD_VERSION-p2-torch$TORCH_VERSION-tf$TF_VERSION-cp${PYVER/./}$KEY_SUFFIX"
wheel_dir="$CACHE_DIR/wheels/$key"
echo "    cache key $key"
installed_check="import horovod, horovod.torch, horovod.tensorflow"
[ -n "$GPU_OPERATIONS" ] && installed_check+="; assert horovod.torch.nccl_built()"

# The CUDA toolkit Horovod compiles with: sets cuda_home.
find_cuda_home() {
  local nvcc release
  if [ -n "${PIPESGD_CUDA_HOME:-}" ]; then
    cuda_home="$PIPESGD_CUDA_HOME"
  elif [ "$CUDA_TOOLKIT" = pip ]; then
    # pip's toolkit (site-packages/nvidia/cu13) has lib/ where nvcc looks in lib64/ next to its
    # bin/, and no unversioned libcudart.so for CMake's FindCUDAToolkit: lay out a CUDA home of
    # links in the venv (in the venv, because the build records its lib dir in the RUNPATH).
    local src="$SITE/nvidia/cu13"
    cuda_home="$VENV/cuda"
    # (a dry run has not run the pip step that installs it)
    [ "$DRY_RUN" = 1 ] || [ -x "$src/bin/nvcc" ] || fail "no nvcc at $src/bin (pip: cuda-toolkit[nvcc])"
    run rm -rf "$cuda_home"
    run mkdir -p "$cuda_home/bin" "$cuda_home/lib"
    run ln -s "$src"/bin/* "$cuda_home/bin/"
    run ln -s "$src"/lib/* "$cuda_home/lib/"
    run ln -s "$src/include" "$src/nvvm" "$cuda_home/"
    run ln -s lib "$cuda_home/lib64"
    run ln -sfn "libcudart.so.$CUDA_MAJOR" "$cuda_home/lib/libcudart.so"
  else
    nvcc="$(command -v nvcc || true)"
    if [ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ]; then nvcc=/usr/local/cuda/bin/nvcc; fi
    if [ -z "$nvcc" ]; then
      cuda_home="/usr/local/cuda"
      stop "no nvcc on PATH or in /usr/local/cuda: install a CUDA $CUDA_MAJOR toolkit or set PIPESGD_CUDA_HOME"
      return 0
    fi
    # nvcc's own idea of its toolkit (TOP), which a wrapper script on PATH does not show.
    cuda_home="$("$nvcc" --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)"
    cuda_home="$(cd "${cuda_home:-$(dirname "$nvcc")/..}" && pwd)"
  fi
  if [ -x "$cuda_home/bin/nvcc" ]; then
    release="$("$cuda_home/bin/nvcc" --version | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p')"
    [ "${release%%.*}" = "$CUDA_MAJOR" ] || stop "$cuda_home/bin/nvcc is CUDA $release; the $FLAVOUR flavour needs CUDA $CUDA_MAJOR (set PIPESGD_CUDA_HOME)"
  fi
}

# The GPU build's extra patch, CUDA toolkit and NCCL: adds to build_env.
prepare_gpu_build() {
  # TensorFlow's GPU build no longer exports stream_executor::gpu::AsGpuStreamValue, which
  # Horovod's TF ops only declare: the extension would not load. Define it in place, from the
  # Stream's platform_specific_handle() (a template, so it compiles where it is called).
  local as_stream='template <typename S> GpuStreamHandle AsGpuStreamValue(S* stream) { return static_cast<GpuStreamHandle>(stream->platform_specific_handle().stream); }'
  run sed -i "s|^GpuStreamHandle AsGpuStreamValue(Stream\* stream);\$|$as_stream|" "$src/horovod/tensorflow/mpi_ops.cc"
  check_patched "$src/horovod/tensorflow/mpi_ops.cc" "platform_specific_handle().stream"

  find_cuda_home
  # CMake takes nvcc from HOROVOD_CUDA_HOME; build_utils lists GPU architectures with the first
  # nvcc on PATH (so it must be the same one); torch's cpp_extension reads CUDA_HOME.
  build_env+=("HOROVOD_CUDA_HOME=$cuda_home" "CUDA_HOME=$cuda_home" "PATH=$cuda_home/bin:$PATH")

  if [ -n "${PIPESGD_NCCL_HOME:-}" ]; then
    build_env+=("HOROVOD_NCCL_HOME=$PIPESGD_NCCL_HOME")
    return 0
  fi
  local nccl="$SITE/nvidia/nccl"
  [ "$DRY_RUN" = 1 ] || { [ -f "$nccl/include/nccl.h" ] && [ -f "$nccl/lib/libnccl.so.2" ]; } \
    || fail "no NCCL wheel at $nccl (pip: ${GPU_PIP[0]})"
  # The wheel has libnccl.so.2 only; CMake's find_library wants the libnccl.so a -dev package
  # would add. The extensions find the wheel's library from their own place
  # (site-packages/horovod/<framework>/), whichever venv installs the cached wheel.
  run ln -sfn libnccl.so.2 "$nccl/lib/libnccl.so"
  build_env+=("HOROVOD_NCCL_INCLUDE=$nccl/include" "HOROVOD_NCCL_LIB=$nccl/lib" HOROVOD_NCCL_LINK=SHARED
              "LDFLAGS=${LDFLAGS:+$LDFLAGS }-Wl,-rpath,\$ORIGIN/../../nvidia/nccl/lib")
}

if [ "$DRY_RUN" = 0 ] && "$PY" -c "$installed_check" 2>/dev/null; then
  echo "    already installed"
else
  if [ "$DRY_RUN" = 1 ] || ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    echo "    no cached wheel at $wheel_dir: building from the sdist (several minutes)"
    if [ "$DRY_RUN" = 1 ]; then build="/tmp/tmp.XXXXXXXXXX"; else build="$(mktemp -d)"; fi
    run "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$build"
    run tar -xzf "$build"/horovod-"$HOROVOD_VERSION".tar.gz -C "$build"
    src="$build/horovod-$HOROVOD_VERSION"
    # Today's PyTorch and TensorFlow headers need C++17; Horovod 0.28.1 asks for C++14.
    run sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/g; s/-std=c++14/-std=c++17/g' \
      "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    # TensorFlow 2.21 removed the XLA custom-call API that xla_mpi_ops.cc builds on.
    run sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
    # horovodrun asks "was Horovod built with MPI?" by importing its first extension in a
    # subprocess: TensorFlow first costs ~3.5 s on every launch; PyTorch answers the same in ~1 s.
    run sed -i "s/^EXTENSIONS = \['tensorflow', 'torch', 'mxnet'\]/EXTENSIONS = ['torch', 'tensorflow', 'mxnet']/" \
      "$src/horovod/common/util.py"
    check_patched "$src/horovod/common/util.py" "^EXTENSIONS = \['torch'"
    build_env=(HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
               HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 "HOROVOD_GPU_OPERATIONS=$GPU_OPERATIONS")
    [ -z "$GPU_OPERATIONS" ] || prepare_gpu_build
    run mkdir -p "$wheel_dir"
    run_in "$src" env "${build_env[@]}" MAKEFLAGS="-j$(nproc)" \
      "$PY" -m pip wheel -q --no-build-isolation --no-deps . -w "$wheel_dir"
    run rm -rf "$build"
  else
    echo "    using cached wheel in $wheel_dir"
  fi
  run "$PY" -m pip install -q --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
fi

step "check the Horovod build"
if [ "$DRY_RUN" = 1 ]; then
  echo "    \$ $(show "$VENV/bin/horovodrun" --check-build)   # must list [X] ${BUILT_WITH[*]}"
else
  check="$(TF_CPP_MIN_LOG_LEVEL=3 "$VENV/bin/horovodrun" --check-build 2>/dev/null)"
  echo "$check" | sed -n '/Available/,$p' | sed 's/^ */    /'
  for want in "${BUILT_WITH[@]}"; do
    echo "$check" | grep -Eq "\[X\] +$want" || { echo "Horovod was built without $want" >&2; exit 1; }
  done
fi

step "pipesgd_hvd (editable)"
if [ "$DRY_RUN" = 1 ] || ! (cd / && "$PY" -c "import pipesgd_hvd" 2>/dev/null); then
  pip_install --no-deps --no-build-isolation -e "$ROOT"
fi

step "pipesgd_hvd's fused codec kernels (compression/_kernels.c)"
# The editable install above is skipped where the package already imports, so the kernels are
# built in place here too; it rebuilds only when the .c changed, in about a second. Optional: a
# machine without a compiler runs the unfused reference codecs (pipesgd_hvd.compression.kernels).
if [ "$DRY_RUN" = 1 ]; then
  echo "    \$ cd $ROOT && $PY setup.py -q build_ext --inplace"
else
  (cd "$ROOT" && "$PY" setup.py -q build_ext --inplace 2>&1 | { grep -v "^running\|^copying\|^$" || true; }) \
    || echo "    could not build the kernels: the codecs run their unfused reference"
fi

step "done"
