// SPDX-License-Identifier: Apache-2.0
#pragma once
// The router's test bodies (docs/semantics.md §15): forward and backward bitwise against the oracle
// over the shape and mode sweep, both backwards against central finite differences in double, the
// semantics example, every bad argument, NaN in unchecked mode and the state's memory reuse. Any
// back-end: router_test.cpp runs them on the host, ops_cuda_test.cu on a GPU (and the emulation).

#include "../support/router_oracle.hpp"
#include "../support/test_support.hpp"

#include <moecomm/rows/router/router.hpp>

#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace test {
namespace {

float const neg_inf = -std::numeric_limits<float>::infinity();

// Full-mantissa logits in [-4, 4). With `specials`: every 5th token on a 0.5 grid (ties), every
// 7th with two -inf logits, and token 3 with a single finite logit.
std::vector<float> make_logits(int64_t tokens, int32_t experts, std::uint32_t seed, bool specials) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> value(-4.0f, 4.0f);
  std::vector<float> l(static_cast<std::size_t>(tokens * experts));
  for (int64_t t = 0; t < tokens; ++t)
    for (int32_t e = 0; e < experts; ++e) {
      float& x = l[static_cast<std::size_t>(t * experts + e)];
      x = value(rng);
      if (!specials) continue;
      if (t % 5 == 0) x = std::round(x * 2.0f) / 2.0f;
      if (t % 7 == 1 && experts > 2 && (e == 0 || e == experts / 2)) x = neg_inf;
      if (t == 3 && e != experts - 1) x = neg_inf;
    }
  return l;
}

std::vector<float> make_upstream(int64_t count, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  std::vector<float> g(static_cast<std::size_t>(count));
  for (auto& x : g) x = value(rng);
  return g;
}

std::string describe(int64_t tokens, int32_t experts, oracle::router_options const& o) {
  return "T=" + std::to_string(tokens) + " E=" + std::to_string(experts) + " K=" + std::to_string(o.top_k) +
         (o.sigmoid ? " sigmoid" : o.pre_softmax ? " softmax-pre" : " softmax-post") +
         (o.num_groups ? " groups=" + std::to_string(o.num_groups) + "/" + std::to_string(o.group_top_k) : "") +
         (o.bias.empty() ? "" : " bias") + (o.renormalize ? " renormalize" : "") +
         " scaling=" + std::to_string(o.scaling) + " aux=" + std::to_string(o.aux_coeff) +
         " z=" + std::to_string(o.z_coeff);
}

moecomm::router_config to_config(oracle::router_options const& o, float const* bias) {
  moecomm::router_config c;
  c.top_k = o.top_k;
  c.score = o.sigmoid ? moecomm::score_function::sigmoid : moecomm::score_function::softmax;
  c.pre_softmax = o.pre_softmax;
  c.num_groups = o.num_groups;
  c.group_top_k = o.group_top_k;
  if (!o.bias.empty()) c.expert_bias = moecomm::array_view<float const>(bias, static_cast<int64_t>(o.bias.size()));
  c.renormalize = o.renormalize;
  c.scaling_factor = o.scaling;
  c.aux_loss_coeff = o.aux_coeff;
  c.z_loss_coeff = o.z_coeff;
  return c;
}

// What one forward and backward pass wrote, read back.
struct router_outputs {
  std::vector<int32_t> idx, counts;
  std::vector<float> w, losses, d_logits;  // losses = {aux, z}
};

