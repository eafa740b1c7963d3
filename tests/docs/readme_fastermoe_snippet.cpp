// SPDX-License-Identifier: Apache-2.0
// README's FasterMoE snippet (between the markers), run on 8 in-process ranks: expert 0 is
// shadowed, and every output and gradient equals its closed form exactly (dyadic payloads, so every
// sum is exact whichever rank computes it, as plain expert parallelism's are).

#include "../support/test_support.hpp"

#include <moecomm/moecomm.hpp>

#include <vector>

namespace test {

struct fastermoe_snippet_results {
  std::vector<float> out, d_x, d_w, grads;
};

TEST_CASE("README FasterMoE snippet runs: expert 0 shadowed, every output and gradient exact") {
  std::int64_t const H = 16;
  moecomm::fastermoe_cost_params model;  // a slow GEMM: hot experts are worth shadowing
  model.gemm_flops = 1e8;
  model.net_bandwidth = model.local_bandwidth = 1e9;
  std::vector<fastermoe_snippet_results> results(8);
  std::vector<std::vector<std::int32_t>> shadowed(8);
  // example-begin readme-fastermoe
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
  using fastermoe = moecomm::fastermoe_shadowing<>;  // Algorithm 1 every step; replicas point to point
  moecomm::inproc_world const world(/*ranks=*/8);
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups groups(comm, moecomm::topology(8, /*ranks_per_node=*/4));
    auto layer = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, /*num_experts=*/16, H,
                                                            moecomm::smart_schedule{/*group_size=*/4}, fastermoe{model});
    std::int32_t const first = comm.rank() * 2;  // 16 experts over 8 ranks: 2 local experts each
    scaled_experts experts{{float(first + 1), float(first + 2)}, {0.0f, 0.0f}};
    std::int64_t const T = 48;  // this rank's tokens: expert 0 in every first slot (hot), the second spread
    std::vector<std::int32_t> topk_idx(T * 2);
    std::vector<float> topk_weights(T * 2, 0.5f), x(T * H), out(T * H), d_out(T * H, 0.25f), d_x(T * H), d_w(T * 2);
    for (std::int64_t t = 0; t < T; ++t) {
      topk_idx[2 * t] = 0;
      topk_idx[2 * t + 1] = std::int32_t((t + comm.rank()) % 15 + 1);
    }
    for (std::int64_t i = 0; i < T * H; ++i) x[i] = float(i % 8) - 4.0f;
    moecomm::routing_view const routing{topk_idx.data(), topk_weights.data(), T, /*top_k=*/2};
    layer.forward(routing, moecomm::matrix_view<float const>{x.data(), T, H}, moecomm::matrix_view<float>{out.data(), T, H},
                  experts);
    layer.backward(moecomm::matrix_view<float const>{d_out.data(), T, H}, moecomm::matrix_view<float>{d_x.data(), T, H},
                   moecomm::array_view<float>(d_w), experts);  // the owners' gradients include their replicas'
    shadowed[comm.rank()] = layer.shadow_state().decision().shadowed;  // this step's hot experts
    results[comm.rank()] = {out, d_x, d_w, experts.g};
  });
  // example-end readme-fastermoe
  // The closed form (every value dyadic, every sum exact): each token row is x_h = h % 8 - 4, its
  // experts are 0 and e2 = (t + r) % 15 + 1 with weights 1/2, expert e scales by e + 1, d_out = 1/4.
  CHECK(shadowed[0] == std::vector<std::int32_t>{0});
  std::vector<float> slots(16, 0.0f);  // slots per expert, over every rank
  for (int r = 0; r < 8; ++r)
    for (std::int64_t t = 0; t < 48; ++t) {
      slots[0] += 1.0f;
      slots[static_cast<std::size_t>((t + r) % 15 + 1)] += 1.0f;
    }
  for (int r = 0; r < 8; ++r) {
    CAPTURE(r);
    for (std::int64_t t = 0; t < 48; ++t) {
      float const p2 = float((t + r) % 15 + 2);  // expert e2's scale
      for (std::int64_t h = 0; h < H; ++h) {
        CHECK(results[r].out[static_cast<std::size_t>(t * H + h)] == 0.5f * (1.0f + p2) * float(h % 8 - 4));
        CHECK(results[r].d_x[static_cast<std::size_t>(t * H + h)] == 0.5f * (1.0f + p2) * 0.25f);
      }
      CHECK(results[r].d_w[static_cast<std::size_t>(2 * t)] == -2.0f);  // <p x, d_out> = p * (-8) / 4
      CHECK(results[r].d_w[static_cast<std::size_t>(2 * t + 1)] == -2.0f * p2);
    }
    for (int l = 0; l < 2; ++l)  // each slot adds w <x, d_out> = -1 to its expert's gradient
      CHECK(results[r].grads[static_cast<std::size_t>(l)] == -slots[static_cast<std::size_t>(2 * r + l)]);
  }
}

}  // namespace test
