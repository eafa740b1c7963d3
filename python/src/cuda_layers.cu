// SPDX-License-Identifier: Apache-2.0
// moecomm._C on CUDA tensors, built where torch is a CUDA build and nvcc and NCCL are found
// (MOECOMM_PYTHON_CUDA): the layers of every pattern, dropless, on cuda_backend over torch's current
// stream, through a moecomm NCCL communicator bootstrapped from the group's store (cuda_setup.cuh),
// with float32, float16 or bfloat16 rows; and the router on CUDA logits. The token dispatchers are
// in cuda_dispatchers.cu (a translation unit of their own: the two compile in parallel).

#include "cuda_layers.hpp"
#include "cuda_setup.cuh"
#include "layer_handle.hpp"

#include <moecomm/moecomm.cuh>
#include <moecomm/torch/cuda.cuh>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

namespace moecomm_python {
namespace {

// `store`: a store of this layer's own (a PrefixStore of the group's), where the group's rank 0
// publishes the NCCL id.
std::unique_ptr<layer_handle> make_cuda_layer(std::string const& pattern, py::object const& store, std::int32_t rank,
                                              std::int32_t size, std::string const& dtype, std::int32_t num_experts,
                                              std::int64_t hidden, std::int64_t inner, std::string const& activation,
                                              py::object const& expert, at::Tensor const& experts, std::int32_t ranks_per_node,
                                              bool checks, double timeout) {
  char const* const op = "moecomm.MoELayer (CUDA)";
  moecomm::detail::require(pattern == "plain" || pattern == "hierarchical" || pattern == "dedup" || pattern == "fastermoe" ||
                               pattern == "finemoe",
                           op, "pattern = '", pattern, "' is not one of plain, hierarchical, dedup, fastermoe, finemoe");
  moecomm::detail::require(dtype == "float32" || dtype == "bfloat16" || dtype == "float16", op, "dtype = '", dtype,
                           "' is not one of float32, bfloat16, float16");
  moecomm::detail::require(experts.is_cuda(), op, "experts is on ", experts.device().str(), "; the layer runs on CUDA");
  moecomm::detail::require(num_experts % size == 0, op, "num_experts = ", num_experts, " is not a multiple of the group's size ",
                           size);
  moecomm::detail::require(ranks_per_node >= 1 && size % ranks_per_node == 0, op, "ranks_per_node = ", ranks_per_node,
                           " does not divide the group's size ", size);
  expert_fn fn = expert_function(op, hidden, inner, activation, expert, experts);
  auto on_gpu = on_nccl(store, rank, size, experts.device().index(), timeout);
  moecomm::routing_checks const routing_checks{checks, false};
  auto const layer = [&](auto row) {
    using T = decltype(row);
    moecomm::libtorch::torch_experts<expert_fn, T> ex(std::move(fn), experts);
    return pattern_layer<T>(pattern, on_gpu.first, std::move(on_gpu.second), ranks_per_node, num_experts, hidden, inner, moecomm::dropless{},
                            routing_checks, std::move(ex));
  };
  if (dtype == "bfloat16") return layer(__nv_bfloat16{});
  if (dtype == "float16") return layer(__half{});
  return layer(float{});
}

}  // namespace

void bind_cuda(py::module_& m) {
  bind_router<moecomm::cuda_backend>(m, "CudaRouter", [] { return moecomm::libtorch::current_stream_backend(); },
                                     "(topk_weights [T][K], topk_idx [T][K] int32, losses [aux, z]) of CUDA logits [T][E]");
  m.def("make_cuda_layer", &make_cuda_layer, py::arg("pattern"), py::arg("store"), py::arg("rank"), py::arg("size"),
        py::arg("dtype"), py::arg("num_experts"), py::arg("hidden"), py::arg("inner"), py::arg("activation"), py::arg("expert"),
        py::arg("experts"), py::arg("ranks_per_node"), py::arg("checks"), py::arg("timeout"));
  bind_cuda_dispatchers(m);
  m.attr("has_cuda") = true;
}

}  // namespace moecomm_python
