// SPDX-License-Identifier: Apache-2.0
#pragma once
// The recover-mode fault campaign over every pattern, on any transport: plain expert
// parallelism, FasterMoE, Pro-Prophet's scheduled steps, Parm, HybridEP, FineMoE's replicas and
// FlexMoE's moving replicas, each on 4 ranks, each rank with two layers of the pattern (made alike,
// with the same experts). A run makes 4 steps (forward and backward; each step's rows scaled by its
// number, so that steps differ) of the first layer, or, in a `swapped_layers` run, of both. At step 1
// (at step 0 for the faults "at the first call") one rank, drawn by the seed,
// - skips its backward, or its whole step, or its very first step;
// - passes x a row short to its forward (also at its very first call), or d_out of the wrong width
//   to its backward;
// - has an expert that throws a std::runtime_error in its forward;
// - runs the backward twice (`retain_graph`), while its peers run it once;
// - calls its two layers in the other order than its peers;
// - routes each token to one expert fewer (top_k - 1) than the others' top_k.
// Every rank catches every error and goes on: the recover mode of a trainer that retries. Every step
// of every layer must then, on every rank, either fail or equal a clean run's bit for bit (output and
// input gradient; except the faulty rank's own step under a different top_k, which computes another
// routing); a rank that finishes one with other values is a silent wrong result. Every rank's expert
// parameters must also be those of the experts its slots hold (data lost otherwise).
//
// `check_second_backward` runs every pattern with two backwards of step 1's forward on every rank:
// the experts' gradients must equal a run whose step 1 has twice the output gradient (with the exact
// payloads used, g + g == 2 g), and every step's output and input gradient a clean run's.
//
// pattern_recovery_test.cpp runs it on in-process ranks (host.fault.*), tests/simulation on
// SimGrid's simulated ranks (sim.*). Not on MPI: there most faults end in a timeout (a collective
// the peers never join cannot be cancelled), after which MPI may still write into the receive
// buffers of the failed call, which the layer frees; retrying on that communicator is unsupported
// (moecomm/comm/mpi.hpp: make a new communicator, or end the process).

#include "fault_support.hpp"

#include "../patterns/parm_cases.hpp"
#include "../patterns/replicated_cases.hpp"

