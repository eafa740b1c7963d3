// SPDX-License-Identifier: Apache-2.0
// The README's expert-parallel layer snippet (between the markers), run on 8 in-process ranks and
// checked against the layer oracle of tests/patterns/layer_cases.hpp.

#include "../patterns/layer_cases.hpp"

#include <moecomm/comm/inproc.hpp>

namespace test {

TEST_CASE("README layer snippet runs") {
  std::int64_t const H = 32;
  struct rank_results {
    std::vector<float> out, d_x, d_w;
  };
  std::vector<rank_results> results(8);
  // example-begin readme-layer
  struct scale_by_expert {  // global expert e multiplies its rows by e + 1; its backward does the same
    std::int32_t first;     // the global id of this rank's local expert 0
    void operator()(std::int32_t l, moecomm::matrix_view<float const> in, moecomm::matrix_view<float> out) const {
      for (std::int64_t i = 0; i < in.rows * in.hidden; ++i) out.data[i] = in.data[i] * float(first + l + 1);
    }
    void operator()(std::int32_t l, moecomm::matrix_view<float const>, moecomm::matrix_view<float const> d_out,
                    moecomm::matrix_view<float> d_in) const {
      for (std::int64_t i = 0; i < d_out.rows * d_out.hidden; ++i) d_in.data[i] = d_out.data[i] * float(first + l + 1);
    }
  };
  moecomm::inproc_world const world(/*ranks=*/8);  // ranks as threads; MPI and NCCL communicators work alike
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups groups(comm, moecomm::topology(8, /*ranks_per_node=*/4));
    auto layer = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, /*num_experts=*/16, H,
                                                            moecomm::capacity<moecomm::drop_by_probability>{1.25},
                                                            moecomm::hierarchical_2d{});
    scale_by_expert const experts{comm.rank() * 2};  // 16 experts over 8 ranks: 2 local experts each
    // This rank's 40 tokens, each routed to 2 of the 16 experts (expert 0 is hot: some of its slots drop)
    std::int64_t const T = 40;
    std::vector<std::int32_t> topk_idx(T * 2);
    std::vector<float> topk_weights(T * 2), x(T * H), out(T * H), d_out(T * H), d_x(T * H), d_w(T * 2);
    for (std::int64_t i = 0; i < T * 2; ++i) {
      topk_idx[i] = i % 2 == 0 && i % 6 != 0 ? 0 : std::int32_t((i * 5 + comm.rank()) % 15 + 1);
      topk_weights[i] = i % 2 == 0 ? 0.75f : 0.25f;
    }
    for (std::int64_t i = 0; i < T * H; ++i) x[i] = d_out[i] = float(i % 17) * 0.25f - 2.0f;
    moecomm::routing_view const routing{topk_idx.data(), topk_weights.data(), T, /*top_k=*/2};
    layer.forward(routing, moecomm::matrix_view<float const>{x.data(), T, H}, moecomm::matrix_view<float>{out.data(), T, H},
                  experts);  // dispatch -> experts -> combine
    layer.backward(moecomm::matrix_view<float const>{d_out.data(), T, H}, moecomm::matrix_view<float>{d_x.data(), T, H},
                   moecomm::array_view<float>(d_w), experts);  // sized views; moecomm::not_needed declines one
    results[comm.rank()] = {out, d_x, d_w};
  });
  // example-end readme-layer
  // The oracle on the same inputs: the capacity of 40 tokens x 2 slots over 16 experts at 1.25, the
  // same drop rule, then the combine in its fixed order (tests/patterns/layer_cases.hpp).
  std::int64_t const T = 40;
  std::int64_t const cap = oracle::capacity(T, 2, 16, 1.25);
  for (int r = 0; r < 8; ++r) {
    CAPTURE(r);
    oracle::routing routing;
    routing.tokens = T;
    routing.top_k = 2;
    for (std::int64_t i = 0; i < T * 2; ++i) {
      routing.idx.push_back(i % 2 == 0 && i % 6 != 0 ? 0 : std::int32_t((i * 5 + r) % 15 + 1));
      routing.w.push_back(i % 2 == 0 ? 0.75f : 0.25f);
    }
    std::vector<float> x(static_cast<std::size_t>(T * H));
    for (std::int64_t i = 0; i < T * H; ++i) x[static_cast<std::size_t>(i)] = float(i % 17) * 0.25f - 2.0f;
    auto const kept = oracle::drop_to_capacity(routing, 16, cap, oracle::drop_rule::probability, 0, 0, r * T);
    auto const want = layer_oracle(kept, T * 2, x, x, H, 16);
    CHECK(want.dropped > 0);
    check_bitwise(results[r].out, want.out, H, "output");
    check_bitwise(results[r].d_x, want.d_x, H, "input gradient");
    check_bitwise(results[r].d_w, want.d_w, 2, "weight gradient");
  }
}

}  // namespace test