// Runs forward and backward with NaN-poisoned outputs one row (or element) larger than needed,
// and checks that the extra row was not touched.
template <class Backend>
router_outputs run_router(Backend const& be, moecomm::router_state<Backend>& state, std::vector<float> const& logits,
                          int64_t tokens, int32_t experts, oracle::router_options const& o,
                          std::vector<float> const& upstream) {
  int32_t const k = o.top_k;
  auto const x = upload(be, logits);
  auto const bias = upload(be, o.bias);
  auto idx = upload(be, std::vector<int32_t>(static_cast<std::size_t>((tokens + 1) * k), -7));
  auto w = upload(be, poisoned<float>((tokens + 1) * k));
  auto counts = upload(be, std::vector<int32_t>(static_cast<std::size_t>(experts + 1), -7));
  auto losses = upload(be, std::vector<moecomm::router_losses>{{poison<float>(), poison<float>()}});
  auto const g = upload(be, upstream);
  auto d_logits = upload(be, poisoned<float>((tokens + 1) * experts));
  moecomm::router_forward(be, moecomm::make_matrix_view<float const>(x.data(), tokens, experts),
                          moecomm::make_matrix_view(idx.data(), tokens + 1, k),
                          moecomm::make_matrix_view(w.data(), tokens + 1, k),
                          moecomm::make_array_view(counts.data(), experts + 1),
                          moecomm::make_array_view(losses.data(), 1), state, to_config(o, bias.data()));
  moecomm::router_backward(be, state, moecomm::make_matrix_view<float const>(g.data(), tokens, k),
                           moecomm::make_matrix_view(d_logits.data(), tokens + 1, experts));
  router_outputs out{download(be, idx.data(), (tokens + 1) * k), download(be, counts.data(), experts + 1),
                     download(be, w.data(), (tokens + 1) * k), {},
                     download(be, d_logits.data(), (tokens + 1) * experts)};
  auto const l = download(be, losses.data(), 1);
  out.losses = {l[0].aux, l[0].z};
  CHECK(std::vector<int32_t>(out.idx.begin() + tokens * k, out.idx.end()) == std::vector<int32_t>(k, -7));
  CHECK(out.counts.back() == -7);
  check_untouched(out.w, static_cast<std::size_t>(tokens * k), "topk_weights");
  check_untouched(out.d_logits, static_cast<std::size_t>(tokens * experts), "d_logits");
  return out;
}

void check_against_oracle(router_outputs const& got, std::vector<float> const& logits, int64_t tokens,
                          int32_t experts, oracle::router_options const& o, std::vector<float> const& upstream) {
  auto const want = oracle::router_forward(logits, tokens, experts, o);
  CHECK(std::vector<int32_t>(got.idx.begin(), got.idx.begin() + tokens * o.top_k) == want.idx);
  CHECK(std::vector<int32_t>(got.counts.begin(), got.counts.begin() + experts) == want.counts);
  check_bitwise(got.w, want.w, o.top_k, "topk_weights");
  check_bitwise(got.losses, std::vector<float>{want.aux, want.z}, 2, "losses {aux, z}");
  check_bitwise(got.d_logits, oracle::router_backward(logits, tokens, experts, o, upstream), experts, "d_logits");
}

// The modes of the sweep for E experts and K slots; every one with both losses.
std::vector<oracle::router_options> router_modes(int32_t experts, int32_t top_k, std::uint32_t seed) {
  std::vector<float> bias(static_cast<std::size_t>(experts));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> value(-0.2f, 0.2f);
  for (auto& b : bias) b = value(rng);
  oracle::router_options base;
  base.top_k = top_k;
  base.aux_coeff = 0.01f;
  base.z_coeff = 0.001f;
  std::vector<oracle::router_options> modes;
  auto add = [&](std::function<void(oracle::router_options&)> const& set) {
    oracle::router_options o = base;
    set(o);
    modes.push_back(o);
  };
  add([](auto& o) { o.pre_softmax = true; });
  add([](auto& o) { o.pre_softmax = true; o.renormalize = true; o.scaling = 2.5f; });
  if (top_k > 1) add([](auto&) {});
  if (top_k > 1) add([](auto& o) { o.renormalize = true; });
  add([&](auto& o) { o.sigmoid = true; o.renormalize = top_k > 1; o.bias = bias; });  // Megatron's sigmoid
  add([](auto& o) { o.sigmoid = true; o.scaling = 2.5f; });
  if (experts == 16 && top_k > 1) {  // 4 groups of 4, 2 of them chosen
    add([](auto& o) { o.pre_softmax = true; o.num_groups = 4; o.group_top_k = 2; });
    add([](auto& o) { o.num_groups = 4; o.group_top_k = 2; });
    add([&](auto& o) { o.sigmoid = true; o.renormalize = true; o.bias = bias; o.num_groups = 4; o.group_top_k = 2; });
  }
  return modes;
}

}  // namespace

