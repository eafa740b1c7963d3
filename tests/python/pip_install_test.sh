#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `pip install --no-build-isolation <source>` into a fresh virtual environment, then one MoE layer
# step, forward and backward, from a folder outside the source.
#
#   pip_install_test.sh <python3> <source folder>
#       The environment is made with --system-site-packages, so it sees the system's torch (Debian's
#       python3-torch 1.13).
#   pip_install_test.sh <python3> <source folder> --torch VERSION <environment folder>
#       The environment (made once in <environment folder>, kept for the next run) sees nothing of the
#       system's: torch VERSION comes from PyPI, as a user's `pip install torch` gets it (a CUDA
#       build, whose GPU libraries are looked up in /usr/local/cuda/lib64 and in the few wheels
#       installed beside it; its CPU side is what runs here, and the extension's CUDA part is compiled,
#       for sm_80). After the step, the whole pytest suite (tests/python) runs against the installed
#       package (its CUDA tests skip without a GPU).
#
# Exit 77 (skipped) when the environment cannot be made or a package cannot be installed (no network
# to PyPI), or when that torch cannot be imported here.
set -euo pipefail
python=$1
source=$2
torch_version=""
if [[ ${3:-} == --torch ]]; then
  torch_version=$4
  env_dir=$5
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
skip() {
  echo "SKIPPED: $*"
  exit 77
}

if [[ -z $torch_version ]]; then
  env_dir=$work/venv
  "$python" -m venv --system-site-packages "$env_dir" || skip "$python cannot make a virtual environment (Debian: python3-venv)"
  venv_python=$env_dir/bin/python
  "$venv_python" -c "import scikit_build_core" 2>/dev/null || "$venv_python" -m pip install -q "scikit-build-core>=0.10" ||
    skip "scikit-build-core is not installed and could not be installed (no network to PyPI?)"
else
  venv_python=$env_dir/bin/python
  if [[ ! -f $env_dir/.torch-$torch_version ]]; then
    rm -rf "$env_dir"
    "$python" -m venv "$env_dir" || skip "$python cannot make a virtual environment (Debian: python3-venv)"
    # torch without its CUDA dependencies (gigabytes): of those, only the libraries the CUDA toolkit
    # here lacks, at the versions torch $torch_version names.
    "$venv_python" -m pip install -q --no-deps "torch==$torch_version" nvidia-cufile nvidia-cusparselt-cu13==0.8.0 \
      nvidia-nvshmem-cu13==3.4.5 || skip "torch $torch_version could not be installed from PyPI"
    "$venv_python" -m pip install -q filelock typing-extensions sympy networkx jinja2 fsspec numpy pytest \
      "scikit-build-core>=0.10" pybind11 || skip "torch's Python dependencies could not be installed from PyPI"
    touch "$env_dir/.torch-$torch_version"
  fi
  nvidia=$("$venv_python" -c "import os, nvidia; print(os.path.dirname(nvidia.__path__[0]))")/nvidia
  export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$nvidia/cu13/lib:$nvidia/cusparselt/lib:$nvidia/nvshmem/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  "$venv_python" -c "import torch" || skip "torch $torch_version cannot be imported here (its CUDA libraries are missing)"
  "$venv_python" -m pip uninstall -q -y moecomm 2>/dev/null || true
  export TORCH_CUDA_ARCH_LIST=8.0  # torch is a CUDA build: its part of the extension for one architecture
fi
"$venv_python" -m pip install -q --no-build-isolation "$source"

cd "$work"
"$venv_python" - <<'PY'
import os
import tempfile

import torch
import torch.distributed as dist

import moecomm

where = os.path.dirname(moecomm.__file__)
assert "site-packages" in where, f"moecomm imported from {where}, not from the virtual environment"
store = tempfile.mkdtemp()
dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
torch.manual_seed(0)
moe = moecomm.MoELayer(hidden=8, ffn_hidden=16, num_experts=4, top_k=2)
gate = torch.nn.Linear(8, 4, bias=False)
x = torch.randn(5, 8, requires_grad=True)
y = moe(x, gate(x))
y.pow(2).sum().backward()
assert y.shape == (5, 8) and torch.isfinite(y).all()
assert moe.experts.grad.abs().sum() > 0 and gate.weight.grad.abs().sum() > 0 and x.grad.abs().sum() > 0
dist.destroy_process_group()
print(f"pip install: moecomm {where} trains one step on torch {torch.__version__}")
PY
if [[ -n $torch_version ]]; then
  OMP_NUM_THREADS=1 "$venv_python" -m pytest -q -p no:cacheprovider "$source/tests/python"
fi
