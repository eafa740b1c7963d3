// SPDX-License-Identifier: Apache-2.0
// expect-error: parametric experts need void forward(P const* params, matrix_view<T const> in, matrix_view<T> out)
// The input rows taken as writable: the layer hands experts read-only views of their input.
#include "../layer_calls.hpp"

struct experts {
  [[nodiscard]] std::int64_t parameter_count() const { return 1; }
  float* parameters(std::int32_t) { return nullptr; }
  float* gradients(std::int32_t) { return nullptr; }
  void forward(float const*, interface_case::matrix_view<float>, interface_case::matrix_view<float>) const {}
};

void step(interface_case::shadowing_layer& layer, experts& e) { interface_case::forward(layer, e); }
