// SPDX-License-Identifier: Apache-2.0
// expect: compiles
// Experts that take the back-end each call runs on, and the grouped form (patterns/experts.hpp):
// callable and parametric, in a plain and a shadowing layer.
#include "../layer_calls.hpp"

struct callable_on_backend {
  void operator()(std::int32_t, interface_case::matrix_view<float const>, interface_case::matrix_view<float>,
                  moecomm::host_backend const&) const {}
  void operator()(std::int32_t, interface_case::matrix_view<float const>, interface_case::matrix_view<float const>,
                  interface_case::matrix_view<float>, moecomm::host_backend const&) const {}
  void forward_grouped(moecomm::grouped_rows<float> const&, moecomm::host_backend const&) const {}
  void backward_grouped(moecomm::grouped_gradient_rows<float> const&, moecomm::host_backend const&) const {}
};

struct parametric_on_backend : interface_case::parametric_experts {
  template <class Backend>
  void forward(float const*, interface_case::matrix_view<float const>, interface_case::matrix_view<float>, Backend const&) const {}
  template <class Backend>
  void backward(float const*, interface_case::matrix_view<float const>, interface_case::matrix_view<float const>,
                interface_case::matrix_view<float>, float*, Backend const&) const {}
};

void step(interface_case::plain_layer& plain, interface_case::shadowing_layer& shadowing, callable_on_backend& c,
          parametric_on_backend& p) {
  interface_case::forward(plain, c);
  interface_case::backward(plain, c);
  interface_case::forward(shadowing, p);
  interface_case::backward(shadowing, p);
}
