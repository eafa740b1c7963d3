// SPDX-License-Identifier: Apache-2.0
#pragma once
// The extension's CUDA part (cuda_layers.cu, cuda_dispatchers.cu), compiled where torch is a CUDA build and nvcc and NCCL
// are found (MOECOMM_PYTHON_CUDA).

#include <torch/extension.h>

namespace moecomm_python {

// Adds CudaRouter, make_cuda_layer, make_cuda_dispatcher and has_cuda = True to the module.
void bind_cuda(pybind11::module_& m);
// Adds make_cuda_dispatcher (called by bind_cuda).
void bind_cuda_dispatchers(pybind11::module_& m);

}  // namespace moecomm_python