#include <moecomm/patterns/fastermoe.hpp>
#include <moecomm/patterns/finemoe.hpp>
#include <moecomm/patterns/flexmoe.hpp>
#include <moecomm/patterns/hybridep.hpp>
#include <moecomm/patterns/parm.hpp>
#include <moecomm/planners/proprophet_planner.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace test {
namespace recovery {

enum class pattern { plain, fastermoe, proprophet, parm, hybridep, finemoe, flexmoe };
enum class fault {
  skip_backward, skip_step, short_x, wrong_d_out, expert_throws, second_backward, swapped_layers, short_x_at_first,
  skip_first_step, top_k_differs,
  doubled_d_out  // not a fault: `check_second_backward`'s reference (step 1's d_out times 2 on the chosen ranks)
};
constexpr int pattern_count = 7, fault_count = 10;
constexpr char const* pattern_names[] = {"plain", "fastermoe", "proprophet", "parm", "hybridep", "finemoe", "flexmoe"};
constexpr char const* fault_names[] = {"skip_backward",   "skip_step",        "short_x",         "wrong_d_out",
                                       "expert_throws",   "second_backward",  "swapped_layers",  "short_x_at_first",
                                       "skip_first_step", "top_k_differs",    "doubled_d_out"};

constexpr int steps = 4;
constexpr int every_rank = -2;  //!< `faulty`: the fault on every rank
shadow_case const layer_case{4, 2, 8, 2, 8, {24, 17, 0, 31}, 0.0, true};
parm_case const parm{{2, 1, 2}, 23, 8, 2};

//! The step a fault strikes at.
constexpr int fault_step(fault f) { return f == fault::short_x_at_first || f == fault::skip_first_step ? 0 : 1; }

// What one rank's step of one layer wrote, and whether it got through.
struct step_result {
  bool ok = false;
  std::vector<float> out, d_x;
  std::string errors;  //!< what the rank's calls threw, in order
};

// What one rank's run left: every step's result of each layer (the second layer's only in a
// `swapped_layers` run), every error, and the experts' gradients at the end.
struct rank_run {
  std::vector<step_result> first, second;  //!< [steps]
  std::string errors;
  std::vector<float> grads;
  [[nodiscard]] bool last_ok() const { return first.back().ok && (second.empty() || second.back().ok); }
};

// Experts `E` whose forward throws while `armed`.
template <class E>
struct arming : E {
  using E::E;
  explicit arming(E const& e) : E(e) {}
  bool armed = false;
  void forward(float const* p, moecomm::matrix_view<float const> in, moecomm::matrix_view<float> out) const {
    if (armed) throw std::runtime_error("an expert failed");
    E::forward(p, in, out);
  }
};

// Rank rows of one step: the inputs scaled by the step's number (exact: small integers times dyadics).
std::vector<float> scaled(std::vector<float> v, int step) {
  for (float& f : v) f *= static_cast<float>(step + 1);
  return v;
}

// A routing's first `top_k` slots of each token.
struct narrowed_routing {
  std::vector<std::int32_t> idx;
  std::vector<float> w;
  moecomm::routing_view view;
  narrowed_routing(moecomm::routing_view r, std::int32_t top_k) : view(r) {
    for (std::int64_t t = 0; t < r.num_tokens; ++t)
      for (std::int32_t k = 0; k < top_k; ++k) {
        idx.push_back(r.topk_idx[t * r.top_k + k]);
        w.push_back(r.topk_weights[t * r.top_k + k]);
      }
    view = {idx.data(), w.data(), r.num_tokens, top_k};
  }
};

// One rank's step on any layer: begin (a scheduled transfer or gather), forward, backward (twice
// under `second_backward`; with d_out doubled under `doubled_d_out`), end (aggregation, rebalance),
// with `f` injected when `inject`; every error caught.
template <class Layer, class Experts, class Begin, class End>
step_result run_step(Layer& layer, Experts& experts, moecomm::routing_view routing, std::vector<float> const& x,
                     std::vector<float> d_out, std::int64_t hidden, bool inject, fault f, Begin&& begin, End&& end) {
  std::int64_t const tokens = routing.num_tokens;
  step_result r{false, poisoned<float>(tokens * hidden), poisoned<float>(tokens * hidden), {}};
  if (inject && (f == fault::skip_step || f == fault::skip_first_step)) return r;
  experts.armed = inject && f == fault::expert_throws;
  narrowed_routing const narrow(routing, routing.top_k - 1);
  bool forward_ok = false;
  try {
    begin();
    std::int64_t const rows = inject && (f == fault::short_x || f == fault::short_x_at_first) ? tokens - 1 : tokens;
    layer.forward(inject && f == fault::top_k_differs ? narrow.view : routing, {x.data(), rows, hidden},
                  {r.out.data(), tokens, hidden}, experts);
    forward_ok = true;
  } catch (std::exception const& e) {
    r.errors = e.what();
  }
  experts.armed = false;
  if (inject && f == fault::skip_backward) return r;
  if (inject && f == fault::doubled_d_out)
    for (float& v : d_out) v *= 2.0f;
  try {
    std::int64_t const width = inject && f == fault::wrong_d_out ? hidden - 1 : hidden;
    layer.backward({d_out.data(), tokens, width}, {r.d_x.data(), tokens, hidden}, moecomm::not_needed, experts);
    if (inject && f == fault::second_backward) {
      std::vector<float> again = poisoned<float>(tokens * hidden);
      layer.backward({d_out.data(), tokens, hidden}, {again.data(), tokens, hidden}, moecomm::not_needed, experts);
      if (again != r.d_x) throw std::runtime_error("the second backward gave another input gradient");
    }
    end();
    r.ok = forward_ok;
  } catch (std::exception const& e) {
    r.errors += std::string(r.errors.empty() ? "" : " | ") + e.what();
  }
  return r;
}

// Rank `me` of pattern `p` on back-end `be`: every step, the fault on rank `faulty` (-1: a clean run;
// `every_rank`); `params_intact` tells whether each slot holds its expert's parameters at the end.
template <class Comm, class Backend>
rank_run run_rank(Comm& comm, Backend const& be, pattern p, fault f, int faulty, bool& params_intact) {
  std::int32_t const me = comm.rank();
  shadow_case const& c = layer_case;
  auto const in = make_shadow_inputs<float>(c);
  auto const& r = in.routing[static_cast<std::size_t>(me)];
  moecomm::routing_view const routing{r.idx.data(), r.w.data(), r.tokens, r.top_k};
  auto const& x = in.x[static_cast<std::size_t>(me)];
  auto const& d_out = in.d_out[static_cast<std::size_t>(me)];
  moecomm::exchange_groups<Comm> groups(comm, moecomm::topology(c.ranks, c.per_node, 1));
  std::int32_t const locals = c.experts / c.ranks;
  bool const faulty_here = faulty == every_rank || faulty == me;
  bool const two_layers = f == fault::swapped_layers;
  rank_run run;
  run.first.resize(steps);
  if (two_layers) run.second.resize(steps);
  auto no_op = [] {};
  // `one_step(step, inject, layer)`, layer 0 or 1, each step (both layers' in the order the fault says).
  auto each_step = [&](auto&& one_step) {
    for (int step = 0; step < steps; ++step) {
      bool const inject = faulty_here && step == fault_step(f);
      int const order[2] = {two_layers && inject ? 1 : 0, two_layers && inject ? 0 : 1};
      for (int layer : order) {
        if (layer == 1 && !two_layers) continue;
        step_result& got = (layer == 0 ? run.first : run.second)[static_cast<std::size_t>(step)];
        got = one_step(step, inject && !two_layers, layer);
        if (!got.errors.empty()) run.errors += "\n  step " + std::to_string(step) + ", layer " + std::to_string(layer) + ": " + got.errors;
      }
    }
  };
  params_intact = true;
  auto finish = [&](auto const& experts, auto const& expected) {
    params_intact = params_intact && experts.params == expected.params;
    run.grads = experts.grads;
  };
  switch (p) {
    case pattern::plain:
    case pattern::fastermoe:
    case pattern::proprophet: {
      moecomm::proprophet_cost_params prophet_costs;
      prophet_costs.hidden = c.hidden;
      prophet_costs.balance_factor = 0;
      moecomm::fastermoe_shadowing<moecomm::point_to_point_path, moecomm::proprophet_planner<>> prophet{small_model(), {}, {}};
      prophet.planner.model = moecomm::proprophet_cost_model(prophet_costs);
      arming<scale_bias_experts<float>> experts(me, locals, c.hidden, c.exact), other_experts = experts;
      auto run_pair = [&](auto& layer, auto& other, auto scheduled) {  // scheduled: std::true_type for Pro-Prophet's scheduled steps
        each_step([&](int step, bool inject, int which) {
          auto& l = which == 0 ? layer : other;
          auto& e = which == 0 ? experts : other_experts;
          return run_step(l, e, routing, scaled(x, step), scaled(d_out, step), c.hidden, inject, f,
                          [&] {
                            if constexpr (decltype(scheduled)::value) (void)l.begin_replica_transfer(e);
                          },
                          [&] {
                            if constexpr (decltype(scheduled)::value) l.finish_replica_gradients();
                          });
        });
      };
      if (p == pattern::plain) {
        using layer_t = moecomm::expert_parallel_layer<float, Backend, Comm>;
        layer_t layer(be, groups, c.experts, c.hidden), other(be, groups, c.experts, c.hidden);
        run_pair(layer, other, std::false_type{});
      } else if (p == pattern::fastermoe) {
        using layer_t = moecomm::expert_parallel_layer<float, Backend, Comm, moecomm::dropless, moecomm::flat, moecomm::weighted,
                                                       moecomm::fastermoe_shadowing<>>;
        moecomm::fastermoe_shadowing<> const policy{small_model(), {}, {}};
        layer_t layer(be, groups, c.experts, c.hidden, {}, {}, {}, policy), other(be, groups, c.experts, c.hidden, {}, {}, {}, policy);
        run_pair(layer, other, std::false_type{});
      } else {
        using layer_t = moecomm::expert_parallel_layer<float, Backend, Comm, moecomm::dropless, moecomm::flat, moecomm::weighted,
                                                       decltype(prophet)>;
        layer_t layer(be, groups, c.experts, c.hidden, {}, {}, {}, prophet), other(be, groups, c.experts, c.hidden, {}, {}, {}, prophet);
        run_pair(layer, other, std::true_type{});
      }
      finish(experts, scale_bias_experts<float>(me, locals, c.hidden, c.exact));
      break;
    }
    case pattern::hybridep: {
      using layer_t = moecomm::hybridep_layer<float, Backend, Comm>;
      layer_t layer(be, groups, c.experts, c.hidden, moecomm::hybridep{2}), other(be, groups, c.experts, c.hidden, moecomm::hybridep{2});
      arming<scale_bias_experts<float>> experts(me, locals, c.hidden, c.exact), other_experts = experts;
      each_step([&](int step, bool inject, int which) {
        auto& l = which == 0 ? layer : other;
        auto& e = which == 0 ? experts : other_experts;
        return run_step(l, e, routing, scaled(x, step), scaled(d_out, step), c.hidden, inject, f, [&] { l.begin_expert_gather(e); },
                        no_op);
      });
      finish(experts, scale_bias_experts<float>(me, locals, c.hidden, c.exact));
      break;
    }
    case pattern::finemoe:
    case pattern::flexmoe: {
      moecomm::replica_placement const start = moecomm::replica_placement::cyclic(4, 4, 2);
      arming<scale_bias_experts<float>> experts(slot_experts(start, me, c.hidden)), other_experts = experts;
      if (p == pattern::finemoe) {
        auto layer = moecomm::make_expert_parallel_layer<float>(be, groups, c.experts, c.hidden, moecomm::finemoe{start});
        auto other = moecomm::make_expert_parallel_layer<float>(be, groups, c.experts, c.hidden, moecomm::finemoe{start});
        each_step([&](int step, bool inject, int which) {
          return run_step(which == 0 ? layer : other, which == 0 ? experts : other_experts, routing, scaled(x, step),
                          scaled(d_out, step), c.hidden, inject, f, no_op, no_op);
        });
        finish(experts, slot_experts(layer.placement(), me, c.hidden));
      } else {
        moecomm::flexmoe_planner_options cheap;
        cheap.bytes_per_replica = 1e3;  // moves pay: replicas move between steps
        auto layer = moecomm::make_expert_parallel_layer<float>(be, groups, c.experts, c.hidden, moecomm::flexmoe{start, {}, {cheap}});
        auto other = moecomm::make_expert_parallel_layer<float>(be, groups, c.experts, c.hidden, moecomm::flexmoe{start, {}, {cheap}});
        each_step([&](int step, bool inject, int which) {
          auto& l = which == 0 ? layer : other;
          auto& e = which == 0 ? experts : other_experts;
          return run_step(l, e, routing, scaled(x, step), scaled(d_out, step), c.hidden, inject, f, no_op,
                          [&] { (void)l.rebalance(e); });
        });
        finish(experts, slot_experts(layer.placement(), me, c.hidden));
      }
      break;
    }
    case pattern::parm: {
      moecomm::parallel_groups<Comm> parm_groups(comm, parm.sizes);
      auto const at = parm_groups.coordinates();
      std::int32_t const group = at.dp * parm.sizes.expert + at.ep;
      oracle::routing const pr = parm_routing(group, parm);
      std::vector<float> const px = parm_rows<float>(group, 0, parm.tokens, parm_hidden), pd = parm_rows<float>(group, 1, parm.tokens, parm_hidden);
      sliced_mlp_experts<float> const initial = parm_rank_experts<float>(at, parm);
      arming<sliced_mlp_experts<float>> experts(initial), other_experts(initial);
      using layer_t = moecomm::parm_layer<float, Backend, Comm, moecomm::parm_s1>;
      layer_t layer(be, parm_groups, parm.experts, parm_hidden), other(be, parm_groups, parm.experts, parm_hidden);
      moecomm::routing_view const parm_view{pr.idx.data(), pr.w.data(), parm.tokens, parm.top_k};
      each_step([&](int step, bool inject, int which) {
        return run_step(which == 0 ? layer : other, which == 0 ? experts : other_experts, parm_view, scaled(px, step),
                        scaled(pd, step), parm_hidden, inject, f, no_op, no_op);
      });
      finish(experts, initial);
      break;
    }
  }
  return run;
}

// What a campaign counted.
struct tally {
  std::int64_t runs = 0, clean_errors = 0, recovered = 0, silent_wrong = 0, data_lost = 0, timeouts = 0;

