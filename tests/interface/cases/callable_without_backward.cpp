// SPDX-License-Identifier: Apache-2.0
// expect-error: the layer's backward needs callable experts with the overload void operator()(std::int32_t l, matrix_view<T const> in, matrix_view<T const> d_out, matrix_view<T> d_in)
#include "../layer_calls.hpp"

struct experts {
  void operator()(std::int32_t, interface_case::matrix_view<float const>, interface_case::matrix_view<float>) const {}
};

void step(interface_case::plain_layer& layer, experts& e) {
  interface_case::forward(layer, e);
  interface_case::backward(layer, e);
}
