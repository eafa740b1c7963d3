// SPDX-License-Identifier: Apache-2.0
#pragma once
// The recover-mode fault campaign over every pattern (issue 23), on any transport: plain expert
// parallelism, FasterMoE, Pro-Prophet's scheduled steps, Parm, HybridEP, FineMoE's replicas and
// FlexMoE's moving replicas, each on 4 ranks. A run makes 4 steps (forward and backward; each step's
// rows scaled by its number, so that steps differ). At step 1 one rank, drawn by the seed,
// - skips its backward, or its whole step;
// - passes x a row short to its forward, or d_out of the wrong width to its backward;
// - has an expert that throws a std::runtime_error in its forward.
// Every rank catches every error and goes on: the recover mode of a trainer that retries. The last
// step must then, on every rank, either fail or equal a clean run's last step bit for bit (output
// and input gradient); a rank that finishes it with other values is a silent wrong result. Every
// rank's expert parameters must also be those of the experts its slots hold (data lost otherwise).
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
#include <moecomm/plan/proprophet_planner.hpp>

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
enum class fault { skip_backward, skip_step, short_x, wrong_d_out, expert_throws };
constexpr char const* pattern_names[] = {"plain", "fastermoe", "proprophet", "parm", "hybridep", "finemoe", "flexmoe"};
constexpr char const* fault_names[] = {"skip_backward", "skip_step", "short_x", "wrong_d_out", "expert_throws"};

constexpr int steps = 4, faulty_step = 1;
shadow_case const layer_case{4, 2, 8, 2, 8, {24, 17, 0, 31}, 0.0, true};
parm_case const parm{{2, 1, 2}, 23, 8, 2};

