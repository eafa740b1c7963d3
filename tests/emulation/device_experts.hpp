// SPDX-License-Identifier: Apache-2.0
#pragma once
// The device tests' experts: the shadow cases' (scale_bias_experts, shadow_cases.hpp) with
// parameters and gradients in a back-end's memory, run as kernels on the back-end each call is
// given; and the check that a pattern on GPUs equals the same pattern on host ranks.

#include "../patterns/shadow_cases.hpp"
#include "emulated_ranks.hpp"

#include <moecomm/comm/inproc.hpp>

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

// `pattern(be, comm, c, in)` -> layer_result, run on in-process host ranks and on GPUs placed as
// `Placement` says.
template <class Placement, class Pattern>
void check_emulated_equals_host(shadow_case const& c, Pattern const& pattern) {
  CAPTURE(c.ranks);
  auto const in = make_shadow_inputs<float>(c);
  std::vector<layer_result<float>> want(static_cast<std::size_t>(c.ranks)), got(want.size());
  moecomm::inproc_world const world(c.ranks, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    want[static_cast<std::size_t>(comm.rank())] = pattern(moecomm::host_backend{}, comm, c, in);
  });
  run_device_ranks<Placement>(c.ranks, [&](auto& rank) {
    got[static_cast<std::size_t>(rank.comm.rank())] = pattern(rank.be, rank.comm, c, in);
  });
  for (std::int32_t r = 0; r < c.ranks; ++r) {
    CAPTURE(r);
    if (got[static_cast<std::size_t>(r)].out.empty() && want[static_cast<std::size_t>(r)].out.size() > 0) continue;  // reported
    check_same_result(got[static_cast<std::size_t>(r)], want[static_cast<std::size_t>(r)], r, c);
  }
  auto const seen = take_violations();
  CHECK_MESSAGE(seen.empty(), "the emulation saw ", seen.size(), " broken contracts, the first: ", seen.empty() ? "" : seen.front());
}

}  // namespace test
