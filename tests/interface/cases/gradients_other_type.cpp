// SPDX-License-Identifier: Apache-2.0
// expect-error: parametric experts need P* gradients(std::int32_t l), returning the same P* as parameters(l)
#include "../layer_calls.hpp"

struct experts {
  [[nodiscard]] std::int64_t parameter_count() const { return 1; }
  float* parameters(std::int32_t) { return nullptr; }
  double* gradients(std::int32_t) { return nullptr; }
  void forward(float const*, interface_case::matrix_view<float const>, interface_case::matrix_view<float>) const {}
};

void step(interface_case::plain_layer& layer, experts& e) { interface_case::forward(layer, e); }
