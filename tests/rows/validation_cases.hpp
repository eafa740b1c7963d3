// SPDX-License-Identifier: Apache-2.0
#pragma once
// Test bodies for bad input: every error is asserted by its status and message, and outputs
// poisoned beforehand must still be poisoned afterwards (nothing written).

#include "../support/test_support.hpp"

#include <limits>

namespace test {

using moecomm::status;

TEST_CASE_TEMPLATE_DEFINE("bad routing is rejected with the argument, token and slot named", Config, validation_routing) {
  auto const be = Config::make_backend();
  float const nan = std::numeric_limits<float>::quiet_NaN();
  auto plan_for = [&](oracle::routing const& r, int32_t experts, moecomm::routing_checks checks = {}) {
    return [&be, r, experts, checks] {
      device_routing<typename Config::backend> const routing(be, r);
      (void)moecomm::make_permute_plan(be, routing.view, experts, checks);
    };
  };
  SUBCASE("expert id >= E") {
    check_error(plan_for({{0, 1, 2, 16, 3, 4}, {1, 1, 1, 1, 1, 1}, 3, 2}, 16), status::invalid_argument,
                {"make_permute_plan", "topk_idx[1][1] = 16", "out of range", "token 1, slot 1"});
  }
  SUBCASE("expert id < -1") {
    check_error(plan_for({{0, 1, 2, 3, -2, 4}, {1, 1, 1, 1, 1, 1}, 3, 2}, 16), status::invalid_argument,
                {"topk_idx[2][0] = -2", "token 2, slot 0"});
  }
  SUBCASE("NaN weight in a valid slot") {
    check_error(plan_for({{0, 1, 2, 3}, {1, 1, nan, 1}, 2, 2}, 16), status::invalid_argument,
                {"topk_weights[1][0] is NaN", "token 1, slot 0"});
  }
  SUBCASE("a NaN weight in a masked slot is never read") {
    device_routing<typename Config::backend> const routing(be, {{0, -1, 2, 3}, {1, nan, 1, 1}, 2, 2});
    CHECK(moecomm::make_permute_plan(be, routing.view, 16).num_rows() == 3);
  }
  SUBCASE("K > E") {
    check_error(plan_for({{0, 1, 2, 3}, {1, 1, 1, 1}, 1, 4}, 3), status::invalid_argument,
                {"routing.top_k = 4 exceeds num_experts = 3"});
  }
  SUBCASE("negative token count") {
    check_error([&] { (void)moecomm::make_permute_plan(be, moecomm::routing_view{nullptr, nullptr, -1, 2}, 4); },
                status::invalid_argument, {"routing.num_tokens = -1"});
  }
  SUBCASE("null topk_idx") {
    check_error([&] { (void)moecomm::make_permute_plan(be, moecomm::routing_view{nullptr, nullptr, 3, 2}, 4); },
                status::invalid_argument, {"routing.topk_idx is null"});
  }
  SUBCASE("duplicates are two slots by default and an error in strict mode") {
    oracle::routing const r{{5, 5, 1, 2}, {1, 1, 1, 1}, 2, 2};
    device_routing<typename Config::backend> const routing(be, r);
    CHECK(moecomm::make_permute_plan(be, routing.view, 8).num_rows() == 4);
    check_error(plan_for(r, 8, moecomm::routing_checks{true, true}), status::invalid_argument,
                {"topk_idx[0][1] = 5 repeats topk_idx[0][0]", "strict mode"});
  }
  SUBCASE("unchecked mode treats a bad id as masked and counts it") {
    device_routing<typename Config::backend> const routing(be, {{0, 99, -7, 3, 1, -1}, {1, 1, 1, 1, 1, 1}, 3, 2});
    auto const plan = moecomm::make_permute_plan(be, routing.view, 4, moecomm::unchecked_routing);
    CHECK(plan.num_rows() == 3);
    CHECK(plan.num_invalid_slots() == 2);
    CHECK(download(be, plan.row_of(), 6) == std::vector<int32_t>{0, -1, -1, 2, 1, -1});
  }
  SUBCASE("E not divisible by R") {
    check_error([] { moecomm::contiguous_placement(10, 4); }, status::invalid_argument,
                {"num_experts = 10 is not divisible by num_ranks = 4"});
  }
  SUBCASE("ranks_per_node must divide the ranks") {
    device_routing<typename Config::backend> const routing(be, {{0, 1}, {1, 1}, 1, 2});
    check_error(
        [&] { (void)moecomm::make_dispatch_layout(be, routing.view, moecomm::contiguous_placement(8, 4), 3); },
        status::invalid_argument, {"make_dispatch_layout", "ranks_per_node = 3"});
  }
  SUBCASE("the layout scans the routing too") {
    device_routing<typename Config::backend> const routing(be, {{0, 9}, {1, 1}, 1, 2});
    check_error([&] { (void)moecomm::make_dispatch_layout(be, routing.view, moecomm::contiguous_placement(8, 4)); },
                status::invalid_argument, {"make_dispatch_layout", "topk_idx[0][1] = 9"});
  }
}

TEST_CASE_TEMPLATE_DEFINE("bad buffers are rejected before anything is written", Config, validation_buffers) {
  using T = typename Config::value_type;
  auto const be = Config::make_backend();
  int64_t const hidden = 16;
  oracle::routing const r{{0, 1, 1, 2, 2, 0}, {.5f, .5f, .5f, .5f, .5f, .5f}, 3, 2};  // P = 6
  device_routing<typename Config::backend> const routing(be, r);
  auto const plan = moecomm::make_permute_plan(be, routing.view, 4);
  auto const x = upload(be, finite_rows<T>(3, hidden, 1));
  auto out = upload(be, poisoned<T>(6 * hidden));
  auto const out_before = download(be, out.data(), out.size());
  moecomm::matrix_view<T const> const xv{x.data(), 3, hidden};

  check_error([&] { moecomm::permute(be, plan, xv, moecomm::matrix_view<T>{out.data(), 5, hidden}); },
              status::invalid_argument, {"moecomm::permute", "argument 'out' has 5 rows; needs at least 6"});
  check_error([&] { moecomm::permute(be, plan, moecomm::matrix_view<T const>{x.data(), 2, hidden},
                                     moecomm::matrix_view<T>{out.data(), 6, hidden}); },
              status::invalid_argument, {"argument 'x' has 2 rows; needs at least 3"});
  check_error([&] { moecomm::permute(be, plan, xv, moecomm::matrix_view<T>{out.data(), 6, hidden + 1}); },
              status::invalid_argument, {"'x' has hidden = 16 but 'out' has hidden = 17"});
  check_error([&] { moecomm::permute(be, plan, xv, moecomm::matrix_view<T>{nullptr, 6, hidden}); },
              status::invalid_argument, {"argument 'out' is null"});
  auto scratch = upload(be, poisoned<T>(7 * hidden));
  check_error([&] { moecomm::permute(be, plan, moecomm::matrix_view<T const>{scratch.data(), 3, hidden},
                                     moecomm::matrix_view<T>{scratch.data() + hidden, 6, hidden}); },
              status::invalid_argument, {"arguments 'x' and 'out' overlap"});
  check_error([&] { moecomm::unpermute(be, plan, moecomm::matrix_view<T const>{out.data(), 6, hidden},
                                       moecomm::matrix_view<T>{out.data() + 4 * hidden, 2, hidden}); },
              status::invalid_argument, {"moecomm::unpermute", "argument 'out' has 2 rows; needs at least 3"});
  check_bitwise(download(be, out.data(), out.size()), out_before, hidden, "output after rejected calls");

  device_routing<typename Config::backend> const no_weights(be, r);
  moecomm::routing_view view = no_weights.view;
  view.topk_weights = nullptr;
  auto const plain = moecomm::make_permute_plan(be, view, 4);
  auto combined = upload(be, poisoned<T>(3 * hidden));
  check_error([&] { moecomm::unpermute<moecomm::weighted>(be, plain, moecomm::matrix_view<T const>{out.data(), 6, hidden},
                                                          moecomm::matrix_view<T>{combined.data(), 3, hidden}); },
              status::invalid_argument, {"weighted combine needs topk_weights"});
  // The weight gradients hold T * K = 6 slots: a buffer of T = 3 (the trainer's mistake that once
  // overflowed the heap) is rejected before anything is written.
  auto const weighted_plan = moecomm::make_permute_plan(be, no_weights.view, 4);
  auto dw = upload(be, poisoned<float>(6));
  auto d_rows = upload(be, poisoned<T>(6 * hidden));
  moecomm::matrix_view<T const> const d_combined{combined.data(), 3, hidden};
  check_error([&] { moecomm::unpermute_backward(be, weighted_plan, d_combined, moecomm::matrix_view<T const>{out.data(), 6, hidden},
                                                moecomm::matrix_view<T>{d_rows.data(), 6, hidden},
                                                moecomm::array_view<float>{dw.data(), 3}); },
              status::invalid_argument, {"unpermute_backward", "argument 'd_weights' has 3 elements; needs at least 6"});
  check_error([&] { moecomm::permute_backward(be, weighted_plan, moecomm::matrix_view<T const>{out.data(), 6, hidden},
                                              moecomm::array_view<float const>{dw.data(), 6},
                                              moecomm::matrix_view<T>{d_rows.data(), 3, hidden},
                                              moecomm::array_view<float>{dw.data(), 5}); },
              status::invalid_argument, {"permute_backward", "argument 'd_weights' has 5 elements; needs at least 6"});
  check_error([&] { moecomm::permute(be, weighted_plan, moecomm::matrix_view<T const>{d_rows.data(), 3, hidden},
                                     moecomm::matrix_view<T>{out.data(), 6, hidden}, moecomm::array_view<float>{dw.data(), 5}); },
              status::invalid_argument, {"permute", "argument 'out_weights' has 5 elements; needs at least 6"});
  check_bitwise(download(be, dw.data(), dw.size()), poisoned<float>(6), 1, "d_weights after rejected calls");
}

TEST_CASE_TEMPLATE_DEFINE("sort_chunks rejects bad counts and short buffers", Config, validation_sort_chunks) {
  using T = typename Config::value_type;
  auto const be = Config::make_backend();
  auto const in = upload(be, finite_rows<T>(4, 2, 1));
  auto out = upload(be, poisoned<T>(4 * 2));
  std::vector<int32_t> const bad{1, -2, 1, 1};
  check_error([&] { moecomm::sort_chunks(be, moecomm::matrix_view<T const>{in.data(), 4, 2},
                                         moecomm::array_view<int32_t const>(bad), 2, 2, moecomm::matrix_view<T>{out.data(), 4, 2}); },
              status::invalid_argument, {"counts[0][1] = -2 is negative", "source rank 0, local expert 1"});
  std::vector<int32_t> const big{1, 2, 1, 1};
  check_error([&] { moecomm::sort_chunks(be, moecomm::matrix_view<T const>{in.data(), 4, 2},
                                         moecomm::array_view<int32_t const>(big), 2, 2, moecomm::matrix_view<T>{out.data(), 4, 2}); },
              status::invalid_argument, {"argument 'in' has 4 rows; needs at least 5"});
  check_error([&] { moecomm::sort_chunks(be, moecomm::matrix_view<T const>{in.data(), 4, 2},
                                         moecomm::array_view<int32_t const>{big.data(), 3}, 2, 2, moecomm::matrix_view<T>{out.data(), 4, 2}); },
              status::invalid_argument, {"argument 'counts' has 3 elements; needs at least 4"});
  check_error([&] { moecomm::sort_chunks(be, moecomm::matrix_view<T const>{in.data(), 4, 2},
                                         moecomm::array_view<int32_t const>(big), 2, 2, moecomm::matrix_view<T>{out.data(), 4, 2}); },
              status::invalid_argument, {"argument 'in' has 4 rows; needs at least 5"});
}

}  // namespace test
