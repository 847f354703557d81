#!/bin/sh
# Build and install horovod 0.28.1 (PyTorch + Gloo, CPU, no MPI) into one
# Python environment, against the torch already installed there.
#
#   usage: PYTHON=/path/to/venv/bin/python sh plugins/horovod/scripts/install-horovod.sh
#
# Why a build script: horovod 0.28.1, the newest release, pins C++14 in its
# CMake files and PyTorch >= 2.1 headers need C++17, so a plain
# `pip install horovod` fails to compile. ./cxx17 is a compiler front that
# raises the standard. The build takes 2-5 minutes on 2 cores; pip caches
# the wheel it builds, so a second run reuses it in seconds.
#
# Needs: torch installed in that environment first (pin it: torch==2.13.0),
# cmake (installed here from PyPI when missing) and a C++ compiler.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python}
if "$PY" -c "import horovod.torch" 2>/dev/null; then
  echo "horovod is already installed in $PY"
  exit 0
fi
"$PY" -c "import torch" || { echo "install torch (torch==2.13.0) into $PY first" >&2; exit 1; }
# cmake 4 refuses horovod's bundled gloo (cmake_minimum_required < 3.5):
# take cmake 3 from PyPI, and tell a cmake 4 found first to accept it anyway.
"$PY" -m pip install -q "cmake>=3.13,<4" setuptools wheel packaging psutil pyyaml cloudpickle cffi
CXX_REAL=$(command -v c++) \
CXX="$here/cxx17" \
HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo \
MAKEFLAGS="-j$(nproc)" CMAKE_POLICY_VERSION_MINIMUM=3.5 \
  "$PY" -m pip install --no-build-isolation horovod==0.28.1
"$PY" -c "import horovod.torch"
echo "horovod 0.28.1 installed in $PY"