  tally& operator+=(tally const& o) {
    runs += o.runs;
    clean_errors += o.clean_errors;
    recovered += o.recovered;
    silent_wrong += o.silent_wrong;
    data_lost += o.data_lost;
    timeouts += o.timeouts;
    return *this;
  }
  void print(char const* transport, char const* pattern) const {
    std::printf("pattern recovery on %s, %-10s: %3lld runs, %3lld clean errors, %3lld recovered, %lld silent wrong, %lld data lost, "
                "%lld timeouts, 0 crashes\n",
                transport, pattern, static_cast<long long>(runs), static_cast<long long>(clean_errors), static_cast<long long>(recovered),
                static_cast<long long>(silent_wrong), static_cast<long long>(data_lost), static_cast<long long>(timeouts));
    std::fflush(stdout);
  }
};

// Whether any step of any layer of `got` finished with values other than `clean`'s (the faulty
// rank's own step under a different top_k computes another routing: not compared).
inline bool silently_wrong(rank_run const& got, rank_run const& clean, fault f, bool faulty_here) {
  for (std::size_t s = 0; s < static_cast<std::size_t>(steps); ++s) {
    if (f == fault::top_k_differs && faulty_here && s == static_cast<std::size_t>(fault_step(f))) continue;
    for (std::vector<step_result> const* layer : {&got.first, &got.second})
      if (!layer->empty() && (*layer)[s].ok && ((*layer)[s].out != clean.first[s].out || (*layer)[s].d_x != clean.first[s].d_x))
        return true;
  }
  return false;
}

// Every rank's clean run of pattern `pi` (one layer).
template <class RunWorld>
std::vector<rank_run> clean_runs(char const* transport, int pi, RunWorld&& run_world) {
  std::vector<rank_run> clean(4);
  run_world(std::string(pattern_names[pi]) + " / clean", [&](auto& comm, auto const& be) {
    bool intact = true;
    clean[static_cast<std::size_t>(comm.rank())] = run_rank(comm, be, static_cast<pattern>(pi), fault::skip_backward, -1, intact);
    REQUIRE(intact);
  }, true);
  for (rank_run const& r : clean) REQUIRE_MESSAGE(r.last_ok(), pattern_names[pi], ": the clean run failed on ", transport, ":", r.errors);
  return clean;
}

// The campaign on one transport: `seeds` runs per pattern and fault, each on a fresh world of 4 ranks.
// `run_world(what, per_rank, clean)` runs `per_rank(comm, be)` on every rank of a new world (with a
// long timeout when `clean`, else a short one) and returns whether a rank waited out that timeout.
// Prints a line per pattern and per fault, and returns the total.
template <class RunWorld>
tally run_campaign(char const* transport, std::int64_t seeds, RunWorld&& run_world) {
  tally total, by_fault[fault_count];
  for (int pi = 0; pi < pattern_count; ++pi) {
    auto const p = static_cast<pattern>(pi);
    std::vector<rank_run> const clean = clean_runs(transport, pi, run_world);
    std::mt19937 rng(static_cast<std::uint32_t>(1000 + pi));
    tally mine;
    for (int fi = 0; fi < fault_count; ++fi)
      for (std::int64_t seed = 0; seed < seeds; ++seed) {
        auto const f = static_cast<fault>(fi);
        int const faulty = static_cast<int>(rng() % 4);
        std::string const what = std::string(transport) + ": " + pattern_names[pi] + " / " + fault_names[fi] + " on rank " + std::to_string(faulty);
        std::vector<rank_run> got(4);
        std::vector<int> intact(4, 1);
        bool const timed_out = run_world(what, [&](auto& comm, auto const& be) {
          bool ok = true;
          got[static_cast<std::size_t>(comm.rank())] = run_rank(comm, be, p, f, faulty, ok);
          intact[static_cast<std::size_t>(comm.rank())] = ok ? 1 : 0;
        }, false);
        tally one;
        one.runs = 1;
        bool silent = false, lost = false, any_failed = false;
        for (std::size_t q = 0; q < 4; ++q) {
          lost = lost || intact[q] == 0;
          any_failed = any_failed || !got[q].last_ok();
          silent = silent || silently_wrong(got[q], clean[q], f, static_cast<int>(q) == faulty);
        }
        std::string all_errors;
        for (std::size_t q = 0; q < 4; ++q)
          all_errors += "\n rank " + std::to_string(q) + (got[q].last_ok() ? " ok" : " failed") + got[q].errors;
        CHECK_MESSAGE(!silent, what, ": a rank finished a step with other values; the ranks' errors:", all_errors);
        CHECK_MESSAGE(!lost, what, ": a slot lost its expert's parameters");
        char const* const show = std::getenv("MOECOMM_RECOVERY_SHOW");  // a part of the runs' names to print the errors of
        if ((timed_out && std::getenv("MOECOMM_RECOVERY_VERBOSE") != nullptr) || (show != nullptr && what.find(show) != std::string::npos))
          std::printf("%s%s:%s\n", what.c_str(), timed_out ? " timed out" : "", all_errors.c_str());
        one.silent_wrong = silent ? 1 : 0;
        one.data_lost = lost ? 1 : 0;
        one.timeouts = timed_out ? 1 : 0;
        one.clean_errors = !silent && any_failed ? 1 : 0;
        one.recovered = !silent && !any_failed ? 1 : 0;
        mine += one;
        by_fault[fi] += one;
      }
    mine.print(transport, pattern_names[pi]);
    total += mine;
  }
  for (int fi = 0; fi < fault_count; ++fi) by_fault[fi].print(transport, fault_names[fi]);
  total.print(transport, "all");
  return total;
}

// Two backwards of one forward on every rank, for every pattern (file comment): each adds the
// gradients once, as a run with twice the output gradient does, and the outputs are a clean run's.
template <class RunWorld>
void check_second_backward(char const* transport, RunWorld&& run_world) {
  for (int pi = 0; pi < pattern_count; ++pi) {
    std::string const name = pattern_names[pi];
    CAPTURE(name);
    std::vector<rank_run> const clean = clean_runs(transport, pi, run_world);
    std::vector<rank_run> twice(4), doubled(4);
    for (auto [f, runs] : {std::pair{fault::second_backward, &twice}, std::pair{fault::doubled_d_out, &doubled}})
      run_world(std::string(pattern_names[pi]) + " / " + fault_names[static_cast<int>(f)] + " on every rank",
                [&, f = f, runs = runs](auto& comm, auto const& be) {
                  bool intact = true;
                  (*runs)[static_cast<std::size_t>(comm.rank())] = run_rank(comm, be, static_cast<pattern>(pi), f, every_rank, intact);
                },
                true);
    for (std::size_t q = 0; q < 4; ++q) {
      CAPTURE(q);
      REQUIRE_MESSAGE(twice[q].last_ok(), twice[q].errors);
      REQUIRE_MESSAGE(doubled[q].last_ok(), doubled[q].errors);
      CHECK_FALSE(silently_wrong(twice[q], clean[q], fault::second_backward, true));
      CHECK(twice[q].grads == doubled[q].grads);
      CHECK(twice[q].grads != clean[q].grads);
    }
  }
}

}  // namespace recovery
}  // namespace test
