// SPDX-License-Identifier: Apache-2.0
// expect-error: parametric experts need P* parameters(std::int32_t l), returning float* or double*
#include "../layer_calls.hpp"

#include <vector>

struct experts {
  std::vector<float> params;
  [[nodiscard]] std::int64_t parameter_count() const { return 1; }
  std::vector<float>& parameters(std::int32_t) { return params; }
  float* gradients(std::int32_t) { return nullptr; }
  void forward(float const*, interface_case::matrix_view<float const>, interface_case::matrix_view<float>) const {}
};

void step(interface_case::shadowing_layer& layer, experts& e) { interface_case::forward(layer, e); }
