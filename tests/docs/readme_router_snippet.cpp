// SPDX-License-Identifier: Apache-2.0
// docs/guide.md's router snippet (between the markers), run and checked bit for bit against the router
// oracle (tests/support/router_oracle.hpp): the selection, the weights, the losses and the logits'
// gradient with the aux loss in it.

#include "../support/router_oracle.hpp"
#include "../support/test_support.hpp"

#include <moecomm/moecomm.hpp>

#include <cmath>
#include <vector>

namespace test {

TEST_CASE("README router snippet runs and equals the router oracle") {
  // example-begin readme-router
  std::int64_t const T = 6, E = 4;  // 6 tokens; logits = x W_g, the caller's gate
  std::vector<float> logits(T * E);
  for (std::int64_t i = 0; i < T * E; ++i) logits[i] = std::sin(float(i));
  moecomm::host_backend const be;
  moecomm::router_config config;  // Megatron-LM's TopKRouter defaults: top-k of the logits, softmax over the k
  config.top_k = 2;
  config.aux_loss_coeff = 1e-2f;  // moe_aux_loss_coeff: the aux loss's gradient joins the logits' in the backward
  moecomm::router_state<moecomm::host_backend> state;  // what the backward reads: keep it until then
  std::vector<std::int32_t> topk_idx(T * 2);
  std::vector<float> topk_weights(T * 2);
  moecomm::router_losses losses;  // aux and z, for logging
  moecomm::router_forward(be, moecomm::matrix_view<float const>{logits.data(), T, E},
                          moecomm::matrix_view<std::int32_t>{topk_idx.data(), T, 2},
                          moecomm::matrix_view<float>{topk_weights.data(), T, 2}, moecomm::not_needed,
                          moecomm::array_view<moecomm::router_losses>{&losses, 1}, state, config);
  moecomm::routing_view const routing{topk_idx.data(), topk_weights.data(), T, /*top_k=*/2};  // the layer's input
  // ... layer.forward(routing, x, out, experts); layer.backward(d_out, d_x, d_weights, experts) ...
  std::vector<float> d_weights(T * 2, 1.0f), d_logits(T * E);  // d_weights: from the layer's backward
  moecomm::router_backward(be, state, moecomm::matrix_view<float const>{d_weights.data(), T, 2},
                           moecomm::matrix_view<float>{d_logits.data(), T, E});  // then the gate's backward
  // example-end readme-router
  oracle::router_options o;
  o.top_k = 2;
  o.aux_coeff = 1e-2f;
  auto const want = oracle::router_forward(logits, T, static_cast<std::int32_t>(E), o);
  CHECK(topk_idx == want.idx);
  CHECK(topk_weights == want.w);
  CHECK(losses.aux == want.aux);
  CHECK(losses.z == want.z);
  // The routing is a valid input of the permute plan: every id in range, no slot masked.
  CHECK(moecomm::make_permute_plan(be, routing, static_cast<std::int32_t>(E)).num_rows() == T * 2);
  CHECK(d_logits == oracle::router_backward(logits, T, static_cast<std::int32_t>(E), o, d_weights));
  bool moved = false;  // weights summing to 1 have no gradient: only the aux loss moves the logits
  for (float g : d_logits) moved = moved || g != 0.0f;
  CHECK(moved);
}

}  // namespace test