TEST_CASE_TEMPLATE_DEFINE("router forward and backward equal the oracle bitwise over the sweep", Config, router_sweep) {
  auto const be = Config::make_backend();
  moecomm::router_state<typename Config::backend> state;
  std::uint32_t seed = 11;
  for (int64_t tokens : {0, 1, 2039})
    for (int32_t experts : {7, 16, 72})  // 72: four blocks of 16 experts and a partial one (§15)
      for (int32_t top_k = 1; top_k <= 8 && top_k <= experts; ++top_k)
        for (auto const& o : router_modes(experts, top_k, ++seed)) {
          CAPTURE(describe(tokens, experts, o));
          auto const logits = make_logits(tokens, experts, seed, true);
          auto const upstream = make_upstream(tokens * top_k, seed + 1);
          auto const got = run_router(be, state, logits, tokens, experts, o, upstream);
          check_against_oracle(got, logits, tokens, experts, o, upstream);
        }
}

TEST_CASE_TEMPLATE_DEFINE("router backward and its oracle equal central finite differences in double", Config,
                          router_finite_differences) {
  auto const be = Config::make_backend();
  moecomm::router_state<typename Config::backend> state;
  int64_t const tokens = 5;
  std::uint32_t seed = 101;
  for (int32_t experts : {7, 16})
    for (int32_t top_k : {1, 2, 4})
      for (auto mode : router_modes(experts, top_k, ++seed))
        for (int term = 0; term < 3; ++term) {  // one term of the loss at a time: weights, aux, z
          oracle::router_options o = mode;
          o.aux_coeff = term == 1 ? 1.0f : 0.0f;
          o.z_coeff = term == 2 ? 1.0f : 0.0f;
          CAPTURE(describe(tokens, experts, o));
          auto const logits = make_logits(tokens, experts, seed, false);
          auto const upstream = term == 0 ? make_upstream(tokens * top_k, seed) : std::vector<float>(tokens * top_k);
          auto const got = run_router(be, state, logits, tokens, experts, o, upstream);
          check_against_oracle(got, logits, tokens, experts, o, upstream);
          auto const fwd = oracle::router_forward(logits, tokens, experts, o);
          auto const want = oracle::router_backward(logits, tokens, experts, o, upstream);
          std::vector<double> l(logits.begin(), logits.end());
          double const h = 1e-5;
          for (std::size_t i = 0; i < l.size(); ++i) {
            double const x = l[i];
            l[i] = x + h;
            double const up = oracle::router_loss_in_double(l, tokens, experts, o, fwd.idx, fwd.aux_counts, upstream);
            l[i] = x - h;
            double const down = oracle::router_loss_in_double(l, tokens, experts, o, fwd.idx, fwd.aux_counts, upstream);
            l[i] = x;
            double const fd = (up - down) / (2 * h);
            double const tolerance = 1e-5 + 1e-4 * std::abs(fd);
            CAPTURE(i);
            CHECK(std::abs(got.d_logits[i] - fd) <= tolerance);
            CHECK(std::abs(want[i] - fd) <= tolerance);
          }
        }
}

TEST_CASE_TEMPLATE_DEFINE("router reproduces semantics example R1", Config, router_example) {
  auto const be = Config::make_backend();
  moecomm::router_state<typename Config::backend> state;
  SUBCASE("ties go to the lower expert; -inf logits are never preferred") {
    oracle::router_options o;  // softmax after the top-k, K = 2
    std::vector<float> const logits{1, 3, 3, 0, neg_inf, 2, 0, 2};
    auto const got = run_router(be, state, logits, 2, 4, o, std::vector<float>(4, 0.0f));
    CHECK(std::vector<int32_t>(got.idx.begin(), got.idx.begin() + 4) == std::vector<int32_t>{1, 2, 1, 3});
    CHECK(std::vector<float>(got.w.begin(), got.w.begin() + 4) == std::vector<float>{.5f, .5f, .5f, .5f});
    CHECK(std::vector<int32_t>(got.counts.begin(), got.counts.begin() + 4) == std::vector<int32_t>{0, 2, 1, 1});
  }
  SUBCASE("the group limit excludes the best expert") {
    oracle::router_options o;
    o.sigmoid = true; o.renormalize = true; o.num_groups = 2; o.group_top_k = 1;
    std::vector<float> const logits{3, -3, 1, 1};  // groups {0,1}: sigmoid sum 1.0; {2,3}: 1.46
    auto const got = run_router(be, state, logits, 1, 4, o, std::vector<float>(2, 0.0f));
    CHECK(std::vector<int32_t>(got.idx.begin(), got.idx.begin() + 2) == std::vector<int32_t>{2, 3});
    CHECK(std::vector<float>(got.w.begin(), got.w.begin() + 2) == std::vector<float>{.5f, .5f});
  }
}

