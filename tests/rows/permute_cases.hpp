// SPDX-License-Identifier: Apache-2.0
#pragma once
// Test bodies for the permute plan, permute, unpermute and their backward passes, written once
// and instantiated per back-end and element type by the test translation units.

#include "../support/test_support.hpp"

#include <vector>

namespace test {

// The shape sweep of the issue: T in {0, 1, 7, 2039}, E in {1, 7, 16}, K in {1, 2, 8} (K <= E),
// with and without masked slots; duplicates allowed; and K = 12.
inline std::vector<routing_spec> routing_sweep() {
  std::vector<routing_spec> specs;
  std::uint32_t seed = 7;
  for (int64_t tokens : {0, 1, 7, 2039})
    for (int32_t experts : {1, 7, 16})
      for (int32_t top_k : {1, 2, 8})
        for (double masked : {0.0, 0.25}) {
          if (top_k > experts) continue;
          specs.push_back({tokens, top_k, experts, masked, true, 0.0, seed++});
        }
  specs.push_back({2039, 8, 16, 0.0, false, 1.2, 99});  // Zipf, distinct experts
  specs.push_back({513, 2, 16, 1.0, true, 0.0, 5});     // every slot masked
  specs.push_back({257, 12, 16, 0.25, true, 0.0, 11});  // K > 8: the combine backward's two-pass path
  return specs;
}

template <class Backend>
void check_plan(Backend const& be, moecomm::permute_plan<Backend> const& plan, oracle::row_map const& want) {
  REQUIRE(plan.num_rows() == want.rows());
  CHECK(download(be, plan.row_of(), static_cast<int64_t>(want.row_of.size())) == want.row_of);
  CHECK(download(be, plan.token_of(), want.rows()) == want.token_of);
  CHECK(download(be, plan.slot_of(), want.rows()) == want.slot_of);
  CHECK(download(be, plan.expert_offsets(), static_cast<int64_t>(want.expert_offsets.size())) ==
        want.expert_offsets);
}

TEST_CASE_TEMPLATE_DEFINE("permute plan equals the oracle over the shape sweep", Config, permute_plan_sweep) {
  auto const be = Config::make_backend();
  for (auto const& spec : routing_sweep()) {
    CAPTURE(describe(spec));
    auto const r = make_routing(spec);
    device_routing<typename Config::backend> const routing(be, r);
    auto const plan = moecomm::make_permute_plan(be, routing.view, spec.experts);
    check_plan(be, plan, oracle::permute_map(r, spec.experts));
    CHECK(plan.num_invalid_slots() == 0);
  }
}

TEST_CASE_TEMPLATE_DEFINE("permute plan reproduces semantics example P1", Config, permute_plan_example) {
  auto const be = Config::make_backend();
  oracle::routing r{{2, 0, 1, -1, 0, 2, 1, 0}, {.6f, .4f, 1.f, 0.f, .7f, .3f, .5f, .5f}, 4, 2};
  device_routing<typename Config::backend> const routing(be, r);
  auto const plan = moecomm::make_permute_plan(be, routing.view, 3);
  // Literal values from reference/semantics.md §4, Example P1.
  oracle::row_map want{{5, 0, 3, -1, 1, 6, 4, 2}, {0, 2, 3, 1, 3, 0, 2}, {1, 0, 1, 0, 0, 0, 1}, {0, 3, 5, 7}};
  check_plan(be, plan, want);
}

TEST_CASE_TEMPLATE_DEFINE("a plan padded to capacity reproduces semantics example PAD1", Config, permute_plan_padded) {
  using T = typename Config::value_type;
  auto const be = Config::make_backend();
  oracle::routing r{{2, 0, 1, -1, 0, 2, 1, 0}, {.6f, .4f, 1.f, 0.f, .7f, .3f, .5f, .5f}, 4, 2};
  device_routing<typename Config::backend> const routing(be, r);
  auto const plan = moecomm::make_permute_plan(be, routing.view, 3, {}, 3);
  // Literal values from reference/semantics.md §9, Example PAD1.
  CHECK(plan.num_rows() == 9);
  CHECK(download(be, plan.row_of(), 8) == std::vector<int32_t>{6, 0, 3, -1, 1, 7, 4, 2});
  CHECK(download(be, plan.token_of(), 9) == std::vector<int32_t>{0, 2, 3, 1, 3, -1, 0, 2, -1});
  CHECK(download(be, plan.expert_offsets(), 4) == std::vector<int32_t>{0, 3, 6, 9});
  // Padding rows are written as zeros (weight 0); the combine never reads them.
  int64_t const hidden = 8;
  auto const x_host = finite_rows<T>(4, hidden, 1);
  auto const x = upload(be, x_host);
  auto out = upload(be, poisoned<T>(9 * hidden));
  auto out_w = upload(be, poisoned<float>(9));
  moecomm::permute(be, plan, moecomm::matrix_view<T const>{x.data(), 4, hidden}, moecomm::matrix_view<T>{out.data(), 9, hidden},
                   moecomm::array_view<float>{out_w.data(), out_w.size()});
  auto const got = download(be, out.data(), out.size());
  auto const got_w = download(be, out_w.data(), 9);
  for (int64_t row : {5, 8}) {
    CHECK(got_w[static_cast<std::size_t>(row)] == 0.0f);
    for (int64_t h = 0; h < hidden; ++h) CHECK(oracle::f32(got[static_cast<std::size_t>(row * hidden + h)]) == 0.0f);
  }
  auto combined = upload(be, poisoned<T>(4 * hidden));
  moecomm::unpermute(be, plan, moecomm::matrix_view<T const>{out.data(), 9, hidden},
                     moecomm::matrix_view<T>{combined.data(), 4, hidden});
  auto const unpadded = oracle::permute_map(r, 3);
  check_bitwise(download(be, combined.data(), combined.size()),
                oracle::unpermute(oracle::permute(x_host, hidden, unpadded), hidden, r, unpadded, true), hidden,
                "padded round trip");
  check_error([&] { (void)moecomm::make_permute_plan(be, routing.view, 3, {}, 2); }, moecomm::status::invalid_argument,
              {"expert 0 has 3 slots, more than padded_capacity = 2"});
}

// Permute, unpermute (both policies) and all backward outputs against the oracle, with poisoned
// outputs, for row widths that take the 16-byte path (64) and the element path (1, 7).
template <class Config>
void check_permute_family(typename Config::backend const& be, routing_spec const& spec, int64_t hidden) {
  using T = typename Config::value_type;
  CAPTURE(describe(spec));
  CAPTURE(hidden);
  auto const r = make_routing(spec);
  auto const m = oracle::permute_map(r, spec.experts);
  int64_t const tokens = spec.tokens, rows = m.rows(), slack = 3;  // outputs get 3 spare rows
  device_routing<typename Config::backend> const routing(be, r);
  auto const plan = moecomm::make_permute_plan(be, routing.view, spec.experts);

  // permute: self-identifying rows, moved bit for bit; nothing written past P.
  auto const x_host = identity_rows<T>(tokens, hidden, 1);
  auto const x = upload(be, x_host);
  auto out = upload(be, poisoned<T>((rows + slack) * hidden));
  auto out_w = upload(be, poisoned<float>(rows + slack));
  moecomm::permute(be, plan, moecomm::matrix_view<T const>{x.data(), tokens, hidden},
                   moecomm::matrix_view<T>{out.data(), rows + slack, hidden},
                   moecomm::array_view<float>{out_w.data(), out_w.size()});
  auto const got = download(be, out.data(), out.size());
  check_bitwise(got, oracle::permute(x_host, hidden, m), hidden, "permute");
  check_untouched(got, static_cast<std::size_t>(rows * hidden), "permute");
  std::vector<float> want_w;
  for (int64_t row = 0; row < rows; ++row)
    want_w.push_back(r.weight(m.token_of[static_cast<std::size_t>(row)], m.slot_of[static_cast<std::size_t>(row)]));
  auto const got_w = download(be, out_w.data(), out_w.size());
  check_bitwise(got_w, want_w, 1, "permuted weights");
  check_untouched(got_w, static_cast<std::size_t>(rows), "permuted weights");

  // unpermute: finite expert outputs, combined bitwise as the oracle does.
  auto const y_host = finite_rows<T>(rows, hidden, 2);
  auto const y = upload(be, y_host);
  for (bool weighted : {true, false}) {
    CAPTURE(weighted);
    auto combined = upload(be, poisoned<T>((tokens + slack) * hidden));
    moecomm::matrix_view<T const> const yv{y.data(), rows, hidden};
    moecomm::matrix_view<T> const cv{combined.data(), tokens + slack, hidden};
    if (weighted) moecomm::unpermute<moecomm::weighted>(be, plan, yv, cv);
    else moecomm::unpermute<moecomm::unweighted>(be, plan, yv, cv);
    auto const got_c = download(be, combined.data(), combined.size());
    check_bitwise(got_c, oracle::unpermute(y_host, hidden, r, m, weighted), hidden, "unpermute");
    check_untouched(got_c, static_cast<std::size_t>(tokens * hidden), "unpermute");
  }

  // permute backward: d_x is the unweighted combine of d_out; d_w gathers d_out_w.
  auto const dp_host = finite_rows<T>(rows, hidden, 3);
  auto const dp = upload(be, dp_host);
  std::vector<float> dpw_host(static_cast<std::size_t>(rows));
  for (int64_t row = 0; row < rows; ++row) dpw_host[static_cast<std::size_t>(row)] = static_cast<float>(row) + 0.5f;
  auto const dpw = upload(be, dpw_host);
  auto dx = upload(be, poisoned<T>(tokens * hidden));
  auto dw = upload(be, poisoned<float>(tokens * spec.top_k));
  moecomm::permute_backward(be, plan, moecomm::matrix_view<T const>{dp.data(), rows, hidden},
                            moecomm::array_view<float const>{dpw.data(), rows}, moecomm::matrix_view<T>{dx.data(), tokens, hidden},
                            moecomm::array_view<float>{dw.data(), dw.size()});
  check_bitwise(download(be, dx.data(), dx.size()), oracle::unpermute(dp_host, hidden, r, m, false), hidden,
                "permute_backward d_x");
  std::vector<float> want_dw;
  for (int32_t row : m.row_of) want_dw.push_back(row < 0 ? 0.0f : dpw_host[static_cast<std::size_t>(row)]);
  check_bitwise(download(be, dw.data(), dw.size()), want_dw, 1, "permute_backward d_weights");

  // unpermute backward: d_y bitwise; the weight gradient within fp32 tolerance of the oracle.
  auto const dout_host = finite_rows<T>(tokens, hidden, 4);
  auto const dout = upload(be, dout_host);
  for (bool weighted : {true, false}) {
    CAPTURE(weighted);
    auto dy = upload(be, poisoned<T>((rows + slack) * hidden));
    auto dwu = upload(be, poisoned<float>(tokens * spec.top_k));
    moecomm::matrix_view<T const> const dv{dout.data(), tokens, hidden};
    moecomm::matrix_view<T> const dyv{dy.data(), rows + slack, hidden};
    if (weighted) {
      moecomm::unpermute_backward(be, plan, dv, moecomm::matrix_view<T const>{y.data(), rows, hidden}, dyv,
                                  moecomm::array_view<float>{dwu.data(), dwu.size()});
      auto const got_dw = download(be, dwu.data(), dwu.size());
      auto const want = oracle::weight_grad(y_host, dout_host, hidden, r, m);
      for (std::size_t i = 0; i < want.size(); ++i)
        REQUIRE_MESSAGE(std::fabs(got_dw[i] - want[i]) <= 1e-5f * std::fabs(want[i]) + 1e-6f * float(hidden),
                        "d_weights[", i, "] = ", got_dw[i], ", oracle ", want[i]);
    } else {
      moecomm::unpermute_backward<moecomm::unweighted>(be, plan, dv, dyv);
    }
    auto const got_dy = download(be, dy.data(), dy.size());
    check_bitwise(got_dy, oracle::unpermute_backward(dout_host, hidden, r, m, weighted), hidden, "unpermute_backward");
    check_untouched(got_dy, static_cast<std::size_t>(rows * hidden), "unpermute_backward");
  }
}

TEST_CASE_TEMPLATE_DEFINE("permute, unpermute and backward equal the oracle", Config, permute_family_sweep) {
  auto const be = Config::make_backend();
  for (auto const& spec : routing_sweep())
    for (int64_t hidden : {1, 6, 7, 12, 64}) check_permute_family<Config>(be, spec, hidden);  // 16-, 8-byte and element access
}

// On the back-end: each drop rule keeps the oracle's slots (semantics §8), and the plans derived
// without a second sort (the kept plan, unpadded and padded; an expert relabel) equal the oracle's
// row map or a plan built from scratch on their routing. One workspace and plan for the whole sweep.
TEST_CASE_TEMPLATE_DEFINE("drops and derived plans equal the oracle over the shape sweep", Config, derived_plans_sweep) {
  using B = typename Config::backend;
  auto const be = Config::make_backend();
  moecomm::workspace<B> scratch;
  moecomm::permute_plan<B> dropless, kept;
  std::uint32_t seed = 1;
  for (routing_spec const& spec : routing_sweep()) {
    CAPTURE(describe(spec));
    auto const r = make_routing(spec);
    device_routing<B> const routing(be, r);
    moecomm::build_permute_plan(be, routing.view, spec.experts, dropless, scratch);
    int64_t const slots = spec.tokens * spec.top_k, c = std::max<int64_t>(1, slots / spec.experts / 2);
    auto kept_idx = be.template allocate<int32_t>(slots);
    moecomm::routing_view const kept_view{kept_idx.data(), routing.w.data(), spec.tokens, spec.top_k};
    for (oracle::drop_rule rule : {oracle::drop_rule::position, oracle::drop_rule::probability, oracle::drop_rule::random}) {
      CAPTURE(static_cast<int>(rule));
      moecomm::array_view<int32_t> const out{kept_idx.data(), slots};
      if (rule == oracle::drop_rule::position) (void)moecomm::drop_to_capacity(be, dropless, c, out, scratch, moecomm::drop_by_position{});
      if (rule == oracle::drop_rule::probability) (void)moecomm::drop_to_capacity(be, dropless, c, out, scratch, moecomm::drop_by_probability{});
      if (rule == oracle::drop_rule::random) (void)moecomm::drop_to_capacity(be, dropless, c, out, scratch, moecomm::drop_random{seed, 3});
      oracle::routing const want = oracle::drop_to_capacity(r, spec.experts, c, rule, seed, 3);
      REQUIRE(download(be, kept_idx.data(), slots) == want.idx);
      moecomm::build_kept_permute_plan(be, dropless, kept_view, kept, scratch);
      check_plan(be, kept, oracle::permute_map(want, spec.experts));
      moecomm::build_kept_permute_plan(be, dropless, kept_view, kept, scratch, moecomm::unchecked_routing, c);  // both modes
      auto const fresh = moecomm::make_permute_plan(be, kept_view, spec.experts, {}, c);
      REQUIRE(kept.num_rows() == fresh.num_rows());
      CHECK(download(be, kept.row_of(), slots) == download(be, fresh.row_of(), slots));
      CHECK(download(be, kept.token_of(), kept.num_rows()) == download(be, fresh.token_of(), fresh.num_rows()));
      CHECK(download(be, kept.expert_offsets(), spec.experts + 1) == download(be, fresh.expert_offsets(), spec.experts + 1));
    }
    // The experts renamed in reverse: the plan moves blocks.
    std::vector<int32_t> label(static_cast<std::size_t>(spec.experts)), renamed(r.idx);
    for (int32_t e = 0; e < spec.experts; ++e) label[static_cast<std::size_t>(e)] = spec.experts - 1 - e;
    for (int32_t& e : renamed) e = e < 0 ? e : label[static_cast<std::size_t>(e)];
    auto const renamed_idx = upload(be, renamed);
    moecomm::routing_view const relabeled{renamed_idx.data(), routing.w.data(), spec.tokens, spec.top_k};
    moecomm::relabel_permute_plan(be, dropless, relabeled, moecomm::array_view<int32_t const>(label), scratch);
    oracle::routing renamed_routing = r;
    renamed_routing.idx = renamed;
    check_plan(be, dropless, oracle::permute_map(renamed_routing, spec.experts));
    ++seed;
  }
}

TEST_CASE_TEMPLATE_DEFINE("a second, smaller call reuses buffers without stale rows", Config, permute_smaller_second_call) {
  using T = typename Config::value_type;
  auto const be = Config::make_backend();
  int64_t const hidden = 32;
  auto const big = make_routing({2039, 4, 16, 0.1, true, 0.0, 11});
  auto const small = make_routing({7, 4, 16, 0.1, true, 0.0, 12});
  auto out = upload(be, poisoned<T>(2039 * 4 * hidden));
  auto combined = upload(be, poisoned<T>(2039 * hidden));
  for (auto const* r : {&big, &small}) {
    auto const m = oracle::permute_map(*r, 16);
    device_routing<typename Config::backend> const routing(be, *r);
    auto const plan = moecomm::make_permute_plan(be, routing.view, 16);
    auto const x_host = finite_rows<T>(r->tokens, hidden, static_cast<std::uint32_t>(r->tokens));
    auto const x = upload(be, x_host);
    moecomm::permute(be, plan, moecomm::matrix_view<T const>{x.data(), r->tokens, hidden},
                     moecomm::matrix_view<T>{out.data(), 2039 * 4, hidden});
    moecomm::unpermute<moecomm::weighted>(be, plan, moecomm::matrix_view<T const>{out.data(), plan.num_rows(), hidden},
                                          moecomm::matrix_view<T>{combined.data(), 2039, hidden});
    auto const got = download(be, combined.data(), r->tokens * hidden);
    check_bitwise(got, oracle::unpermute(oracle::permute(x_host, hidden, m), hidden, *r, m, true), hidden,
                  "round trip after reuse");
  }
}

TEST_CASE_TEMPLATE_DEFINE("permute and unpermute are bitwise repeatable", Config, permute_repeatable) {
  using T = typename Config::value_type;
  auto const be = Config::make_backend();
  int64_t const hidden = 96;
  auto const r = make_routing({2039, 8, 16, 0.1, true, 1.0, 21});
  device_routing<typename Config::backend> const routing(be, r);
  auto const x = upload(be, finite_rows<T>(r.tokens, hidden, 5));
  std::vector<T> first;
  for (int run = 0; run < 3; ++run) {
    auto const plan = moecomm::make_permute_plan(be, routing.view, 16);
    auto out = be.template allocate<T>(plan.num_rows() * hidden);
    auto combined = be.template allocate<T>(r.tokens * hidden);
    moecomm::permute(be, plan, moecomm::matrix_view<T const>{x.data(), r.tokens, hidden},
                     moecomm::matrix_view<T>{out.data(), plan.num_rows(), hidden});
    moecomm::unpermute(be, plan, moecomm::matrix_view<T const>{out.data(), plan.num_rows(), hidden},
                       moecomm::matrix_view<T>{combined.data(), r.tokens, hidden});
    auto got = download(be, combined.data(), combined.size());
    if (run == 0) first = got;
    else check_bitwise(got, first, hidden, "repeat run");
  }
}

}  // namespace test
