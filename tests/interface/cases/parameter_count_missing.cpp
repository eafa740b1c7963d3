// SPDX-License-Identifier: Apache-2.0
// expect-error: parametric experts need std::int64_t parameter_count() const
// Some parametric members but not all: diagnosed as broken parametric experts, not as a callable.
#include "../layer_calls.hpp"

struct experts {
  float* parameters(std::int32_t) { return nullptr; }
  float* gradients(std::int32_t) { return nullptr; }
  void forward(float const*, interface_case::matrix_view<float const>, interface_case::matrix_view<float>) const {}
};

void step(interface_case::plain_layer& layer, experts& e) { interface_case::forward(layer, e); }
