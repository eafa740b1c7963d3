// SPDX-License-Identifier: Apache-2.0
// The recover-mode fault campaign over every pattern (issue 23): plain expert parallelism,
// FasterMoE, Pro-Prophet's scheduled steps, Parm, HybridEP, FineMoE's replicas and FlexMoE's moving
// replicas, each on 4 in-process ranks. A run makes 4 steps (forward and backward; each step's rows
// scaled by its number, so that steps differ). At step 1 one rank, drawn by the seed,
// - skips its backward, or its whole step;
// - passes x a row short to its forward, or d_out of the wrong width to its backward;
// - has an expert that throws a std::runtime_error in its forward.
// Every rank catches every error and goes on: the recover mode of a trainer that retries. The last
// step must then, on every rank, either fail or equal a clean run's last step bit for bit (output
// and input gradient); a rank that finishes it with other values is a silent wrong result. Every
// rank's expert parameters must also be those of the experts its slots hold (data lost otherwise).
// A run must end within the watchdog's 30 s (a hang aborts the binary, naming the run; a crash ends
// the binary, which CTest reports).
//
// The counts (runs, clean errors, recovered, silent wrong, data lost, and runs in which a rank
// waited out the world's 1 s timeout) are printed; silent wrong and data lost must be 0. CTest runs 210 runs (7 patterns x 5 faults x 6
// seeds). For a long run:
//   MOECOMM_RECOVERY_RUNS=20 build/tests/fault/moecomm_fault_tests -tc='pattern recovery*' -s

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

using comm_t = moecomm::inproc_communicator;
using moecomm::host_backend;

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

