// SPDX-License-Identifier: Apache-2.0
#pragma once
// The extension's CUDA part (cuda_layers.cu), compiled where torch is a CUDA build and nvcc and NCCL
// are found (MOECOMM_PYTHON_CUDA).

#include <torch/extension.h>

namespace moecomm_python {

// Adds CudaRouter, make_cuda_layer and has_cuda = True to the module.
void bind_cuda(pybind11::module_& m);

}  // namespace moecomm_python
