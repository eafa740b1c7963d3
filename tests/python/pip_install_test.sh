#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `pip install --no-build-isolation <source>` into a fresh virtual environment made with
# --system-site-packages (so it sees the system's torch), then one MoE layer step, forward and
# backward, from a folder outside the source. Exit 77 (skipped) when the environment cannot be made or
# scikit-build-core cannot be installed (no network to PyPI).
#   usage: pip_install_test.sh <python3> <source folder>
set -euo pipefail
python=$1
source=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if ! "$python" -m venv --system-site-packages "$work/venv"; then
  echo "SKIPPED: $python cannot make a virtual environment (Debian: python3-venv)"
  exit 77
fi
venv_python=$work/venv/bin/python
if ! "$venv_python" -c "import scikit_build_core" 2>/dev/null &&
   ! "$venv_python" -m pip install -q "scikit-build-core>=0.10"; then
  echo "SKIPPED: scikit-build-core is not installed and could not be installed (no network to PyPI?)"
  exit 77
fi
"$venv_python" -m pip install --no-build-isolation "$source"

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