TEST_CASE_TEMPLATE_DEFINE("router rejects every bad argument before writing", Config, router_errors) {
  using backend = typename Config::backend;
  auto const be = Config::make_backend();
  int64_t const tokens = 3;
  int32_t const experts = 8;
  auto logits_host = make_logits(tokens, experts, 5, false);
  std::vector<float> bias_host(experts, 0.1f);
  auto bias = upload(be, bias_host);
  auto idx = upload(be, std::vector<int32_t>(tokens * 2, -7));
  auto w = upload(be, poisoned<float>(tokens * 2));
  auto counts = upload(be, std::vector<int32_t>(experts, -7));
  auto losses = upload(be, std::vector<moecomm::router_losses>(1));
  auto d_logits = upload(be, poisoned<float>(tokens * experts));
  auto const g = upload(be, std::vector<float>(tokens * 2, 1.0f));
  moecomm::router_state<backend> state;
  auto const invalid = moecomm::status::invalid_argument;

  struct forward_args {
    moecomm::matrix_view<float const> logits;
    moecomm::matrix_view<int32_t> idx;
    moecomm::matrix_view<float> w;
    moecomm::optional_output<moecomm::array_view<int32_t>> counts;
    moecomm::optional_output<moecomm::array_view<moecomm::router_losses>> losses;
    moecomm::router_config config;
  };
  auto const x = upload(be, logits_host);
  forward_args const good{{x.data(), tokens, experts},         {idx.data(), tokens, 2},
                          {w.data(), tokens, 2},               moecomm::make_array_view(counts.data(), experts),
                          moecomm::make_array_view(losses.data(), 1), {}};
  auto const forward_fails = [&](std::function<void(forward_args&)> const& spoil, std::vector<std::string> fragments) {
    forward_args a = good;
    spoil(a);
    fragments.insert(fragments.begin(), "moecomm::router_forward: ");
    check_error([&] { moecomm::router_forward(be, a.logits, a.idx, a.w, a.counts, a.losses, state, a.config); },
                invalid, fragments);
    CHECK(download(be, idx.data(), tokens * 2) == std::vector<int32_t>(tokens * 2, -7));
    check_untouched(download(be, w.data(), tokens * 2), 0, "topk_weights after an error");
    CHECK(download(be, counts.data(), experts) == std::vector<int32_t>(experts, -7));
  };
  auto const sigmoid = [](forward_args& a) { a.config.score = moecomm::score_function::sigmoid; };

  SUBCASE("config fields") {
    forward_fails([](auto& a) { a.config.top_k = 0; }, {"config.top_k = 0", "[1, E = 8]"});
    forward_fails([](auto& a) { a.config.top_k = 9; }, {"config.top_k = 9"});
    forward_fails([&](auto& a) { sigmoid(a); a.config.pre_softmax = true; }, {"config.pre_softmax = true"});
    forward_fails([](auto& a) { a.config.top_k = 1; }, {"config.pre_softmax = false with config.top_k = 1"});
    forward_fails([](auto& a) { a.config.score = static_cast<moecomm::score_function>(7); }, {"config.score = 7"});
    forward_fails([&](auto& a) { a.config.expert_bias = moecomm::array_view<float const>(bias.data(), experts); },
                  {"config.expert_bias needs score_function::sigmoid"});
    forward_fails([&](auto& a) { sigmoid(a); a.config.expert_bias = moecomm::array_view<float const>(bias.data(), 7); },
                  {"'config.expert_bias' has 7 elements; needs at least 8"});
    forward_fails([](auto& a) { a.config.num_groups = 4; }, {"config.num_groups = 4 and config.group_top_k = 0"});
    forward_fails([](auto& a) { a.config.num_groups = 3; a.config.group_top_k = 1; },
                  {"config.num_groups = 3 must divide E = 8"});
    forward_fails([](auto& a) { a.config.num_groups = 4; a.config.group_top_k = 5; },
                  {"config.group_top_k = 5", "num_groups = 4"});
    forward_fails([](auto& a) { a.config.num_groups = 4; a.config.group_top_k = 3; },
                  {"config.group_top_k = 3", "top_k = 2"});
    forward_fails([](auto& a) { a.config.top_k = 3; a.config.num_groups = 8; a.config.group_top_k = 2; },
                  {"config.top_k = 3 exceeds the 2 experts"});
    forward_fails([](auto& a) { a.config.scaling_factor = 0.0f; }, {"config.scaling_factor = 0"});
    forward_fails([](auto& a) { a.config.scaling_factor = std::nanf(""); }, {"config.scaling_factor = nan"});
    forward_fails([](auto& a) { a.config.aux_loss_coeff = -1.0f; }, {"config.aux_loss_coeff = -1"});
    forward_fails([](auto& a) { a.config.z_loss_coeff = std::numeric_limits<float>::infinity(); },
                  {"config.z_loss_coeff = inf"});
  }
  SUBCASE("buffers") {
    forward_fails([](auto& a) { a.logits.hidden = 0; }, {"argument 'logits' has hidden = 0"});
    forward_fails([](auto& a) { a.idx.rows = 2; }, {"argument 'topk_idx' has 2 rows; needs at least 3"});
    forward_fails([](auto& a) { a.idx.hidden = 3; }, {"argument 'topk_idx' has hidden = 3; needs exactly 2"});
    forward_fails([](auto& a) { a.w.rows = 1; }, {"argument 'topk_weights' has 1 rows"});
    forward_fails([](auto& a) { a.w.data = nullptr; }, {"argument 'topk_weights' is null"});
    forward_fails([&](auto& a) { a.w = {reinterpret_cast<float*>(idx.data()), tokens, 2}; },
                  {"arguments 'topk_idx' and 'topk_weights' overlap"});
    forward_fails([&](auto& a) { a.counts = moecomm::make_array_view(counts.data(), experts - 1); },
                  {"argument 'tokens_per_expert' has 7 elements; needs at least 8"});
    forward_fails([&](auto& a) { a.losses = moecomm::make_array_view(losses.data(), 0); },
                  {"argument 'losses' has 0 elements; needs at least 1"});
  }
  SUBCASE("values") {
    auto const bad_logits = [&](std::function<void(std::vector<float>&)> const& spoil) {
      auto host = logits_host;
      spoil(host);
      return upload(be, host);
    };
    auto const nan = bad_logits([](auto& l) { l[1 * experts + 5] = std::nanf(""); });
    forward_fails([&](auto& a) { a.logits.data = nan.data(); }, {"logits[1][5] = nan", "(token 1, expert 5)"});
    auto const inf = bad_logits([](auto& l) { l[2 * experts + 0] = std::numeric_limits<float>::infinity(); });
    forward_fails([&](auto& a) { a.logits.data = inf.data(); }, {"logits[2][0] = inf", "(token 2, expert 0)"});
    auto const empty = bad_logits([](auto& l) { std::fill(l.begin() + experts, l.begin() + 2 * experts, neg_inf); });
    forward_fails([&](auto& a) { a.logits.data = empty.data(); }, {"row 1 has no finite value", "(token 1)"});
    auto const bad_bias = upload(be, std::vector<float>{0, 0, 0, std::nanf(""), 0, 0, 0, 0});
    forward_fails([&](auto& a) { sigmoid(a); a.config.expert_bias = moecomm::array_view<float const>(bad_bias.data(), experts); },
                  {"config.expert_bias[3] = nan is not finite (expert 3)"});
  }
  SUBCASE("backward") {
    auto const backward_fails = [&](moecomm::matrix_view<float const> d_w, moecomm::matrix_view<float> d_l,
                                    std::string const& fragment) {
      check_error([&] { moecomm::router_backward(be, state, d_w, d_l); }, invalid,
                  {"moecomm::router_backward: ", fragment});
      check_untouched(download(be, d_logits.data(), tokens * experts), 0, "d_logits after an error");
    };
    moecomm::matrix_view<float const> const d_w{g.data(), tokens, 2};
    moecomm::matrix_view<float> const d_l{d_logits.data(), tokens, experts};
    backward_fails(d_w, d_l, "argument 'state' holds no forward pass; call router_forward first");
    moecomm::router_forward(be, good.logits, good.idx, good.w, good.counts, good.losses, state, good.config);
    backward_fails({g.data(), tokens - 1, 2}, d_l, "argument 'd_topk_weights' has 2 rows; needs at least 3");
    backward_fails({g.data(), tokens, 1}, d_l, "argument 'd_topk_weights' has hidden = 1; needs exactly 2");
    backward_fails(d_w, {d_logits.data(), tokens, experts + 1}, "argument 'd_logits' has hidden = 9; needs exactly 8");
    backward_fails(d_w, {nullptr, tokens, experts}, "argument 'd_logits' is null");
  }
}

