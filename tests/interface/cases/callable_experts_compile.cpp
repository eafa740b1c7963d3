// SPDX-License-Identifier: Apache-2.0
// expect: compiles
// Callable experts: a struct with both overloads, and a forward-only lambda used in forward only.
#include "../layer_calls.hpp"

using interface_case::matrix_view;

struct experts {
  void operator()(std::int32_t, matrix_view<float const>, matrix_view<float>) const {}
  void operator()(std::int32_t, matrix_view<float const>, matrix_view<float const>, matrix_view<float>) const {}
};

void step(interface_case::plain_layer& layer, experts& e) {
  interface_case::forward(layer, e);
  interface_case::backward(layer, e);
  auto forward_only = [](std::int32_t, matrix_view<float const>, matrix_view<float>) {};
  interface_case::forward(layer, forward_only);
}
