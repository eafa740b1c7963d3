// SPDX-License-Identifier: Apache-2.0
// expect-error: parameter_count() must be a const member function: std::int64_t parameter_count() const
// The trap: without const, the experts used to be taken for a callable.
#include "../layer_calls.hpp"

struct experts {
  std::int64_t parameter_count() { return 1; }
  float* parameters(std::int32_t) { return nullptr; }
  float* gradients(std::int32_t) { return nullptr; }
  void forward(float const*, interface_case::matrix_view<float const>, interface_case::matrix_view<float>) const {}
};

void step(interface_case::plain_layer& layer, experts& e) { interface_case::forward(layer, e); }
