// SPDX-License-Identifier: Apache-2.0
// expect-error: a shadowing layer moves expert parameters, so it needs parametric experts, not a callable
// Used to give one static_assert followed by cascading errors from the layer's body.
#include "../layer_calls.hpp"

struct experts {
  void operator()(std::int32_t, interface_case::matrix_view<float const>, interface_case::matrix_view<float>) const {}
};

void step(interface_case::shadowing_layer& layer, experts& e) { interface_case::forward(layer, e); }
