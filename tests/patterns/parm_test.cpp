// SPDX-License-Identifier: Apache-2.0
// The Parm layer over in-process ranks (parm_cases.hpp): every schedule equals the unsliced
// single-process oracle bit for bit, on 8 ranks in every layout of the issue, dropless and with
// capacity, under uniform and Zipf routing; with bf16 rows, every schedule equals deepspeed_mp bit
// for bit and deepspeed_mp the oracle within the bound of its double rounding.

#include "parm_cases.hpp"

#include <moecomm/backend/host.hpp>
#include <moecomm/comm/inproc.hpp>

#include <set>

namespace test {

// Every schedule against the oracle on 8 in-process ranks.
template <class T, class Capacity>
void check_parm_on_8_ranks(parm_case const& c, Capacity capacity) {
  CAPTURE(c.sizes.model);
  CAPTURE(c.sizes.expert);
  CAPTURE(c.sizes.expert_slicing);
  CAPTURE(c.tokens);
  CAPTURE(c.zipf);
  moecomm::inproc_world const world(8, std::chrono::seconds(60));
  world.run([&](moecomm::inproc_communicator comm) { check_parm_schedules_on_rank<T>(moecomm::host_backend{}, comm, c, capacity); });
}

TEST_CASE("Parm: deepspeed_mp, parm_s1 and parm_s2 equal the unsliced oracle bit for bit (8 ranks, 5 layouts, T = 0, 1, 37)") {
  for (moecomm::parallel_sizes const sizes : {moecomm::parallel_sizes{1, 8, 1}, moecomm::parallel_sizes{2, 4, 1},
                                              moecomm::parallel_sizes{2, 4, 2}, moecomm::parallel_sizes{4, 2, 4},
                                              moecomm::parallel_sizes{2, 2, 2}, moecomm::parallel_sizes{4, 2, 2}})
    for (std::int64_t tokens : {0, 1, 37}) check_parm_on_8_ranks<float>(parm_case{sizes, tokens, 8, 2, 0}, moecomm::dropless{});
}

TEST_CASE("Parm: with capacity every schedule drops the baseline's slots (8 ranks, factor 0.75, top-4, 16 experts)") {
  for (moecomm::parallel_sizes const sizes : {moecomm::parallel_sizes{2, 4, 2}, moecomm::parallel_sizes{4, 2, 2}})
    check_parm_on_8_ranks<float>(parm_case{sizes, 211, 16, 4, 0.75}, moecomm::capacity<moecomm::drop_by_position>{0.75});
}

TEST_CASE("Parm: with a padded capacity (a capturable step) every schedule equals the oracle bit for bit, C a multiple of MP or not") {
  using moecomm::capacity;
  using moecomm::drop_by_position;
  for (moecomm::parallel_sizes const sizes : {moecomm::parallel_sizes{2, 4, 2}, moecomm::parallel_sizes{4, 2, 2},
                                              moecomm::parallel_sizes{2, 2, 2}, moecomm::parallel_sizes{4, 2, 4}}) {
    check_parm_on_8_ranks<float>(parm_case{sizes, 37, 8, 2, 0.75}, capacity<drop_by_position>{0.75, 0, true, {}});  // C = 7
    check_parm_on_8_ranks<float>(parm_case{sizes, 211, 16, 4, 0.75}, capacity<drop_by_position>{0.75, 0, true, {}});  // C = 40
    for (std::int64_t tokens : {0, 1}) check_parm_on_8_ranks<float>(parm_case{sizes, tokens, 8, 2, 1.0}, capacity<drop_by_position>{1.0, 0, true, {}});
  }
}

TEST_CASE("Parm: padded, an out-of-range expert id is an error naming the slot on every rank, and the next step runs") {
  using padded = moecomm::capacity<moecomm::drop_by_position>;
  parm_case const c{{2, 2, 2}, 12, 8, 2, 1.0};
  moecomm::inproc_world const world(4, std::chrono::seconds(20));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::host_backend const be;
    moecomm::parallel_groups<moecomm::inproc_communicator> groups(comm, c.sizes);
    auto const at = groups.coordinates();
    std::int32_t const group = at.ep;
    backend_sliced_mlp_experts<float, moecomm::host_backend> experts(be, parm_rank_experts<float>(at, c));
    moecomm::parm_layer<float, moecomm::host_backend, moecomm::inproc_communicator, moecomm::parm_s2, padded> layer(
        be, groups, c.experts, parm_hidden, moecomm::parm_s2{2}, padded{1.0, 0, true, {}});
    oracle::routing r = parm_routing(group, c);
    std::vector<float> const x = parm_rows<float>(group, 0, c.tokens, parm_hidden);
    std::vector<float> out(x.size());
    if (group == 1) r.idx[3] = 99;  // the MP group of EP rank 1: token 1, slot 1
    moecomm::routing_view const routing{r.idx.data(), r.w.data(), c.tokens, c.top_k};
    if (group == 1)
      check_error([&] { layer.forward(routing, {x.data(), c.tokens, parm_hidden}, {out.data(), c.tokens, parm_hidden}, experts); },
                  moecomm::status::invalid_argument, {"topk_idx[1][1] = 99", "out of range"});
    else
      check_error([&] { layer.forward(routing, {x.data(), c.tokens, parm_hidden}, {out.data(), c.tokens, parm_hidden}, experts); },
                  moecomm::status::aborted, {"rank"});
    r.idx[3] = 1;
    layer.forward(routing, {x.data(), c.tokens, parm_hidden}, {out.data(), c.tokens, parm_hidden}, experts);
    for (float v : out) CHECK(std::isfinite(v));
  });
}

