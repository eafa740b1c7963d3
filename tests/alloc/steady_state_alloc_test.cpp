// SPDX-License-Identifier: Apache-2.0
// A layer's steady state allocates nothing on the host back-end. Every `operator new` on a rank's
// thread is counted (a replaced global operator new; hence a binary of its own). The routing changes
// every step (so do the row counts); the same routings run twice, and in the second round, whose
// sizes have all been seen, one forward + backward must count 0: plain flat, hierarchical_2d with a
// capacity policy, the smart schedule, FasterMoE, Parm S2 and parm_auto, HybridEP (exact and compressed);
// and HybridEP's expert codec; the replica schedulers; FlexMoE's placement planner; Pro-Prophet's planner.
// And 1000 steps whose sizes drift, as a trainer's do: buffers grow geometrically, so a rank
// allocates on a few early steps only.

#include "../patterns/layer_cases.hpp"
#include "../patterns/shadow_cases.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/collectives/expert_codec.hpp>
#include <moecomm/patterns/fastermoe.hpp>
#include <moecomm/patterns/layer_policies.hpp>
#include <moecomm/patterns/hybridep.hpp>
#include <moecomm/patterns/parm.hpp>
#include <moecomm/patterns/replicated_experts.hpp>
#include <moecomm/planners/flexmoe_planner.hpp>
#include <moecomm/planners/proprophet_planner.hpp>
#include <moecomm/planners/replica_schedule.hpp>
#include <moecomm/rows/router/router.hpp>

#include <atomic>
#include <cstdlib>
#include <new>

