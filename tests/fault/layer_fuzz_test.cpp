// SPDX-License-Identifier: Apache-2.0
// Fuzz target of the expert-parallel layer: seeded random configurations over 1-8 in-process ranks
// (any node layout), E a multiple of the ranks up to 32, K 1..min(E, 8), H 1..40, 0-300 tokens per
// rank and step (the ranks' counts drawn apart, zeros included), masked and duplicate slots, skewed
// routing, every capacity policy (dropless; capacity<drop_by_position | drop_by_probability |
// drop_random> with factors 0-2 and with and without pad_to_capacity; receiver_budget), every
// all-to-all (flat, hierarchical_2d, pairwise{g}, smart_schedule{g}), weighted and unweighted, outputs
// declined with `not_needed`, 1-3 steps on one layer. Each step is compared with the oracle of
// tests/patterns/layer_cases.hpp: output and d_x bit for bit, dropped slots exactly, d_weights within
// that file's tolerance, widened to the fp32 bound of the dot product where that is larger (the
// file's absolute 1e-6·H assumes products of order 1; its experts scale rows by up to E = 32, and
// at E > 8 the file's tolerance fails a correct fp32 sum: seed 2 failed 59 of 20000 configurations).
//
// A quarter of the configurations are hostile on one rank at one step: a NaN weight in a valid
// slot, an out-of-range expert id, or one of x, out, d_out, d_x, d_weights a row (an element) short.
// Those must end with `invalid_argument` naming the problem on that rank, `aborted` on every other,
// each rank's steps before it right, and no output of any rank's failed call written.
//
// What the oracle covers, and so the fuzz: the plain layer with scale_experts (FasterMoE shadowing
// is checked against the plain layer in tests/patterns/shadow_cases.hpp, and faulted in
// layer_fault_test.cpp), float rows, min_capacity 0 (the oracle's capacity has no minimum). An
// unweighted layer is compared with the weighted oracle of its kept routing with every weight 1:
// fma(1, v, acc) == acc + v and 1 * g == g exactly, which is the unweighted combine and its
// backward bit for bit. Unweighted layers get null weights half the time (not under
// drop_by_probability, which ranks by weight).
//
// CTest runs 1000 configurations with seed 1. For a long run (a hang aborts the binary, naming the
// configuration; a crash kills it):
//   MOECOMM_FUZZ_RUNS=1000000 MOECOMM_FUZZ_SEED=7 build/host/tests/fault/moecomm_fault_tests -tc='layer fuzz*' -s

#include "fault_support.hpp"

#include "../patterns/layer_cases.hpp"

#include <moecomm/patterns/layer_policies.hpp>

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>

namespace test {
namespace fuzz {

using moecomm::inproc_communicator;
using moecomm::status;

enum class hostile { none, nan_weight, out_of_range_id, x_short, out_short, d_out_short, d_x_short, d_weights_short };
char const* const hostile_names[] = {"none", "NaN weight", "out-of-range id", "x short", "out short",
                                     "d_out short", "d_x short", "d_weights short"};
char const* const hostile_messages[] = {"", "is NaN in a valid slot", "is out of range", "argument 'x' has ",
                                        "argument 'out' has ", "argument 'd_out' has ", "argument 'd_x' has ",
                                        "argument 'd_weights' has "};
enum class capacity_kind { dropless, position, probability, random, budget };
char const* const capacity_names[] = {"dropless", "drop_by_position", "drop_by_probability", "drop_random", "receiver_budget"};
char const* const algorithm_names[] = {"flat", "hierarchical_2d", "pairwise", "smart_schedule"};

struct config {
  std::uint32_t seed = 0;
  int32_t ranks = 1, per_node = 1, experts = 1, top_k = 1;
  int64_t hidden = 1;
  capacity_kind capacity = capacity_kind::dropless;
  double factor = 1.0;
  bool pad = false;
  int64_t budget = 0;
  int algorithm = 0;
  int32_t group_size = 1;
  bool weighted = true, null_weights = false, want_d_x = true, want_d_weights = true;
  double masked = 0.0, zipf = 0.0;
  bool duplicates = true;
  int steps = 1;
  hostile bad = hostile::none;
  int32_t culprit = 0;
  int bad_step = 0;

