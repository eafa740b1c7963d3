// SPDX-License-Identifier: Apache-2.0
// expect-error: parametric experts need void backward(P const* params, matrix_view<T const> in, matrix_view<T const> d_out, matrix_view<T> d_in, P* d_params)
#include "../layer_calls.hpp"

struct experts {
  [[nodiscard]] std::int64_t parameter_count() const { return 1; }
  float* parameters(std::int32_t) { return nullptr; }
  float* gradients(std::int32_t) { return nullptr; }
  void forward(float const*, interface_case::matrix_view<float const>, interface_case::matrix_view<float>) const {}
};

void step(interface_case::shadowing_layer& layer, experts& e) {
  interface_case::forward(layer, e);
  interface_case::backward(layer, e);
}