// Rank `me` of pattern `p`: every step, the fault at step 1 on rank `faulty` (-1: a clean run). Returns
// the last step's result; `params_intact` tells whether each slot holds its expert's parameters.
step_result run_rank(comm_t& comm, pattern p, fault f, int faulty, bool& params_intact) {
  std::int32_t const me = comm.rank();
  shadow_case const& c = layer_case;
  auto const in = make_shadow_inputs<float>(c);
  auto const& r = in.routing[static_cast<std::size_t>(me)];
  moecomm::routing_view const routing{r.idx.data(), r.w.data(), r.tokens, r.top_k};
  auto const& x = in.x[static_cast<std::size_t>(me)];
  auto const& d_out = in.d_out[static_cast<std::size_t>(me)];
  moecomm::exchange_groups<comm_t> groups(comm, moecomm::topology(c.ranks, c.per_node, 1));
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
        moecomm::expert_parallel_layer<float, host_backend, comm_t> layer(host_backend{}, groups, c.experts, c.hidden);
        run(layer, std::false_type{});
      } else if (p == pattern::fastermoe) {
        moecomm::expert_parallel_layer<float, host_backend, comm_t, moecomm::dropless, moecomm::flat, moecomm::weighted,
                                       moecomm::fastermoe_shadowing<>>
            layer(host_backend{}, groups, c.experts, c.hidden, {}, {}, {}, moecomm::fastermoe_shadowing<>{small_model(), {}, {}});
        run(layer, std::false_type{});
      } else {
        moecomm::expert_parallel_layer<float, host_backend, comm_t, moecomm::dropless, moecomm::flat, moecomm::weighted,
                                       decltype(prophet)>
            layer(host_backend{}, groups, c.experts, c.hidden, {}, {}, {}, prophet);
        run(layer, std::true_type{});
      }
      check_params(experts, scale_bias_experts<float>(me, locals, c.hidden, c.exact));
      break;
    }
    case pattern::hybridep: {
      moecomm::hybridep_layer<float, host_backend, comm_t> layer(host_backend{}, groups, c.experts, c.hidden, moecomm::hybridep{2});
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
        auto layer = moecomm::make_expert_parallel_layer<float>(host_backend{}, groups, c.experts, c.hidden, moecomm::finemoe{start});
        each_step([&](int step, bool inject) {
          return run_step(layer, experts, routing, scaled(x, step), scaled(d_out, step), c.hidden, inject, f, no_op, no_op);
        });
        check_params(experts, slot_experts(layer.placement(), me, c.hidden));
      } else {
        moecomm::flexmoe_planner_options cheap;
        cheap.bytes_per_replica = 1e3;  // moves pay: replicas move between steps
        auto layer = moecomm::make_expert_parallel_layer<float>(host_backend{}, groups, c.experts, c.hidden,
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
      moecomm::parallel_groups<comm_t> parm_groups(comm, parm.sizes);
      auto const at = parm_groups.coordinates();
      std::int32_t const group = at.dp * parm.sizes.expert + at.ep;
      oracle::routing const pr = parm_routing(group, parm);
      std::vector<float> const px = parm_rows<float>(group, 0, parm.tokens, parm_hidden), pd = parm_rows<float>(group, 1, parm.tokens, parm_hidden);
      sliced_mlp_experts<float> const initial = parm_rank_experts<float>(at, parm);
      arming<sliced_mlp_experts<float>> experts(initial);
      moecomm::parm_layer<float, host_backend, comm_t, moecomm::parm_s1> layer(host_backend{}, parm_groups, parm.experts, parm_hidden);
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

struct tally {
  std::int64_t runs = 0, clean_errors = 0, recovered = 0, silent_wrong = 0, data_lost = 0, timeouts = 0;
};

TEST_CASE("pattern recovery: after a fault, every rank's last step fails or equals a clean run, for every pattern" *
          doctest::test_suite("fault")) {
  std::int64_t const seeds = env_knob("MOECOMM_RECOVERY_RUNS", 6);
  watchdog dog(std::chrono::seconds(30));
  tally total;
  for (int pi = 0; pi < 7; ++pi) {
    auto const p = static_cast<pattern>(pi);
    std::vector<step_result> clean(4);
    moecomm::inproc_world const clean_world(4, std::chrono::seconds(10));
    clean_world.run([&](comm_t comm) {
      bool intact = true;
      clean[static_cast<std::size_t>(comm.rank())] = run_rank(comm, p, fault::skip_backward, -1, intact);
      REQUIRE(intact);
    });
    for (step_result const& r : clean) REQUIRE_MESSAGE(r.ok, pattern_names[pi], ": the clean run failed");
    std::mt19937 rng(static_cast<std::uint32_t>(1000 + pi));
    tally mine;
    for (int fi = 0; fi < 5; ++fi)
      for (std::int64_t seed = 0; seed < seeds; ++seed) {
        auto const f = static_cast<fault>(fi);
        int const faulty = static_cast<int>(rng() % 4);
        std::vector<step_result> got(4);
        std::vector<int> intact(4, 1);
        moecomm::inproc_world const world(4, std::chrono::milliseconds(1000));
        auto const run = watched_run(world, dog, std::string(pattern_names[pi]) + " / " + fault_names[fi] + " on rank " + std::to_string(faulty),
                                     [&](comm_t comm) {
                                       bool ok = true;
                                       got[static_cast<std::size_t>(comm.rank())] = run_rank(comm, p, f, faulty, ok);
                                       intact[static_cast<std::size_t>(comm.rank())] = ok ? 1 : 0;
                                     });
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
        std::string const what = std::string(pattern_names[pi]) + " / " + fault_names[fi] + " on rank " + std::to_string(faulty);
        std::string all_errors;
        for (std::size_t q = 0; q < 4; ++q) all_errors += "\n rank " + std::to_string(q) + (got[q].ok ? " ok" : " failed") + got[q].errors;
        CHECK_MESSAGE(!silent, what, ": a rank finished with other values; the ranks' errors:", all_errors);
        CHECK_MESSAGE(!lost, what, ": a slot lost its expert's parameters");
        // A rank that waited out the world's 1 s timeout: a bounded wait, not a hang (the watchdog catches those).
        bool const timed_out = run.took >= std::chrono::milliseconds(1000);
        if (timed_out && std::getenv("MOECOMM_RECOVERY_VERBOSE") != nullptr) std::printf("%s took %lld ms:%s\n", what.c_str(), static_cast<long long>(run.took.count()), all_errors.c_str());
        mine.silent_wrong += silent ? 1 : 0;
        mine.data_lost += lost ? 1 : 0;
        mine.timeouts += timed_out ? 1 : 0;
        mine.clean_errors += !silent && any_failed ? 1 : 0;
        mine.recovered += !silent && !any_failed ? 1 : 0;
      }
    std::printf("pattern recovery, %-10s: %3lld runs, %3lld clean errors, %3lld recovered, %lld silent wrong, %lld data lost, %lld timeouts\n",
                pattern_names[pi], static_cast<long long>(mine.runs), static_cast<long long>(mine.clean_errors),
                static_cast<long long>(mine.recovered), static_cast<long long>(mine.silent_wrong), static_cast<long long>(mine.data_lost),
                static_cast<long long>(mine.timeouts));
    total.runs += mine.runs;
    total.clean_errors += mine.clean_errors;
    total.recovered += mine.recovered;
    total.silent_wrong += mine.silent_wrong;
    total.data_lost += mine.data_lost;
    total.timeouts += mine.timeouts;
  }
  std::printf("pattern recovery, all: %lld runs, %lld clean errors, %lld recovered, %lld silent wrong, %lld data lost, %lld timeouts, 0 crashes\n",
              static_cast<long long>(total.runs), static_cast<long long>(total.clean_errors), static_cast<long long>(total.recovered),
              static_cast<long long>(total.silent_wrong), static_cast<long long>(total.data_lost), static_cast<long long>(total.timeouts));
  std::fflush(stdout);
}

}  // namespace recovery
}  // namespace test