namespace {
thread_local bool counting = false;
thread_local std::int64_t allocations = 0;

void* counted(std::size_t bytes, std::size_t alignment) {
  if (counting) ++allocations;
  void* p = alignment > alignof(std::max_align_t) ? std::aligned_alloc(alignment, (bytes + alignment - 1) / alignment * alignment)
                                                  : std::malloc(bytes ? bytes : 1);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(std::size_t bytes) { return counted(bytes, 0); }
void* operator new[](std::size_t bytes) { return counted(bytes, 0); }
void* operator new(std::size_t bytes, std::align_val_t a) { return counted(bytes, static_cast<std::size_t>(a)); }
void* operator new[](std::size_t bytes, std::align_val_t a) { return counted(bytes, static_cast<std::size_t>(a)); }
// The nothrow forms too (the host back-end's allocator uses the aligned one), so that every
// allocation is counted and every pointer is freed by the matching function.
void* operator new(std::size_t bytes, std::nothrow_t const&) noexcept {
  try { return counted(bytes, 0); } catch (...) { return nullptr; }
}
void* operator new[](std::size_t bytes, std::nothrow_t const&) noexcept {
  try { return counted(bytes, 0); } catch (...) { return nullptr; }
}
void* operator new(std::size_t bytes, std::align_val_t a, std::nothrow_t const&) noexcept {
  try { return counted(bytes, static_cast<std::size_t>(a)); } catch (...) { return nullptr; }
}
void* operator new[](std::size_t bytes, std::align_val_t a, std::nothrow_t const&) noexcept {
  try { return counted(bytes, static_cast<std::size_t>(a)); } catch (...) { return nullptr; }
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace test {

// Allocations on this thread while `f` runs.
template <class F>
std::int64_t allocations_in(F&& f) {
  allocations = 0;
  counting = true;
  f();
  counting = false;
  return allocations;
}

// Steps with routing that changes each step (seeded per step and by `me`: ranks that pass the same
// `me` get the same tokens), sizes bounded by the first step's.
// `begin` and `end` run inside each counted step, before the forward and after the backward.
template <class Layer, class Experts, class Begin = void (*)(), class End = void (*)()>
std::vector<std::int64_t> count_steps(Layer& layer, std::int32_t me, Experts& experts, int steps, Begin begin = [] {}, End end = [] {}) {
  std::int64_t const T = 64, H = 16;
  std::int32_t const K = 2, E = 8;
  std::vector<std::int64_t> counts;
  std::vector<float> x = finite_rows<float>(T, H, 7 + me), d_out = finite_rows<float>(T, H, 9 + me);
  std::vector<float> out(T * H), d_x(T * H), d_w(T * K);
  std::vector<std::int32_t> idx(T * K);
  std::vector<float> w(T * K);
  for (int step = 0; step < steps; ++step) {
    int const round = step % (steps / 2);  // two rounds of the same routings: the second has seen every size
    auto const r = make_routing({T - round, K, E, 0.1, true, 1.0, static_cast<std::uint32_t>(100 * round + me)});
    std::copy(r.idx.begin(), r.idx.end(), idx.begin());
    std::copy(r.w.begin(), r.w.end(), w.begin());
    moecomm::routing_view const routing{idx.data(), w.data(), r.tokens, K};
    counts.push_back(allocations_in([&] {
      begin();
      layer.forward(routing, {x.data(), r.tokens, H}, {out.data(), r.tokens, H}, experts);
      layer.backward({d_out.data(), r.tokens, H}, {d_x.data(), r.tokens, H}, moecomm::array_view<float>{d_w.data(), r.tokens * K},
                     experts);
      end();
    }));
  }
  return counts;
}

// From step `first_warm` on (default: after the first round of steps), every step counts 0
// allocations on every rank.
void check_warm_steps(std::vector<std::vector<std::int64_t>> const& counts, std::size_t first_warm = 0) {
  for (std::size_t r = 0; r < counts.size(); ++r) {
    CAPTURE(r);
    std::string line;
    for (std::int64_t c : counts[r]) line += std::to_string(c) + " ";
    MESSAGE("rank ", r, " allocations per step: ", line);
    for (std::size_t step = first_warm > 0 ? first_warm : counts[r].size() / 2; step < counts[r].size(); ++step) CHECK(counts[r][step] == 0);
  }
}

template <class... Policies>
void check_no_allocation_after_warmup(char const* name, Policies const&... policies) {
  CAPTURE(name);
  std::vector<std::vector<std::int64_t>> counts(4);
  moecomm::inproc_world const world(4, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(4, 2));
    auto layer = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, 8, 16, policies...);
    if constexpr (decltype(layer)::shadowing_policy::shadows) {
      scale_bias_experts<float> experts(comm.rank(), 2, 16, false);  // parametric: shadowing moves parameters
      counts[comm.rank()] = count_steps(layer, comm.rank(), experts, 8);
    } else {
      scale_experts<float> experts{comm.rank() * 2};
      counts[comm.rank()] = count_steps(layer, comm.rank(), experts, 8);
    }
  });
  check_warm_steps(counts);
}

TEST_CASE("a layer step allocates nothing once warm: plain flat") { check_no_allocation_after_warmup("flat"); }

TEST_CASE("a layer step allocates nothing once warm: hierarchical_2d with capacity") {
  check_no_allocation_after_warmup("hierarchical_2d", moecomm::hierarchical_2d{},
                                   moecomm::capacity<moecomm::drop_by_probability>{1.0, 0, true, {}});
}

// The capacity paths derive the kept plan from the dropless one (flags, a scan, a move) in the
// dispatcher's workspace; the receiver budget keeps its allowance vector.
TEST_CASE("a layer step allocates nothing once warm: padded random drops and the receiver budget") {
  check_no_allocation_after_warmup("drop_random padded", moecomm::capacity<moecomm::drop_random>{0.75, 0, true, {42, 0}});
  check_no_allocation_after_warmup("receiver_budget", moecomm::receiver_budget{40});
}

// Algorithm 1's vectors, the replica operations' message lists and the relabeling table are kept
// between steps (shadow_selection_workspace, workspace::messages, workspace::host).
TEST_CASE("a layer step allocates nothing once warm: FasterMoE shadowing, both replica paths") {
  check_no_allocation_after_warmup("fastermoe", moecomm::fastermoe_shadowing<>{});
  check_no_allocation_after_warmup("fastermoe collective", moecomm::fastermoe_shadowing<moecomm::collective_path>{});
}

// Scheduled steps (Pro-Prophet's scheduler) with FasterMoE's and Pro-Prophet's planners: the plan
// made ahead, the lane's job and its communicator are kept. (The lane's own thread is not counted.)
template <class Shadowing>
void check_scheduled_warm_steps(Shadowing const& shadowing) {
  std::vector<std::vector<std::int64_t>> counts(4);
  moecomm::inproc_world const world(4, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(4, 2));
    auto layer = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, 8, 16, shadowing);
    scale_bias_experts<float> experts(comm.rank(), 2, 16, false);
    counts[comm.rank()] = count_steps(layer, comm.rank(), experts, 8, [&] { (void)layer.begin_replica_transfer(experts); },
                                      [&] { layer.finish_replica_gradients(); });
  });
  // A scheduled step plans on the previous step's counts: the second round's first step plans on
  // the first round's last counts, a plan no step has made before; from the next one on, none is new.
  check_warm_steps(counts, 5);
}

