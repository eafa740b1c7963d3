// SPDX-License-Identifier: Apache-2.0
// README's expert-parallel layer snippet (between the markers), run on 8 in-process ranks and
// checked against the layer oracle of tests/patterns/layer_cases.hpp.

#include "../patterns/layer_cases.hpp"

#include <moecomm/comm/inproc.hpp>

namespace test {

TEST_CASE("README layer snippet runs") {
  std::int64_t const H = 32;
  layer_case const c{8, 4, 16, 2, H, {64, 64, 0, 17, 64, 3, 64, 40}, 1.2};
  using drop = moecomm::capacity<moecomm::drop_by_probability>;
  auto const in = make_layer_inputs<float>(c, drop{1.25}, oracle::drop_rule::probability, true);
  struct rank_data {
    moecomm::routing_view routing;
    moecomm::matrix_view<float const> x, d_out;
    moecomm::matrix_view<float> out, d_x;
    moecomm::array_view<float> d_w;
  };
  std::vector<std::vector<float>> out(8), d_x(8), d_w(8);
  std::vector<rank_data> data;
  for (int r = 0; r < 8; ++r) {
    auto const& rt = in.routing[r];
    out[r].resize(static_cast<std::size_t>(rt.tokens * H));
    d_x[r].resize(out[r].size());
    d_w[r].resize(static_cast<std::size_t>(rt.tokens * 2));
    data.push_back({{rt.idx.data(), rt.w.data(), rt.tokens, 2}, {in.x[r].data(), rt.tokens, H},
                    {in.d_out[r].data(), rt.tokens, H}, {out[r].data(), rt.tokens, H}, {d_x[r].data(), rt.tokens, H},
                    d_w[r]});
  }
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
                                                            drop{/*factor=*/1.25}, moecomm::hierarchical_2d{});
    scale_by_expert const experts{comm.rank() * 2};  // 16 experts over 8 ranks: 2 local experts each
    rank_data const& d = data[comm.rank()];           // this rank's routing, x, out and gradients
    layer.forward(d.routing, d.x, d.out, experts);    // dispatch -> experts -> combine
    layer.backward(d.d_out, d.d_x, d.d_w, experts);   // sized views; moecomm::not_needed declines one
  });
  // example-end readme-layer
  for (int r = 0; r < 8; ++r) {
    CAPTURE(r);
    check_bitwise(out[r], in.want[r].out, H, "output");
    check_bitwise(d_x[r], in.want[r].d_x, H, "input gradient");
  }
}

}  // namespace test
