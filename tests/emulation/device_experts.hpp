// SPDX-License-Identifier: Apache-2.0
#pragma once
// The shadow cases' experts (scale_bias_experts, shadow_cases.hpp) with parameters and gradients in
// a back-end's memory, run as kernels on the back-end each call is given: the device tests' experts.

#include "../patterns/shadow_cases.hpp"

#include <cstdint>
#include <vector>

namespace test {

// scale_bias_experts with parameters and gradients in the back-end's memory, run as kernels.
template <class T, class Backend>
struct kernel_scale_bias_experts {
  Backend be;
  std::int64_t hidden;
  typename Backend::template buffer_type<float> params, grads;

  kernel_scale_bias_experts(Backend const& b, scale_bias_experts<T> const& host)
      : be(b), hidden(host.hidden), params(upload(b, host.params)), grads(upload(b, host.grads)) {}
  [[nodiscard]] std::int64_t parameter_count() const { return 2 * hidden; }
  float* parameters(std::int32_t l) { return params.data() + l * 2 * hidden; }
  float* gradients(std::int32_t l) { return grads.data() + l * 2 * hidden; }
  // On the back-end the layer gives each call: the lane's, where the call overlaps an exchange.
  void forward(float const* p, moecomm::matrix_view<T const> in, moecomm::matrix_view<T> out, Backend const& on) const {
    on.for_each_index(in.rows * hidden, scale_bias_forward_kernel<T>{in, out, p, hidden});
  }
  void backward(float const* p, moecomm::matrix_view<T const> in, moecomm::matrix_view<T const> d_out, moecomm::matrix_view<T> d_in,
                float* d_p, Backend const& on) const {
    on.for_each_index(in.rows * hidden, scale_bias_input_grad_kernel<T>{d_out, d_in, p, hidden});
    on.for_each_index(hidden, scale_bias_param_grad_kernel<T>{in, d_out, d_p, in.rows, hidden});
  }
  [[nodiscard]] std::vector<float> gradients_on_host() const { return download(be, grads.data(), grads.size()); }
};

}  // namespace test