TEST_CASE("a layer step allocates nothing once warm: scheduled steps, FasterMoE's and Pro-Prophet's planners") {
  check_scheduled_warm_steps(moecomm::fastermoe_shadowing<>{});
  moecomm::proprophet_cost_params p;
  p.hidden = 16;
  p.balance_factor = 0;  // search until an expert repeats: subsets every step
  moecomm::fastermoe_shadowing<moecomm::point_to_point_path, moecomm::proprophet_planner<>> prophet{};
  prophet.planner.model = moecomm::proprophet_cost_model(p);
  check_scheduled_warm_steps(prophet);
}

// The deduplicated exchange: the source and receive plans, the slot lists, the weight-gradient dots.
TEST_CASE("a layer step allocates nothing once warm: dedup_per_rank, plain and with FasterMoE") {
  check_no_allocation_after_warmup("dedup", moecomm::dedup_per_rank<moecomm::flat>{});
  check_no_allocation_after_warmup("dedup fastermoe", moecomm::dedup_per_rank<moecomm::hierarchical_2d>{},
                                   moecomm::fastermoe_shadowing<>{});
}

TEST_CASE("a layer step allocates nothing once warm: smart schedule") {
  check_no_allocation_after_warmup("smart_schedule", moecomm::smart_schedule{2});
}

// Parm's PauseMP with 2 pieces on MP 2 x EP 2: the pipelined collectives (the rank's thread; the lane
// keeps its message lists in the pipeline workspace), the MP all-gathers and the gradient sum of the
// MP pair that holds the same experts.
template <class Schedule, class Capacity = moecomm::dropless>
void check_parm_warm_steps(Schedule const& schedule, Capacity const& capacity = {}) {
  std::vector<std::vector<std::int64_t>> counts(4);
  moecomm::inproc_world const world(4, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::parallel_groups<moecomm::inproc_communicator> groups(comm, {2, 2, 1});
    moecomm::parm_layer<float, moecomm::host_backend, moecomm::inproc_communicator, Schedule, Capacity> layer(
        moecomm::host_backend{}, groups, 8, 16, schedule, capacity);
    scale_bias_experts<float> experts(groups.coordinates().ep, 4, 16, false);
    counts[comm.rank()] = count_steps(layer, groups.coordinates().ep, experts, 8);  // MP peers pass the same tokens
  });
  check_warm_steps(counts);
}

TEST_CASE("a layer step allocates nothing once warm: Parm S2") { check_parm_warm_steps(moecomm::parm_s2{2}); }

// The DeepSpeed-MP baseline hands its plan of all tokens (or the kept plan derived from it) to the
// dispatcher, which swaps arrays with it.
TEST_CASE("a layer step allocates nothing once warm: Parm's DeepSpeed-MP baseline, dropless and with capacity") {
  check_parm_warm_steps(moecomm::deepspeed_mp{});
  check_parm_warm_steps(moecomm::deepspeed_mp{}, moecomm::capacity<moecomm::drop_by_position>{1.0, 0, false, {}});
}

// parm_auto adds the all-gather of the step's shape and the model's choice.
TEST_CASE("a layer step allocates nothing once warm: parm_auto") {
  check_parm_warm_steps(moecomm::parm_auto{moecomm::parm_cost_model(), 32, 2});
}

// HybridEP on 4 ranks in 2 data centres, expert domains of 2 across them, with and without the
// codec: the lane's gather (its job is a plain struct), the relabeled routing, the dispatcher over
// the same-offset group and the gradients' reduce-scatter.
TEST_CASE("a layer step allocates nothing once warm: HybridEP, exact and compressed") {
  for (double compression : {1.0, 4.0}) {
    CAPTURE(compression);
    std::vector<std::vector<std::int64_t>> counts(4);
    moecomm::inproc_world const world(4, std::chrono::seconds(30));
    world.run([&](moecomm::inproc_communicator comm) {
      moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(4, 2, 1));
      moecomm::hybridep_layer<float, moecomm::host_backend, moecomm::inproc_communicator> layer(
          moecomm::host_backend{}, groups, 8, 16, {2, moecomm::expert_domain_spread::across_data_centres, compression});
      scale_bias_experts<float> experts(comm.rank(), 2, 16, false);
      counts[comm.rank()] = count_steps(layer, comm.rank(), experts, 8);
    });
    check_warm_steps(counts);
  }
}