// What one rank's step wrote, and whether it got through.
struct step_result {
  bool ok = false;
  std::vector<float> out, d_x;
  std::string errors;  //!< what the rank's calls threw, in order (all steps)
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

// One rank's step on any layer: begin (a scheduled transfer or gather), forward, backward, end
// (aggregation, rebalance), with `f` injected when `inject`; every error caught.
template <class Layer, class Experts, class Begin, class End>
step_result run_step(Layer& layer, Experts& experts, moecomm::routing_view routing, std::vector<float> const& x,
                     std::vector<float> const& d_out, std::int64_t hidden, bool inject, fault f, Begin&& begin, End&& end) {
  std::int64_t const tokens = routing.num_tokens;
  step_result r{false, poisoned<float>(tokens * hidden), poisoned<float>(tokens * hidden), {}};
  if (inject && f == fault::skip_step) return r;
  experts.armed = inject && f == fault::expert_throws;
  bool forward_ok = false;
  try {
    begin();
    std::int64_t const rows = inject && f == fault::short_x ? tokens - 1 : tokens;
    layer.forward(routing, {x.data(), rows, hidden}, {r.out.data(), tokens, hidden}, experts);
    forward_ok = true;
  } catch (std::exception const& e) {
    r.errors = e.what();
  }
  experts.armed = false;
  if (inject && f == fault::skip_backward) return r;
  try {
    std::int64_t const width = inject && f == fault::wrong_d_out ? hidden - 1 : hidden;
    layer.backward({d_out.data(), tokens, width}, {r.d_x.data(), tokens, hidden}, moecomm::not_needed, experts);
    end();
    r.ok = forward_ok;
  } catch (std::exception const& e) {
    r.errors += std::string(r.errors.empty() ? "" : " | ") + e.what();
  }
  return r;
}

// Rank `me` of pattern `p` on back-end `be`: every step, the fault at step 1 on rank `faulty` (-1: a
// clean run). Returns the last step's result; `params_intact` tells whether each slot holds its
// expert's parameters.
template <class Comm, class Backend>
step_result run_rank(Comm& comm, Backend const& be, pattern p, fault f, int faulty, bool& params_intact) {
  std::int32_t const me = comm.rank();
  shadow_case const& c = layer_case;
  auto const in = make_shadow_inputs<float>(c);
  auto const& r = in.routing[static_cast<std::size_t>(me)];
  moecomm::routing_view const routing{r.idx.data(), r.w.data(), r.tokens, r.top_k};
  auto const& x = in.x[static_cast<std::size_t>(me)];
  auto const& d_out = in.d_out[static_cast<std::size_t>(me)];
  moecomm::exchange_groups<Comm> groups(comm, moecomm::topology(c.ranks, c.per_node, 1));
  std::int32_t const locals = c.experts / c.ranks;
  step_result last;
  auto no_op = [] {};
  auto each_step = [&](auto&& one_step) {
    std::string errors;
    for (int step = 0; step < steps; ++step) {
      last = one_step(step, step == faulty_step && me == faulty);
      if (!last.errors.empty()) errors += "\n  step " + std::to_string(step) + ": " + last.errors;
    }
    last.errors = errors;
  };
  params_intact = true;
  auto check_params = [&](scale_bias_experts<float> const& experts, scale_bias_experts<float> const& expected) {
    params_intact = params_intact && experts.params == expected.params;
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
      arming<scale_bias_experts<float>> experts(me, locals, c.hidden, c.exact);
      auto run = [&](auto& layer, auto scheduled) {  // scheduled: std::true_type for Pro-Prophet's scheduled steps
        each_step([&](int step, bool inject) {
          return run_step(layer, experts, routing, scaled(x, step), scaled(d_out, step), c.hidden, inject, f,
                          [&] {
                            if constexpr (decltype(scheduled)::value) (void)layer.begin_replica_transfer(experts);
                          },
                          [&] {
                            if constexpr (decltype(scheduled)::value) layer.finish_replica_gradients();
                          });
        });
      };
      if (p == pattern::plain) {
        moecomm::expert_parallel_layer<float, Backend, Comm> layer(be, groups, c.experts, c.hidden);
        run(layer, std::false_type{});
      } else if (p == pattern::fastermoe) {
        moecomm::expert_parallel_layer<float, Backend, Comm, moecomm::dropless, moecomm::flat, moecomm::weighted,
                                       moecomm::fastermoe_shadowing<>>
            layer(be, groups, c.experts, c.hidden, {}, {}, {}, moecomm::fastermoe_shadowing<>{small_model(), {}, {}});
        run(layer, std::false_type{});
      } else {
        moecomm::expert_parallel_layer<float, Backend, Comm, moecomm::dropless, moecomm::flat, moecomm::weighted,
                                       decltype(prophet)>
            layer(be, groups, c.experts, c.hidden, {}, {}, {}, prophet);
        run(layer, std::true_type{});
      }
      check_params(experts, scale_bias_experts<float>(me, locals, c.hidden, c.exact));
      break;
    }
    case pattern::hybridep: {
      moecomm::hybridep_layer<float, Backend, Comm> layer(be, groups, c.experts, c.hidden, moecomm::hybridep{2});
      arming<scale_bias_experts<float>> experts(me, locals, c.hidden, c.exact);
      each_step([&](int step, bool inject) {
        return run_step(layer, experts, routing, scaled(x, step), scaled(d_out, step), c.hidden, inject, f,
                        [&] { layer.begin_expert_gather(experts); }, no_op);
      });
      check_params(experts, scale_bias_experts<float>(me, locals, c.hidden, c.exact));
      break;
    }
    case pattern::finemoe:
    case pattern::flexmoe: {
      moecomm::replica_placement const start = moecomm::replica_placement::cyclic(4, 4, 2);
      arming<scale_bias_experts<float>> experts(slot_experts(start, me, c.hidden));
      if (p == pattern::finemoe) {
        auto layer = moecomm::make_expert_parallel_layer<float>(be, groups, c.experts, c.hidden, moecomm::finemoe{start});
        each_step([&](int step, bool inject) {
          return run_step(layer, experts, routing, scaled(x, step), scaled(d_out, step), c.hidden, inject, f, no_op, no_op);
        });
        check_params(experts, slot_experts(layer.placement(), me, c.hidden));
      } else {
        moecomm::flexmoe_planner_options cheap;
        cheap.bytes_per_replica = 1e3;  // moves pay: replicas move between steps
        auto layer = moecomm::make_expert_parallel_layer<float>(be, groups, c.experts, c.hidden,
                                                                moecomm::flexmoe{start, {}, {cheap}});
        each_step([&](int step, bool inject) {
          return run_step(layer, experts, routing, scaled(x, step), scaled(d_out, step), c.hidden, inject, f, no_op,
                          [&] { (void)layer.rebalance(experts); });
        });
        check_params(experts, slot_experts(layer.placement(), me, c.hidden));
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
      arming<sliced_mlp_experts<float>> experts(initial);
      moecomm::parm_layer<float, Backend, Comm, moecomm::parm_s1> layer(be, parm_groups, parm.experts, parm_hidden);
      moecomm::routing_view const parm_view{pr.idx.data(), pr.w.data(), parm.tokens, parm.top_k};
      each_step([&](int step, bool inject) {
        return run_step(layer, experts, parm_view, scaled(px, step), scaled(pd, step), parm_hidden, inject, f, no_op, no_op);
      });
      params_intact = experts.params == initial.params;
      break;
    }
  }
  return last;
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

// The campaign on one transport: `seeds` runs per pattern and fault, each on a fresh world of 4 ranks.
// `run_world(what, per_rank, clean)` runs `per_rank(comm, be)` on every rank of a new world (with a
// long timeout when `clean`, else a short one) and returns whether a rank waited out that timeout.
template <class RunWorld>
tally run_campaign(char const* transport, std::int64_t seeds, RunWorld&& run_world) {
  tally total;
  for (int pi = 0; pi < 7; ++pi) {
    auto const p = static_cast<pattern>(pi);
    std::vector<step_result> clean(4);
    run_world(std::string(pattern_names[pi]) + " / clean", [&](auto& comm, auto const& be) {
      bool intact = true;
      clean[static_cast<std::size_t>(comm.rank())] = run_rank(comm, be, p, fault::skip_backward, -1, intact);
      REQUIRE(intact);
    }, true);
    for (step_result const& r : clean) REQUIRE_MESSAGE(r.ok, pattern_names[pi], ": the clean run failed on ", transport);
    std::mt19937 rng(static_cast<std::uint32_t>(1000 + pi));
    tally mine;
    for (int fi = 0; fi < 5; ++fi)
      for (std::int64_t seed = 0; seed < seeds; ++seed) {
        auto const f = static_cast<fault>(fi);
        int const faulty = static_cast<int>(rng() % 4);
        std::string const what = std::string(transport) + ": " + pattern_names[pi] + " / " + fault_names[fi] + " on rank " + std::to_string(faulty);
        std::vector<step_result> got(4);
        std::vector<int> intact(4, 1);
        bool const timed_out = run_world(what, [&](auto& comm, auto const& be) {
          bool ok = true;
          got[static_cast<std::size_t>(comm.rank())] = run_rank(comm, be, p, f, faulty, ok);
          intact[static_cast<std::size_t>(comm.rank())] = ok ? 1 : 0;
        }, false);
        ++mine.runs;
        bool silent = false, lost = false, any_failed = false;
        for (std::size_t q = 0; q < 4; ++q) {
          lost = lost || intact[q] == 0;
          if (!got[q].ok) {
            any_failed = true;
            continue;
          }
          silent = silent || got[q].out != clean[q].out || got[q].d_x != clean[q].d_x;
        }
        std::string all_errors;
        for (std::size_t q = 0; q < 4; ++q) all_errors += "\n rank " + std::to_string(q) + (got[q].ok ? " ok" : " failed") + got[q].errors;
        CHECK_MESSAGE(!silent, what, ": a rank finished with other values; the ranks' errors:", all_errors);
        CHECK_MESSAGE(!lost, what, ": a slot lost its expert's parameters");
        if (timed_out && std::getenv("MOECOMM_RECOVERY_VERBOSE") != nullptr) std::printf("%s timed out:%s\n", what.c_str(), all_errors.c_str());
        mine.silent_wrong += silent ? 1 : 0;
        mine.data_lost += lost ? 1 : 0;
        mine.timeouts += timed_out ? 1 : 0;
        mine.clean_errors += !silent && any_failed ? 1 : 0;
        mine.recovered += !silent && !any_failed ? 1 : 0;
      }
    mine.print(transport, pattern_names[pi]);
    total += mine;
  }
  total.print(transport, "all");
  return total;
}

}  // namespace recovery
}  // namespace test
