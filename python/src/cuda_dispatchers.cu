// SPDX-License-Identifier: Apache-2.0
// moecomm._C's token dispatchers on CUDA tensors (MOECOMM_PYTHON_CUDA): every exchange and capacity
// policy on cuda_backend over torch's current stream, rows of float32, float16 or bfloat16.

#include "capacity_spec.hpp"
#include "cuda_layers.hpp"
#include "cuda_setup.cuh"
#include "dispatcher_handle.hpp"

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

namespace moecomm_python {
namespace {

// The token dispatcher on GPU `device` (rows of any dtype the CUDA back-end takes; the dtype is the
// rows'), its NCCL communicator bootstrapped through `store` as on_nccl's.
std::unique_ptr<dispatcher_handle> make_cuda_dispatcher(std::string const& exchange, py::object const& store, std::int32_t rank,
                                                        std::int32_t size, c10::DeviceIndex device, std::int32_t num_experts,
                                                        std::int32_t ranks_per_node, capacity_spec const& capacity, bool checks,
                                                        double timeout) {
  char const* const op = "moecomm.Dispatcher (CUDA)";
  require_exchange(exchange, op);
  auto [be, comm] = on_nccl(store, rank, size, device, timeout);
  return make_dispatcher_of(exchange, be, std::move(comm), ranks_per_node, num_experts, capacity, moecomm::routing_checks{checks, false},
                            op);
}

}  // namespace

void bind_cuda_dispatchers(py::module_& m) {
  m.def("make_cuda_dispatcher", &make_cuda_dispatcher, py::arg("exchange"), py::arg("store"), py::arg("rank"), py::arg("size"),
        py::arg("device"), py::arg("num_experts"), py::arg("ranks_per_node"), py::arg("capacity"), py::arg("checks"),
        py::arg("timeout"));
}

}  // namespace moecomm_python