// Replicated experts on 4 ranks (cyclic placement, 2 replicas each), both splits: the real
// experts' plan, the counts' all-gather, the schedule (its workspace), the assignment, the
// relabeling tables and the replica groups' all-reduces.
template <class Split>
void check_replicated_warm_steps() {
  std::vector<std::vector<std::int64_t>> counts(4);
  moecomm::inproc_world const world(4, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(4, 2));
    moecomm::replica_placement const placement = moecomm::replica_placement::cyclic(4, 4, 2);  // 8 experts
    moecomm::replicated_expert_layer<float, moecomm::host_backend, moecomm::inproc_communicator, Split> layer(
        moecomm::host_backend{}, groups, placement, 16);
    scale_bias_experts<float> experts(comm.rank(), 4, 16, false);
    counts[comm.rank()] = count_steps(layer, comm.rank(), experts, 8);
  });
  check_warm_steps(counts);
}

TEST_CASE("a layer step allocates nothing once warm: replicated experts, FineMoE's and FlexMoE's splits") {
  check_replicated_warm_steps<moecomm::finemoe_split>();
  check_replicated_warm_steps<moecomm::even_split>();
}

// The shared expert's mean, an encode and a decode, twice: the second round allocates nothing (the
// sort's keys and scratch and the mean's exchange come from the workspace).
TEST_CASE("codec: a warm shared mean, encode and decode allocate nothing") {
  std::int64_t const n = 2039, k = moecomm::top_k_for_ratio(n, 50.0);
  std::vector<std::int64_t> second_round(2, -1);
  moecomm::inproc_world const world(2, std::chrono::seconds(30));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::host_backend const be;
    moecomm::workspace<moecomm::host_backend> scratch;
    auto const expert = finite_rows<float>(1, n, 10u + static_cast<std::uint32_t>(comm.rank()));
    std::vector<float> shared(n), params(n), values(k);
    std::vector<std::int32_t> indices(k);
    auto step = [&] {
      moecomm::shared_expert_mean(be, comm, moecomm::matrix_view<float const>(expert.data(), 1, n),
                                  moecomm::array_view<float>(shared), scratch);
      moecomm::encode_expert(be, moecomm::array_view<float const>(expert), moecomm::array_view<float const>(shared), k,
                             moecomm::array_view<std::int32_t>(indices), moecomm::array_view<float>(values), scratch);
      moecomm::decode_expert(be, moecomm::array_view<float const>(shared), moecomm::array_view<std::int32_t const>(indices),
                             moecomm::array_view<float const>(values), moecomm::array_view<float>(params));
    };
    step();
    second_round[static_cast<std::size_t>(comm.rank())] = allocations_in(step);
  });
  CHECK(second_round == std::vector<std::int64_t>(2, 0));
}

// The replica schedulers on two count matrices of one shape, twice: the second round allocates
// nothing (the flow network, pools and results keep their capacity).
TEST_CASE("replica schedules: a warm workspace allocates nothing") {
  std::int32_t const R = 8, E = 16;
  moecomm::replica_sets sets;
  sets.num_ranks = R;
  for (std::int32_t e = 0; e < E; ++e) {
    for (std::int32_t i = 0; i <= e % 3; ++i) sets.ranks.push_back((e + 3 * i) % R);
    sets.offsets.push_back(static_cast<std::int32_t>(sets.ranks.size()));
  }
  std::vector<std::vector<std::int64_t>> counts(2, std::vector<std::int64_t>(R * E));
  for (std::size_t i = 0; i < counts[0].size(); ++i) {
    counts[0][i] = static_cast<std::int64_t>((i * 7919) % 23);
    counts[1][i] = static_cast<std::int64_t>((i * 104729) % 41);
  }
  moecomm::topology const topo(R, 4);
  moecomm::replica_schedule_workspace workspace;
  moecomm::replica_schedule minmax;
  moecomm::comm_aware_schedule aware;
  std::vector<std::int64_t> load;
  auto const step = [&](std::vector<std::int64_t> const& c) {
    moecomm::expert_loads(c, R, E, load);
    moecomm::schedule_replicas(sets, load, minmax, workspace);
    moecomm::schedule_replicas_comm_aware(sets, topo, moecomm::link_weights{}, c, aware, workspace);
  };
  step(counts[0]);
  step(counts[1]);
  CHECK(allocations_in([&] { step(counts[0]); }) == 0);
  CHECK(allocations_in([&] { step(counts[1]); }) == 0);
}

