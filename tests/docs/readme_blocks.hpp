// SPDX-License-Identifier: Apache-2.0
#pragma once
// The two building blocks the pattern guides' snippets share, shown once in docs/patterns/fastermoe.md:
// parametric experts (`scaled_experts`) and one rank's tokens for a step (`token_batch`). Like the
// snippets, they need the installed headers alone: nothing here may include a test header.

#include <moecomm/moecomm.hpp>

#include <cstdint>
#include <vector>

// example-begin readme-scaled-experts
struct scaled_experts {  // parametric experts (patterns/experts.hpp): expert e is y = p_e * x
  std::vector<float> p, g;  // this rank's local experts' parameters and gradients, one each
  std::int64_t parameter_count() const { return 1; }
  float* parameters(std::int32_t l) { return &p[l]; }
  float* gradients(std::int32_t l) { return &g[l]; }
  void forward(float const* w, moecomm::matrix_view<float const> in, moecomm::matrix_view<float> out) const {
    for (std::int64_t i = 0; i < in.rows * in.hidden; ++i) out.data[i] = *w * in.data[i];
  }
  void backward(float const* w, moecomm::matrix_view<float const> in, moecomm::matrix_view<float const> d_out,
                moecomm::matrix_view<float> d_in, float* d_w) const {
    for (std::int64_t i = 0; i < in.rows * in.hidden; ++i) {
      d_in.data[i] = *w * d_out.data[i];
      *d_w += in.data[i] * d_out.data[i];
    }
  }
};
// example-end readme-scaled-experts

// example-begin readme-token-batch
struct token_batch {  // one rank's T tokens for a step, each routed to 2 of E experts
  std::int64_t T, H;
  std::vector<std::int32_t> topk_idx;
  std::vector<float> topk_weights, x, out, d_out, d_x, d_w;
  token_batch(std::int64_t tokens, std::int64_t hidden, std::int32_t experts, std::int32_t seed)
      : T(tokens), H(hidden), topk_idx(T * 2), topk_weights(T * 2), x(T * H), out(T * H), d_out(T * H), d_x(T * H), d_w(T * 2) {
    for (std::int64_t t = 0; t < T; ++t) {  // experts 0 and 1 take most first slots (hot), the second spread
      std::int32_t const first = std::int32_t(t % 4 == 3 ? (t + seed) % experts : t % 2);
      topk_idx[2 * t] = first;
      topk_idx[2 * t + 1] = std::int32_t((first + 1 + (5 * t + seed) % (experts - 1)) % experts);
      topk_weights[2 * t] = 0.75f;
      topk_weights[2 * t + 1] = 0.25f;
    }
    for (std::int64_t i = 0; i < T * H; ++i) {  // small integers and quarters: every sum below is exact
      x[i] = float((i + i / H + seed) % 8) - 4.0f;
      d_out[i] = float((3 * i + seed) % 4) * 0.25f - 0.5f;
    }
  }
  moecomm::routing_view routing() const { return {topk_idx.data(), topk_weights.data(), T, /*top_k=*/2}; }
  moecomm::matrix_view<float> rows(std::vector<float>& v) { return {v.data(), T, H}; }  // x, out, d_out or d_x
};
// example-end readme-token-batch