  [[nodiscard]] bool forward_fault() const { return bad != hostile::none && bad <= hostile::out_short; }
  [[nodiscard]] std::string describe() const {
    std::ostringstream out;
    out << "configuration seed " << seed << ": " << ranks << " ranks (" << per_node << " per node), E=" << experts << " K=" << top_k
        << " H=" << hidden << ", " << capacity_names[static_cast<int>(capacity)];
    if (capacity != capacity_kind::dropless && capacity != capacity_kind::budget) out << " factor " << factor << (pad ? " padded" : "");
    if (capacity == capacity_kind::budget) out << " " << budget << " rows";
    out << ", " << algorithm_names[algorithm] << "{" << group_size << "}, " << (weighted ? "weighted" : "unweighted")
        << (null_weights ? " (null weights)" : "") << (want_d_x ? "" : ", d_x not_needed")
        << (want_d_weights ? "" : ", d_weights not_needed") << ", masked " << masked << (duplicates ? "" : ", no duplicates")
        << ", zipf " << zipf << ", " << steps << " steps";
    if (bad != hostile::none) out << "; hostile: " << hostile_names[static_cast<int>(bad)] << " on rank " << culprit << " at step " << bad_step;
    return out.str();
  }
};

// A divisor of n, drawn uniformly.
int32_t random_divisor(std::mt19937& rng, int32_t n) {
  std::vector<int32_t> divisors;
  for (int32_t d = 1; d <= n; ++d)
    if (n % d == 0) divisors.push_back(d);
  return divisors[rng() % divisors.size()];
}

config random_config(std::mt19937& rng) {
  config c;
  c.seed = static_cast<std::uint32_t>(rng());
  c.ranks = 1 + static_cast<int32_t>(rng() % 8);
  c.per_node = random_divisor(rng, c.ranks);
  c.experts = c.ranks * (1 + static_cast<int32_t>(rng() % static_cast<unsigned>(32 / c.ranks)));
  c.top_k = 1 + static_cast<int32_t>(rng() % static_cast<unsigned>(std::min(c.experts, 8)));
  c.hidden = 1 + static_cast<int64_t>(rng() % 40);
  c.capacity = static_cast<capacity_kind>(rng() % 5);
  c.factor = 0.25 * static_cast<double>(rng() % 9);
  c.pad = rng() % 2 == 0;
  c.budget = static_cast<int64_t>(rng() % 400);
  c.algorithm = static_cast<int>(rng() % 4);
  c.group_size = random_divisor(rng, c.ranks);
  c.weighted = rng() % 2 == 0;
  c.want_d_x = rng() % 4 != 0;
  c.want_d_weights = c.weighted && rng() % 4 != 0;
  c.masked = rng() % 3 == 0 ? 0.0 : 0.3 * static_cast<double>(rng() % 100) / 100.0;
  c.duplicates = rng() % 2 == 0;
  c.zipf = rng() % 2 == 0 ? 0.0 : 0.5 + static_cast<double>(rng() % 30) / 10.0;
  c.steps = 1 + static_cast<int>(rng() % 3);
  if (rng() % 4 == 0) {
    c.bad = static_cast<hostile>(1 + rng() % 7);
    if ((c.bad == hostile::d_x_short && !c.want_d_x) || (c.bad == hostile::d_weights_short && !c.want_d_weights)) c.bad = hostile::d_out_short;
    c.culprit = static_cast<int32_t>(rng() % static_cast<unsigned>(c.ranks));
    c.bad_step = static_cast<int>(rng() % static_cast<unsigned>(c.steps));
  }
  c.null_weights = !c.weighted && c.capacity != capacity_kind::probability && c.bad != hostile::nan_weight && rng() % 2 == 0;
  return c;
}

// Every rank's inputs for one step and, unless the routing itself is hostile, the oracle's answers.
struct step_case {
  std::vector<oracle::routing> routing, kept;  // kept: what the oracle combined (dropped slots masked)
  std::vector<std::vector<float>> x, d_out;
  std::vector<expected_rank<float>> want;
};

// The routing the oracle combines with: dropped slots masked by the policy; every weight 1 when unweighted.
std::vector<oracle::routing> kept_routing(config const& c, std::vector<oracle::routing> const& routing) {
  std::vector<oracle::routing> kept = routing;
  if (c.capacity == capacity_kind::budget) {
    kept = oracle::drop_to_receiver_budget(routing, c.experts, c.budget);
  } else if (c.capacity != capacity_kind::dropless) {
    oracle::drop_rule const rule = c.capacity == capacity_kind::position      ? oracle::drop_rule::position
                                   : c.capacity == capacity_kind::probability ? oracle::drop_rule::probability
                                                                              : oracle::drop_rule::random;
    int64_t cap = 0, first = 0;
    for (auto const& r : routing) cap = std::max(cap, oracle::capacity(r.tokens, c.top_k, c.experts, c.factor));
    for (std::size_t r = 0; r < routing.size(); ++r) {
      kept[r] = oracle::drop_to_capacity(routing[r], c.experts, cap, rule, c.seed, 0, first);
      first += routing[r].tokens;
    }
  }
  if (!c.weighted)
    for (auto& r : kept) std::fill(r.w.begin(), r.w.end(), 1.0f);
  return kept;
}

step_case make_step(config const& c, int step) {
  step_case s;
  std::mt19937 rng(c.seed * 7919u + static_cast<std::uint32_t>(step));
  bool const bad_now = c.bad != hostile::none && step == c.bad_step;
  for (int32_t r = 0; r < c.ranks; ++r) {
    int64_t tokens = rng() % 8 == 0 ? 0 : static_cast<int64_t>(rng() % 301);
    if (bad_now && r == c.culprit) tokens = std::max<int64_t>(tokens, 1);  // something to be short of
    auto const seed = static_cast<std::uint32_t>(rng());
    s.routing.push_back(make_routing({tokens, c.top_k, c.experts, c.masked, c.duplicates, c.zipf, seed}));
    s.x.push_back(finite_rows<float>(tokens, c.hidden, seed + 1));
    s.d_out.push_back(finite_rows<float>(tokens, c.hidden, seed + 2));
  }
  if (bad_now && (c.bad == hostile::nan_weight || c.bad == hostile::out_of_range_id)) {
    oracle::routing& r = s.routing[static_cast<std::size_t>(c.culprit)];
    std::size_t const slot = rng() % r.idx.size();
    if (r.idx[slot] < 0) {  // make it a valid slot first
      r.idx[slot] = static_cast<int32_t>(rng() % static_cast<unsigned>(c.experts));
      r.w[slot] = 0.5f;
    }
    if (c.bad == hostile::nan_weight) r.w[slot] = std::numeric_limits<float>::quiet_NaN();
    else r.idx[slot] = rng() % 2 == 0 ? c.experts + static_cast<int32_t>(rng() % 3) : -2 - static_cast<int32_t>(rng() % 3);
    return s;  // no oracle for a hostile routing
  }
  s.kept = kept_routing(c, s.routing);
  for (int32_t r = 0; r < c.ranks; ++r) {
    auto const& idx = s.routing[static_cast<std::size_t>(r)].idx;
    auto const valid = static_cast<int64_t>(std::count_if(idx.begin(), idx.end(), [](int32_t e) { return e >= 0; }));
    s.want.push_back(layer_oracle(s.kept[static_cast<std::size_t>(r)], valid, s.x[static_cast<std::size_t>(r)],
                                  s.d_out[static_cast<std::size_t>(r)], c.hidden, c.experts));
  }
  return s;
}

// What one rank produced in one step: its outputs (poisoned beforehand) and which calls completed.
struct rank_step {
  std::vector<float> out, d_x, d_w;
  int64_t dropped = -1;
  bool forward_done = false, backward_done = false;
};

// Calls `use(layer)` with the layer `c` describes.
template <class F>
void with_layer(moecomm::exchange_groups<inproc_communicator>& groups, config const& c, F&& use) {
  moecomm::host_backend const be;
  auto const build = [&](auto const& algorithm, auto const& capacity) {
    if (c.weighted) {
      auto layer = moecomm::make_expert_parallel_layer<float>(be, groups, c.experts, c.hidden, algorithm, capacity);
      use(layer);
    } else {
      auto layer = moecomm::make_expert_parallel_layer<float>(be, groups, c.experts, c.hidden, algorithm, capacity,
                                                              moecomm::unweighted{});
      use(layer);
    }
  };
  with_algorithm(c.algorithm, c.group_size, [&](auto const& algorithm) {
    switch (c.capacity) {
      case capacity_kind::dropless: build(algorithm, moecomm::dropless{}); break;
      case capacity_kind::position:
        build(algorithm, moecomm::capacity<moecomm::drop_by_position>{c.factor, 0, c.pad, {}});
        break;
      case capacity_kind::probability:
        build(algorithm, moecomm::capacity<moecomm::drop_by_probability>{c.factor, 0, c.pad, {}});
        break;
      case capacity_kind::random:
        build(algorithm, moecomm::capacity<moecomm::drop_random>{c.factor, 0, c.pad, {c.seed, 0}});
        break;
      case capacity_kind::budget: build(algorithm, moecomm::receiver_budget{c.budget}); break;
    }
  });
}

void run_rank(inproc_communicator comm, config const& c, std::vector<step_case> const& steps,
              std::vector<std::vector<rank_step>>& got) {
  int32_t const me = comm.rank();
  auto const at = static_cast<std::size_t>(me);
  moecomm::exchange_groups<inproc_communicator> groups(comm, moecomm::topology(c.ranks, c.per_node));
  with_layer(groups, c, [&](auto& layer) {
    scale_experts<float> const experts{me * (c.experts / c.ranks)};
    for (int step = 0; step < c.steps; ++step) {
      step_case const& in = steps[static_cast<std::size_t>(step)];
      oracle::routing const& r = in.routing[at];
      int64_t const T = r.tokens, H = c.hidden;
      int32_t const K = r.top_k;
      rank_step& o = got[static_cast<std::size_t>(step)][at];
      auto const short_by = [&](hostile h) -> int64_t { return c.bad == h && step == c.bad_step && me == c.culprit ? 1 : 0; };
      layer.forward({r.idx.data(), c.null_weights ? nullptr : r.w.data(), T, K}, {in.x[at].data(), T - short_by(hostile::x_short), H},
                    {o.out.data(), T - short_by(hostile::out_short), H}, experts);
      o.forward_done = true;
      o.dropped = layer.dispatch_state().report().dropped_slots;
      moecomm::optional_output<moecomm::matrix_view<float>> d_x = moecomm::not_needed;
      moecomm::optional_output<moecomm::array_view<float>> d_w = moecomm::not_needed;
      if (c.want_d_x) d_x = moecomm::matrix_view<float>{o.d_x.data(), T - short_by(hostile::d_x_short), H};
      if (c.want_d_weights) d_w = moecomm::array_view<float>{o.d_w.data(), T * K - short_by(hostile::d_weights_short)};
      layer.backward({in.d_out[at].data(), T - short_by(hostile::d_out_short), H}, d_x, d_w, experts);
      o.backward_done = true;
    }
  });
}

// ---- checking ----------------------------------------------------------------------------------

[[nodiscard]] bool bitwise_equal(std::vector<float> const& got, std::vector<float> const& want) {
  return got.size() == want.size() && (want.empty() || std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0);
}

[[nodiscard]] bool still_poisoned(std::vector<float> const& v) { return bitwise_equal(v, std::vector<float>(v.size(), poison<float>())); }

// How far rank r's d_weights[slot] may be from the oracle's. layer_cases.hpp (and semantics §6) allow
// relative 1e-5 plus 1e-6·H absolute, which assumes products y_h · d_out_h of order 1; scale_experts
// multiply rows by up to E = 32, and the host's H-term FMA chain then errs by up to
// γ_H · Σ_h |y_h · d_out_h| (γ_H ≈ H · 2^-24). The absolute term is the larger of the two, that bound doubled.
float d_weight_tolerance(config const& c, step_case const& s, std::size_t r, int64_t slot) {
  oracle::routing const& kept = s.kept[r];
  int32_t const e = kept.idx[static_cast<std::size_t>(slot)];
  double terms = 0.0;
  for (int64_t h = 0; e >= 0 && h < c.hidden; ++h) {
    std::size_t const at = static_cast<std::size_t>(slot / kept.top_k * c.hidden + h);
    terms += std::fabs(double(scaled(s.x[r][at], e)) * double(s.d_out[r][at]));
  }
  double const chain = 2.0 * static_cast<double>(c.hidden) * std::ldexp(terms, -24);
  float const want = s.want[r].d_w[static_cast<std::size_t>(slot)];
  return 1e-5f * std::fabs(want) + static_cast<float>(std::max(1e-6 * static_cast<double>(c.hidden), chain));
}

// What is wrong with one rank's step against the oracle (calls not completed: their outputs must be unwritten).
std::string check_rank_step(config const& c, step_case const& s, std::size_t r, rank_step const& o) {
  expected_rank<float> const* const want = s.want.empty() ? nullptr : &s.want[r];
  std::string wrong;
  if (o.forward_done && want != nullptr) {
    if (!bitwise_equal(o.out, want->out)) wrong += "output differs from the oracle; ";
    if (o.dropped != want->dropped) wrong += "dropped " + std::to_string(o.dropped) + ", oracle " + std::to_string(want->dropped) + "; ";
  }
  if (!o.forward_done && !still_poisoned(o.out)) wrong += "out written by a failed forward; ";
  if (o.backward_done && want != nullptr) {
    if (c.want_d_x && !bitwise_equal(o.d_x, want->d_x)) wrong += "d_x differs from the oracle; ";
    for (std::size_t i = 0; c.want_d_weights && i < o.d_w.size(); ++i)
      if (!(std::fabs(o.d_w[i] - want->d_w[i]) <= d_weight_tolerance(c, s, r, static_cast<int64_t>(i)))) {
        wrong += "d_weights[" + std::to_string(i) + "] = " + std::to_string(o.d_w[i]) + ", oracle " + std::to_string(want->d_w[i]) + "; ";
        break;
      }
  }
  if ((!o.backward_done || !c.want_d_x) && !still_poisoned(o.d_x)) wrong += "d_x written by a failed or declined backward; ";
  if ((!o.backward_done || !c.want_d_weights) && !still_poisoned(o.d_w)) wrong += "d_weights written by a failed or declined backward; ";
  return wrong;
}

// Everything wrong with how configuration `c` ended ("" if nothing).
std::string verdict(config const& c, std::vector<step_case> const& steps, run_result const& run, std::vector<ending> const& ends,
                    std::vector<std::vector<rank_step>> const& got) {
  std::string wrong;
  if (c.bad == hostile::none) {
    if (run.thrown.how != ending::kind::returned) wrong += "run ended with " + run.thrown.describe() + "; ";
  } else {
    char const* const fragment = hostile_messages[static_cast<int>(c.bad)];
    if (!run.thrown.is(status::invalid_argument) || run.thrown.message.find(fragment) == std::string::npos)
      wrong += "run ended with " + run.thrown.describe() + ", not invalid_argument with '" + fragment + "'; ";
    for (int32_t r = 0; r < c.ranks; ++r)
      if (!ends[static_cast<std::size_t>(r)].is(r == c.culprit ? status::invalid_argument : status::aborted))
        wrong += "rank " + std::to_string(r) + " ended with " + ends[static_cast<std::size_t>(r)].describe() + "; ";
  }
  for (std::size_t step = 0; step < steps.size(); ++step)
    for (int32_t r = 0; r < c.ranks; ++r) {
      std::string const w = check_rank_step(c, steps[step], static_cast<std::size_t>(r), got[step][static_cast<std::size_t>(r)]);
      if (!w.empty()) wrong += "step " + std::to_string(step) + " rank " + std::to_string(r) + ": " + w;
    }
  return wrong;
}

struct tally {
  std::int64_t configs = 0, correct = 0, clean_errors = 0, wrong = 0, rank_steps = 0;
};

// One configuration on a fresh world.
void run_config(config const& c, watchdog& dog, tally& t) {
  std::vector<step_case> steps;
  std::vector<std::vector<rank_step>> got;
  for (int step = 0; step < c.steps; ++step) {
    steps.push_back(make_step(c, step));
    got.emplace_back();
    for (auto const& r : steps.back().routing)
      got.back().push_back({poisoned<float>(r.tokens * c.hidden), poisoned<float>(r.tokens * c.hidden), poisoned<float>(r.tokens * r.top_k)});
  }
  moecomm::inproc_world const world(c.ranks, std::chrono::seconds(20));
  std::vector<ending> ends(static_cast<std::size_t>(c.ranks));
  run_result const run = watched_run(world, dog, c.describe(), [&](inproc_communicator comm) {
    auto [end, thrown] = capture([&] { run_rank(comm, c, steps, got); });
    ends[static_cast<std::size_t>(comm.rank())] = end;
    if (thrown) std::rethrow_exception(thrown);
  });
  std::string const wrong = verdict(c, steps, run, ends, got);
  ++t.configs;
  t.rank_steps += c.steps * c.ranks;
  if (!wrong.empty()) {
    ++t.wrong;
    FAIL_CHECK(c.describe(), ": ", wrong);
  } else {
    (c.bad == hostile::none ? t.correct : t.clean_errors) += 1;
  }
}

}  // namespace fuzz

TEST_CASE("layer fuzz: random configurations match the oracle and hostile inputs fail cleanly on every rank" *
          doctest::test_suite("fault")) {
  std::int64_t const runs = env_knob("MOECOMM_FUZZ_RUNS", 1000);
  auto const seed = static_cast<std::uint32_t>(env_knob("MOECOMM_FUZZ_SEED", 1));
  std::mt19937 rng(seed);
  watchdog dog(std::chrono::seconds(30));
  fuzz::tally t;
  for (std::int64_t i = 0; i < runs; ++i) fuzz::run_config(fuzz::random_config(rng), dog, t);
  MESSAGE("layer fuzz seed ", seed, ": ", t.configs, " configurations (", t.rank_steps, " rank-steps), ", t.correct,
          " equal to the oracle, ", t.clean_errors, " hostile ones ended with clean errors, ", t.wrong,
          " wrong, 0 hangs (else the watchdog aborts), 0 crashes");
  CHECK(t.configs == runs);
  CHECK(t.wrong == 0);
}

}  // namespace test