// FlexMoE's placement planner on two load vectors, twice: the second round allocates nothing (the
// decision's vectors and the workspace keep their capacity).
TEST_CASE("flexmoe planner: a warm decision allocates nothing") {
  moecomm::replica_placement const placement = moecomm::replica_placement::from_loads(8, 3, std::vector<double>(12, 1.0), 5);
  std::vector<std::vector<std::int64_t>> loads(2, std::vector<std::int64_t>(12));
  for (std::size_t e = 0; e < 12; ++e) {
    loads[0][e] = static_cast<std::int64_t>(1000 / (e + 1));
    loads[1][e] = static_cast<std::int64_t>(1000 / (12 - e));
  }
  moecomm::flexmoe_planner_workspace workspace;
  moecomm::placement_decision decision;
  auto const plan = [&](std::vector<std::int64_t> const& load) {
    moecomm::plan_replica_moves(placement, load, moecomm::flexmoe_planner_options{}, decision, workspace);
  };
  plan(loads[0]);
  plan(loads[1]);
  CHECK(!decision.moves.empty());
  CHECK(allocations_in([&] { plan(loads[0]); }) == 0);
  CHECK(allocations_in([&] { plan(loads[1]); }) == 0);
}

// Pro-Prophet's planner through its functor on two count matrices, twice: the second round
// allocates nothing (the decision's vectors and the workspace keep their capacity).
TEST_CASE("proprophet planner: a warm decision allocates nothing") {
  std::int32_t const R = 8, E = 16;
  moecomm::topology const topo(R, 4);
  std::vector<std::int32_t> owner(E);
  for (std::int32_t e = 0; e < E; ++e) owner[static_cast<std::size_t>(e)] = e / 2;
  std::vector<std::vector<std::int64_t>> counts(2, std::vector<std::int64_t>(R * E));
  for (std::size_t i = 0; i < counts[0].size(); ++i) {
    counts[0][i] = static_cast<std::int64_t>(4000 / (i % E + 1));
    counts[1][i] = static_cast<std::int64_t>(4000 / (E - i % E) + (i * 7919) % 97);
  }
  moecomm::proprophet_planner<> planner;
  planner.options.skipped_ranks = 2;
  moecomm::fastermoe_cost_model const ignored;
  moecomm::shadow_decision decision;
  auto const plan = [&](std::vector<std::int64_t> const& c) { planner(ignored, topo, owner, c, decision); };
  plan(counts[0]);
  plan(counts[1]);
  CHECK(!decision.shadowed.empty());
  CHECK(allocations_in([&] { plan(counts[0]); }) == 0);
  CHECK(allocations_in([&] { plan(counts[1]); }) == 0);
}

// ---- 1000 steps of drifting routing ----------------------------------------------------------------

// Steps whose token count drifts in [T/2, T] and whose routing is new every step (skewed, the hot
// experts moving with the step), as a trainer's batches do: no round repeats sizes. Returns the steps
// (after the first `warm`) that allocated.
template <class Layer, class Experts>
std::vector<int> drifting_steps_that_allocate(Layer& layer, std::int32_t me, Experts& experts, int steps, int warm,
                                              bool tiny_first = false) {
  std::int64_t const T = 64, H = 16;
  std::int32_t const K = 2, E = 8;
  std::vector<int> allocating;
  std::vector<float> x = finite_rows<float>(T, H, 7 + me), d_out = finite_rows<float>(T, H, 9 + me);
  std::vector<float> out(T * H), d_x(T * H), d_w(T * K);
  std::vector<std::int32_t> idx(T * K);
  std::vector<float> w(T * K);
  std::mt19937 drift(static_cast<std::uint32_t>(1234 + me));
  for (int step = 0; step < steps; ++step) {
    std::int64_t const drifted = T / 2 + static_cast<std::int64_t>(drift() % (T / 2 + 1));
    std::int64_t const tokens = tiny_first && step == 0 ? 1 : drifted;  // a first step that sizes nothing for the batch
    auto r = make_routing({tokens, K, E, 0.1, true, 1.2, static_cast<std::uint32_t>(7919 * step + me)});
    for (auto& e : r.idx) e = e < 0 ? e : (e + step) % E;  // the hot experts move
    std::copy(r.idx.begin(), r.idx.end(), idx.begin());
    std::copy(r.w.begin(), r.w.end(), w.begin());
    moecomm::routing_view const routing{idx.data(), w.data(), r.tokens, K};
    std::int64_t const n = allocations_in([&] {
      layer.forward(routing, {x.data(), r.tokens, H}, {out.data(), r.tokens, H}, experts);
      layer.backward({d_out.data(), r.tokens, H}, {d_x.data(), r.tokens, H}, moecomm::array_view<float>{d_w.data(), r.tokens * K},
                     experts);
    });
    if (step >= warm && n > 0) allocating.push_back(step);
  }
  return allocating;
}