TEST_CASE_TEMPLATE_DEFINE("router with unchecked NaN logits picks K distinct valid experts", Config, router_unchecked) {
  auto const be = Config::make_backend();
  int64_t const tokens = 64;
  int32_t const experts = 16;
  for (bool sigmoid : {false, true}) {
    auto logits = make_logits(tokens, experts, 9, true);
    for (std::size_t i = 0; i < logits.size(); i += 3) logits[i] = std::nanf("");
    auto const x = upload(be, logits);
    auto idx = upload(be, std::vector<int32_t>(tokens * 4, -7));
    auto w = upload(be, poisoned<float>(tokens * 4));
    moecomm::router_config config;
    config.top_k = 4;
    config.score = sigmoid ? moecomm::score_function::sigmoid : moecomm::score_function::softmax;
    config.pre_softmax = !sigmoid;
    config.num_groups = 4;
    config.group_top_k = 2;
    config.check_values = false;
    moecomm::router_state<typename Config::backend> state;
    moecomm::router_forward(be, moecomm::make_matrix_view<float const>(x.data(), tokens, experts),
                            moecomm::make_matrix_view(idx.data(), tokens, 4), moecomm::make_matrix_view(w.data(), tokens, 4),
                            moecomm::not_needed, moecomm::not_needed, state, config);
    auto const got = download(be, idx.data(), tokens * 4);
    for (int64_t t = 0; t < tokens; ++t) {
      std::set<int32_t> const distinct(got.begin() + t * 4, got.begin() + (t + 1) * 4);
      CHECK(distinct.size() == 4);
      CHECK(*distinct.begin() >= 0);
      CHECK(*distinct.rbegin() < experts);
    }
  }
}

TEST_CASE_TEMPLATE_DEFINE("router state reuses its memory on a second, smaller call", Config, router_state_reuse) {
  auto const be = Config::make_backend();
  moecomm::router_state<typename Config::backend> state;
  oracle::router_options o;
  o.top_k = 4; o.sigmoid = true; o.renormalize = true; o.aux_coeff = 0.01f; o.z_coeff = 0.001f;
  auto const first = make_logits(300, 16, 1, true);
  run_router(be, state, first, 300, 16, o, make_upstream(300 * 4, 2));
  float const* const logits_memory = state.saved_logits();
  int32_t const* const selection_memory = state.selected_experts();
  auto const second = make_logits(200, 16, 3, true);
  auto const upstream = make_upstream(200 * 4, 4);
  auto const got = run_router(be, state, second, 200, 16, o, upstream);
  CHECK(state.saved_logits() == logits_memory);
  CHECK(state.selected_experts() == selection_memory);
  CHECK(state.num_tokens() == 200);
  check_against_oracle(got, second, 200, 16, o, upstream);
}

}  // namespace test
