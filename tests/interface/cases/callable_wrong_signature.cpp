// SPDX-License-Identifier: Apache-2.0
// expect-error: experts must be callable as void operator()(std::int32_t l, matrix_view<T const> in, matrix_view<T> out)
// Rows of double given to a layer of float.
#include "../layer_calls.hpp"

struct experts {
  void operator()(std::int32_t, interface_case::matrix_view<double const>, interface_case::matrix_view<double>) const {}
};

void step(interface_case::plain_layer& layer, experts& e) { interface_case::forward(layer, e); }