// Every rank's allocating steps among 1000 drifting steps of a fresh layer (4 ranks, 8 experts, each
// rank `local` of them or expert slots): with `reserved`, after `reserve` for the largest step (64
// tokens, top-2) and a first step of one token; else after 10 warm-up steps.
template <class... Policies>
std::vector<std::vector<int>> drifting_allocations(bool reserved, std::int32_t local, Policies const&... policies) {
  std::vector<std::vector<int>> allocating(4);
  moecomm::inproc_world const world(4, std::chrono::seconds(60));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(4, 2));
    auto layer = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, 8, 16, policies...);
    scale_bias_experts<float> experts(comm.rank(), local, 16, false);
    if (reserved) reserve_layer(layer, {64, 2, 0, 0}, experts);
    allocating[comm.rank()] = drifting_steps_that_allocate(layer, comm.rank(), experts, 1000, reserved ? 1 : 10, reserved);
  });
  return allocating;
}

std::string step_list(std::vector<int> const& steps) {
  std::string line;
  for (int step : steps) line += std::to_string(step) + " ";
  return line;
}

// Over 1000 drifting steps after 10 warm-up steps, each rank allocates on at most 3 steps, none
// after step 500. (With buffers grown to the exact size seen, as they once were, ranks allocated on
// up to 12 of these steps, the last at step 935.)
template <class... Policies>
void check_drifting_steps(char const* name, Policies const&... policies) {
  auto const allocating = drifting_allocations(false, 2, policies...);
  for (std::size_t r = 0; r < allocating.size(); ++r) {
    MESSAGE(std::string(name), ": rank ", r, " allocated on ", allocating[r].size(), " of 990 warm drifting steps: ",
            step_list(allocating[r]));
    CHECK(allocating[r].size() <= 3);
    CHECK((allocating[r].empty() || allocating[r].back() < 500));
  }
}

// After `reserve`, no drifting step allocates. The first step, of one token, sets up what the first
// call of anything does whatever the batch (the communicator's bookkeeping, the smart schedule's
// lane, R x L chunk tables); being tiny, it sizes nothing for the batch, so a buffer `reserve`
// missed grows on a later step and fails here.
void check_none_allocated(char const* name, std::vector<std::vector<int>> const& allocating) {
  for (std::size_t r = 0; r < allocating.size(); ++r)
    CHECK_MESSAGE(allocating[r].empty(), std::string(name), ": rank ", r, " allocated after reserve on steps ", step_list(allocating[r]));
}
template <class... Policies>
void check_reserved_steps(char const* name, std::int32_t local, Policies const&... policies) {
  check_none_allocated(name, drifting_allocations(true, local, policies...));
}

// Parm on 4 ranks (MP 2 x EP 2; the MP pair routes the same tokens), as check_reserved_steps.
template <class Schedule, class Capacity = moecomm::dropless>
void check_parm_reserved_steps(char const* name, Schedule const& schedule, Capacity const& capacity = {}) {
  std::vector<std::vector<int>> allocating(4);
  moecomm::inproc_world const world(4, std::chrono::seconds(60));
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::parallel_groups<moecomm::inproc_communicator> groups(comm, {2, 2, 1});
    moecomm::parm_layer<float, moecomm::host_backend, moecomm::inproc_communicator, Schedule, Capacity> layer(
        moecomm::host_backend{}, groups, 8, 16, schedule, capacity);
    layer.reserve({64, 2, 0});
    scale_bias_experts<float> experts(groups.coordinates().ep, 4, 16, false);
    allocating[comm.rank()] = drifting_steps_that_allocate(layer, groups.coordinates().ep, experts, 1000, 1, true);
  });
  check_none_allocated(name, allocating);
}