TEST_CASE("Parm: the Zipf routing has distinct experts per token, masked slots, dyadic weights and a hot expert") {
  parm_case const c{{2, 4, 2}, 2000, 16, 4, 0, 1.2};
  oracle::routing const r = parm_routing(3, c);
  std::vector<std::int64_t> load(16, 0);
  std::int64_t masked = 0;
  for (std::int64_t t = 0; t < c.tokens; ++t) {
    std::set<std::int32_t> experts;
    for (std::int32_t k = 0; k < c.top_k; ++k) {
      std::int32_t const e = r.at(t, k);
      if (e < 0) {
        ++masked;
        continue;
      }
      REQUIRE(e < 16);
      CHECK(experts.insert(e).second);
      ++load[static_cast<std::size_t>(e)];
      float const w8 = r.weight(t, k) * 8.0f;
      CHECK((w8 == std::floor(w8) && w8 >= 1.0f && w8 <= 4.0f));
    }
  }
  std::int64_t const slots = c.tokens * c.top_k;
  CHECK(masked > slots / 16);
  CHECK(masked < slots / 4);
  CHECK(load[0] > 4 * load[15]);  // Zipf(1.2), distinct per token: about 5.5x
  CHECK(load[0] > 2 * slots / 16);
  CHECK(parm_routing(3, c).idx == r.idx);  // the same on every rank of the MP group
  CHECK(parm_routing(4, c).idx != r.idx);  // another MP group routes its own tokens
}

TEST_CASE("Parm: Zipf(1.2) routing overloading one EP rank, dropless and with capacity (8 ranks)") {
  for (moecomm::parallel_sizes const sizes : {moecomm::parallel_sizes{2, 4, 2}, moecomm::parallel_sizes{4, 2, 4}}) {
    check_parm_on_8_ranks<float>(parm_case{sizes, 97, 8, 2, 0, 1.2}, moecomm::dropless{});
    check_parm_on_8_ranks<float>(parm_case{sizes, 211, 16, 4, 0.75, 1.2}, moecomm::capacity<moecomm::drop_by_position>{0.75});
  }
}

TEST_CASE("Parm: bf16 rows, every schedule equals deepspeed_mp bit for bit, and deepspeed_mp the oracle (bitwise at ESP 1)") {
  for (moecomm::parallel_sizes const sizes : {moecomm::parallel_sizes{2, 4, 2}, moecomm::parallel_sizes{4, 2, 4},
                                              moecomm::parallel_sizes{4, 2, 1}}) {
    check_parm_on_8_ranks<__nv_bfloat16>(parm_case{sizes, 37, 8, 2, 0}, moecomm::dropless{});
    check_parm_on_8_ranks<__nv_bfloat16>(parm_case{sizes, 211, 16, 4, 0.75, 1.2}, moecomm::capacity<moecomm::drop_by_position>{0.75});
  }
}

TEST_CASE("Parm: parm_auto runs the schedule its model picks, the same on every rank, with the oracle's results") {
  for (moecomm::parallel_sizes const sizes : {moecomm::parallel_sizes{2, 4, 2}, moecomm::parallel_sizes{2, 4, 1},
                                              moecomm::parallel_sizes{4, 2, 4}})
    for (std::int64_t tokens : {0, 37}) {
      CAPTURE(sizes.expert_slicing);
      CAPTURE(tokens);
      parm_case const c{sizes, tokens, 8, 2, 0};
      moecomm::inproc_world const world(8, std::chrono::seconds(60));
      world.run([&](moecomm::inproc_communicator comm) {
        check_parm_auto_on_rank(moecomm::host_backend{}, comm, c, moecomm::dropless{});
      });
    }
  parm_case const dropping{{2, 4, 2}, 211, 16, 4, 0.75};
  moecomm::inproc_world const world(8, std::chrono::seconds(60));
  world.run([&](moecomm::inproc_communicator comm) {
    check_parm_auto_on_rank(moecomm::host_backend{}, comm, dropping, moecomm::capacity<moecomm::drop_by_position>{0.75});
  });
}

TEST_CASE("Parm: parm_auto refuses a schedule without the experts' inner width or pieces") {
  moecomm::inproc_world const world(2, std::chrono::seconds(20));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::parallel_groups<moecomm::inproc_communicator> groups(comm, {2, 1, 2});
    using layer = moecomm::parm_layer<float, moecomm::host_backend, moecomm::inproc_communicator, moecomm::parm_auto>;
    check_error([&] { layer(moecomm::host_backend{}, groups, 4, 4, moecomm::parm_auto{}); }, moecomm::status::invalid_argument,
                {"moecomm::parm_layer: schedule.ffn = 0 must be the experts' inner width"});
    check_error([&] { layer(moecomm::host_backend{}, groups, 4, 4, moecomm::parm_auto{moecomm::parm_cost_model(), 8, 0}); },
                moecomm::status::invalid_argument, {"moecomm::parm_layer: schedule.pieces = 0 must be at least 1"});
  });
}

}  // namespace test

