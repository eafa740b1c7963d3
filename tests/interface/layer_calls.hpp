// SPDX-License-Identifier: Apache-2.0
#pragma once
// What every case under cases/ shares: a plain and a shadowing layer over in-process ranks, and
// calls of their forward and backward with the case's experts. The cases are only compiled
// (-fsyntax-only), never run, so the arguments are empty views.

#include <moecomm/backend/host.hpp>
#include <moecomm/comm/inproc.hpp>
#include <moecomm/patterns/expert_parallel.hpp>
#include <moecomm/patterns/fastermoe.hpp>

#include <cstdint>

namespace interface_case {

using moecomm::matrix_view;
using plain_layer = moecomm::expert_parallel_layer<float, moecomm::host_backend, moecomm::inproc_communicator>;
using shadowing_layer =
    moecomm::expert_parallel_layer<float, moecomm::host_backend, moecomm::inproc_communicator, moecomm::dropless,
                                   moecomm::flat, moecomm::weighted, moecomm::fastermoe_shadowing<>>;

template <class Layer, class Experts>
void forward(Layer& layer, Experts& experts) {
  layer.forward(moecomm::routing_view{}, matrix_view<float const>{}, matrix_view<float>{}, experts);
}

template <class Layer, class Experts>
void backward(Layer& layer, Experts& experts) {
  layer.backward(matrix_view<float const>{}, matrix_view<float>{}, moecomm::not_needed, experts);
}

// Parametric experts with every member declared as patterns/experts.hpp documents.
struct parametric_experts {
  [[nodiscard]] std::int64_t parameter_count() const { return 1; }
  float* parameters(std::int32_t) { return nullptr; }
  float* gradients(std::int32_t) { return nullptr; }
  void forward(float const*, matrix_view<float const>, matrix_view<float>) const {}
  void backward(float const*, matrix_view<float const>, matrix_view<float const>, matrix_view<float>, float*) const {}
};

}  // namespace interface_case