TEST_CASE("1000 drifting steps after reserve allocate nothing, for every capacity policy and exchange") {
  check_reserved_steps("plain", 2);
  check_reserved_steps("hierarchical_2d, padded capacity", 2, moecomm::hierarchical_2d{},
                       moecomm::capacity<moecomm::drop_by_probability>{1.25, 0, true, {}});
  check_reserved_steps("drop_random", 2, moecomm::capacity<moecomm::drop_random>{0.75, 0, false, {42, 0}});
  check_reserved_steps("receiver_budget", 2, moecomm::receiver_budget{100});
  check_reserved_steps("dedup", 2, moecomm::dedup_per_rank<moecomm::hierarchical_2d>{});
  check_reserved_steps("dedup, capacity", 2, moecomm::dedup_per_rank<moecomm::flat>{},
                       moecomm::capacity<moecomm::drop_by_position>{1.0, 0, false, {}});
  check_reserved_steps("dedup_per_node", 2, moecomm::dedup_per_node{4});
  check_reserved_steps("dedup_per_node, padded capacity", 2, moecomm::dedup_per_node{},
                       moecomm::capacity<moecomm::drop_by_position>{1.25, 0, true, {}});
  check_reserved_steps("smart schedule", 2, moecomm::smart_schedule{2});
}

// Shadowing sized for every expert (max_shadowed_experts = 0). The slow GEMM makes Algorithm 1
// shadow the hot experts, which move every step.
TEST_CASE("1000 drifting steps after reserve allocate nothing: FasterMoE and Pro-Prophet's shadowing") {
  moecomm::fastermoe_cost_params slow_gemm;
  slow_gemm.gemm_flops = 1e8;
  slow_gemm.net_bandwidth = slow_gemm.local_bandwidth = 1e9;
  check_reserved_steps("fastermoe", 2, moecomm::fastermoe_shadowing<>{slow_gemm});
  check_reserved_steps("fastermoe, smart schedule", 2, moecomm::fastermoe_shadowing<>{slow_gemm}, moecomm::smart_schedule{2});
  check_reserved_steps("fastermoe, dedup", 2, moecomm::fastermoe_shadowing<>{slow_gemm}, moecomm::dedup_per_rank<moecomm::flat>{});
  check_reserved_steps("fastermoe, dedup_per_node", 2, moecomm::fastermoe_shadowing<>{slow_gemm}, moecomm::dedup_per_node{4});
  using prophet = moecomm::fastermoe_shadowing<moecomm::point_to_point_path, moecomm::proprophet_planner<>>;
  prophet policy;
  moecomm::proprophet_cost_params costs;
  costs.hidden = 16;
  costs.balance_factor = 0.5;
  policy.planner.model = moecomm::proprophet_cost_model(costs);
  check_reserved_steps("pro-prophet", 2, policy);
}

TEST_CASE("1000 drifting steps after reserve allocate nothing: Parm") {
  check_parm_reserved_steps("deepspeed_mp", moecomm::deepspeed_mp{});
  check_parm_reserved_steps("deepspeed_mp, capacity", moecomm::deepspeed_mp{}, moecomm::capacity<moecomm::drop_by_position>{1.0, 0, false, {}});
  check_parm_reserved_steps("parm_s1", moecomm::parm_s1{});
  check_parm_reserved_steps("parm_s2", moecomm::parm_s2{2});
  check_parm_reserved_steps("parm_auto", moecomm::parm_auto{moecomm::parm_cost_model(), 32, 2});
  // Padded (a capturable step): all tokens routed to C rows per expert, PauseMP's shares of them.
  moecomm::capacity<moecomm::drop_by_position> const padded{1.25, 0, true, {}};
  check_parm_reserved_steps("deepspeed_mp, padded", moecomm::deepspeed_mp{}, padded);
  check_parm_reserved_steps("parm_s2, padded", moecomm::parm_s2{2}, padded);
}

TEST_CASE("1000 drifting steps after reserve allocate nothing: HybridEP") {
  check_reserved_steps("hybridep, S = 2", 2, moecomm::hybridep{2});
  check_reserved_steps("hybridep, S = 2, capacity", 2, moecomm::hybridep{2}, moecomm::capacity<moecomm::drop_by_position>{1.25, 0, false, {}});
  check_reserved_steps("hybridep, S = 2, compressed", 2, moecomm::hybridep{2, moecomm::expert_domain_spread::across_data_centres, 4});
}

TEST_CASE("1000 drifting steps after reserve allocate nothing: FineMoE and FlexMoE's replicated layer") {
  auto const placement = moecomm::replica_placement::cyclic(4, 4, 2);  // 8 experts in 16 slots
  check_reserved_steps("finemoe", 4, moecomm::finemoe{placement});
  check_reserved_steps("flexmoe (even split)", 4, moecomm::flexmoe{placement});
  check_reserved_steps("finemoe, dedup_per_rank<hierarchical_2d>", 4, moecomm::finemoe{placement},
                       moecomm::dedup_per_rank<moecomm::hierarchical_2d>{});
}

TEST_CASE("reserve names the field of step_bounds that is out of range") {
  moecomm::inproc_world const world(1);
  world.run([&](moecomm::inproc_communicator comm) {
    moecomm::exchange_groups<moecomm::inproc_communicator> groups(comm, moecomm::topology(1, 1));
    auto layer = moecomm::make_expert_parallel_layer<float>(moecomm::host_backend{}, groups, 8, 16);
    check_error([&] { layer.reserve({-1, 2, 0}); }, moecomm::status::invalid_argument, {"step_bounds.max_tokens = -1 is negative"});
    check_error([&] { layer.reserve({64, 9, 0}); }, moecomm::status::invalid_argument,
                {"step_bounds.top_k = 9 must be in [1, num_experts = 8]"});
    check_error([&] { layer.reserve({64, 2, -5}); }, moecomm::status::invalid_argument,
                {"step_bounds.max_received_rows = -5 is negative"});
  });
}

TEST_CASE("1000 drifting steps: buffers grow geometrically, so allocations stop early") {
  check_drifting_steps("plain");
  check_drifting_steps("capacity", moecomm::capacity<moecomm::drop_by_position>{1.25, 0, false, {}});
  check_drifting_steps("fastermoe", moecomm::fastermoe_shadowing<>{});
  check_drifting_steps("smart schedule", moecomm::smart_schedule{2});
}

// The router on its own: after router_state::reserve, not even its first pass allocates.
TEST_CASE("the router allocates nothing after router_state::reserve, its first pass included") {
  moecomm::host_backend const be;
  constexpr std::int64_t tokens = 70, experts = 16;
  constexpr std::int32_t k = 4;
  std::vector<float> logits(tokens * experts), w(tokens * k), d_w(tokens * k, 1.0f), d_logits(tokens * experts);
  for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>((i * 37) % 101) / 17.0f;
  std::vector<std::int32_t> idx(tokens * k), counts(experts);
  std::vector<moecomm::router_losses> losses(1);
  moecomm::router_config config;
  config.top_k = k;
  config.aux_loss_coeff = 1e-2f;
  config.z_loss_coeff = 1e-3f;
  moecomm::router_state<moecomm::host_backend> state;
  state.reserve(be, tokens, experts, k);
  for (std::int64_t t : {tokens, std::int64_t{1}, std::int64_t{0}, std::int64_t{33}}) {
    CAPTURE(t);
    CHECK(allocations_in([&] {
            moecomm::router_forward(be, moecomm::make_matrix_view<float const>(logits.data(), t, experts),
                                    moecomm::make_matrix_view(idx.data(), t, k), moecomm::make_matrix_view(w.data(), t, k),
                                    moecomm::make_array_view(counts.data(), experts),
                                    moecomm::make_array_view(losses.data(), 1), state, config);
            moecomm::router_backward(be, state, moecomm::make_matrix_view<float const>(d_w.data(), t, k),
                                     moecomm::make_matrix_view(d_logits.data(), t, experts));
          }) == 0);
  }
  check_error([&] { state.reserve(be, -1, experts, k); }, moecomm::status::invalid_argument,
              {"router_state::reserve", "max_tokens = -1 must be >= 0"});
}

}  // namespace test
