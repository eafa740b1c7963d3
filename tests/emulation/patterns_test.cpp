// SPDX-License-Identifier: Apache-2.0
// Every pattern on emulated GPUs over emulated NCCL equals the same pattern on in-process host
// ranks, bit for bit (output, input and routing-weight gradients, parameter gradients): FasterMoE
// with the smart schedule, Pro-Prophet's subsets, HybridEP with the background gather, replicated
// experts (FineMoE's split), on 2, 4 and 8 ranks. The host run is the reference the host tests tie
// to plain expert parallelism and the oracle. The experts are kernels on the layer's stream.

#include "../patterns/hybridep_cases.hpp"
#include "../patterns/parm_cases.hpp"
#include "../patterns/replicated_cases.hpp"
#include "../patterns/shadow_cases.hpp"
#include "captured_steps.hpp"
#include "device_experts.hpp"
#include "emulated_ranks.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/patterns/finemoe.hpp>
#include <moecomm/patterns/block_schedule.hpp>
#include <moecomm/patterns/hybridep.hpp>

#include <memory>
#include <random>
#include <type_traits>
#include <vector>

namespace test {

namespace {

// Rank `me`'s inputs in the back-end's memory, and NaN-poisoned outputs there.
template <class Backend>
struct rank_buffers {
  using floats = typename Backend::template buffer_type<float>;
  typename Backend::template buffer_type<std::int32_t> idx;
  floats w, x, d_out, out, d_x, d_w;
  moecomm::routing_view routing;
  std::int64_t tokens, hidden;

  rank_buffers(Backend const& be, shadow_case const& c, shadow_inputs<float> const& in, std::int32_t me)
      : idx(upload(be, in.routing[static_cast<std::size_t>(me)].idx)), w(upload(be, in.routing[static_cast<std::size_t>(me)].w)),
        x(upload(be, in.x[static_cast<std::size_t>(me)])), d_out(upload(be, in.d_out[static_cast<std::size_t>(me)])),
        out(upload(be, poisoned<float>(in.routing[static_cast<std::size_t>(me)].tokens * c.hidden))),
        d_x(upload(be, poisoned<float>(in.routing[static_cast<std::size_t>(me)].tokens * c.hidden))),
        d_w(upload(be, poisoned<float>(in.routing[static_cast<std::size_t>(me)].tokens * c.top_k))),
        routing{idx.data(), w.data(), in.routing[static_cast<std::size_t>(me)].tokens, c.top_k},
        tokens(routing.num_tokens), hidden(c.hidden) {}
  [[nodiscard]] moecomm::matrix_view<float const> x_view() const { return {x.data(), tokens, hidden}; }
  [[nodiscard]] moecomm::matrix_view<float const> d_out_view() const { return {d_out.data(), tokens, hidden}; }
  [[nodiscard]] moecomm::matrix_view<float> out_view() { return {out.data(), tokens, hidden}; }
  [[nodiscard]] moecomm::matrix_view<float> d_x_view() { return {d_x.data(), tokens, hidden}; }
  [[nodiscard]] moecomm::array_view<float> d_w_view() { return {d_w.data(), tokens * routing.top_k}; }
  template <class Experts>
  layer_result<float> result(Backend const& be, Experts const& experts) const {
    return {download(be, out.data(), tokens * hidden), download(be, d_x.data(), tokens * hidden),
            download(be, d_w.data(), tokens * routing.top_k), experts.gradients_on_host()};
  }
};

// One forward and backward of a layer on rank `me`, on any back-end; `before_forward(layer, experts)`
// may start a background transfer.
template <class Backend, class Layer, class Before>
layer_result<float> backend_step(Backend const& be, Layer& layer, std::int32_t me, shadow_case const& c, shadow_inputs<float> const& in,
                                 scale_bias_experts<float> const& initial, Before&& before_forward) {
  kernel_scale_bias_experts<float, Backend> experts(be, initial);
  rank_buffers<Backend> io(be, c, in, me);
  before_forward(layer, experts);
  layer.forward(io.routing, io.x_view(), io.out_view(), experts);
  layer.backward(io.d_out_view(), io.d_x_view(), io.d_w_view(), experts);
  return io.result(be, experts);
}

struct nothing_before {
  template <class Layer, class Experts>
  void operator()(Layer&, Experts&) const {}
};

template <class Comm>
using comm_of = std::decay_t<Comm>;

shadow_case const skewed4{4, 2, 8, 2, 16, {40, 33, 0, 57}, 1.5, true};
shadow_case const skewed8{8, 4, 16, 2, 8, {30, 1, 0, 57, 20, 44, 9, 16}, 1.5, true};
shadow_case const dense8{8, 2, 16, 2, 8, {96, 96, 96, 96, 96, 96, 96, 96}, 0.0, true};

}  // namespace

TEST_CASE_TEMPLATE("FasterMoE (shadowing, smart schedule) on GPUs equals the host", Placement, gpu_per_rank, ranks_on_one_gpu) {
  for (shadow_case const& c : {shadow_case{2, 2, 4, 2, 16, {40, 7}, 1.5, true}, skewed4, skewed8}) {
    check_emulated_equals_host<Placement>(c, [](auto const& be, auto& comm, shadow_case const& k, shadow_inputs<float> const& in) {
      using B = std::decay_t<decltype(be)>;
      using C = comm_of<decltype(comm)>;
      moecomm::exchange_groups<C> groups(comm, moecomm::topology(k.ranks, k.per_node));
      moecomm::fastermoe_shadowing<moecomm::point_to_point_path, fixed_planner> const shadowing{small_model(), {64}, {{0, 1}}};
      moecomm::expert_parallel_layer<float, B, C, moecomm::dropless, moecomm::smart_schedule, moecomm::weighted, decltype(shadowing)>
          layer(be, groups, k.experts, k.hidden, {}, moecomm::smart_schedule{k.per_node}, {}, shadowing);
      return backend_step(be, layer, comm.rank(), k, in, scale_bias_experts<float>(comm.rank(), k.experts / k.ranks, k.hidden, true),
                          nothing_before{});
    });
  }
}

TEST_CASE_TEMPLATE("Pro-Prophet's replicas on subsets, collective path, on GPUs equal the host", Placement, gpu_per_rank,
                   ranks_on_one_gpu) {
  check_emulated_equals_host<Placement>(skewed8, [](auto const& be, auto& comm, shadow_case const& k, shadow_inputs<float> const& in) {
    using B = std::decay_t<decltype(be)>;
    using C = comm_of<decltype(comm)>;
    moecomm::exchange_groups<C> groups(comm, moecomm::topology(k.ranks, k.per_node));
    fixed_subset_planner const planner{{0, 5, 9, 14}, {0, 3, 3, 10, 11}, {1, 2, 7, 0, 1, 2, 3, 5, 6, 7, 0}};
    moecomm::fastermoe_shadowing<moecomm::collective_path, fixed_subset_planner> const shadowing{small_model(), {}, planner};
    moecomm::expert_parallel_layer<float, B, C, moecomm::dropless, moecomm::hierarchical_2d, moecomm::weighted, decltype(shadowing)>
        layer(be, groups, k.experts, k.hidden, {}, {}, {}, shadowing);
    return backend_step(be, layer, comm.rank(), k, in, scale_bias_experts<float>(comm.rank(), k.experts / k.ranks, k.hidden, true),
                        nothing_before{});
  });
}

TEST_CASE_TEMPLATE("HybridEP (background expert gather) on GPUs equals the host", Placement, gpu_per_rank, ranks_on_one_gpu) {
  for (std::int32_t domain : {2, 4}) {
    CAPTURE(domain);
    check_emulated_equals_host<Placement>(dense8, [domain](auto const& be, auto& comm, shadow_case const& k, shadow_inputs<float> const& in) {
      using B = std::decay_t<decltype(be)>;
      using C = comm_of<decltype(comm)>;
      moecomm::exchange_groups<C> groups(comm, moecomm::topology(k.ranks, k.per_node, 2));
      moecomm::hybridep policy;
      policy.expert_domain = domain;
      moecomm::hybridep_layer<float, B, C> layer(be, groups, k.experts, k.hidden, policy);
      return backend_step(be, layer, comm.rank(), k, in, scale_bias_experts<float>(comm.rank(), k.experts / k.ranks, k.hidden, true),
                          [](auto& l, auto& experts) { l.begin_expert_gather(experts); });
    });
  }
}

TEST_CASE_TEMPLATE("replicated experts (FineMoE's min-max split, FlexMoE's even split) on GPUs equal the host", Placement,
                   gpu_per_rank, ranks_on_one_gpu) {
  moecomm::replica_placement const placement = moecomm::replica_placement::cyclic(4, 4, 2);  // 8 experts, 2 replicas each
  auto const replicated = [&](auto split) {
    return [&, split](auto const& be, auto& comm, shadow_case const& k, shadow_inputs<float> const& in) {
      using B = std::decay_t<decltype(be)>;
      using C = comm_of<decltype(comm)>;
      moecomm::exchange_groups<C> groups(comm, moecomm::topology(k.ranks, k.per_node));
      moecomm::replicated_expert_layer<float, B, C, decltype(split)> layer(be, groups, placement, k.hidden);
      return backend_step(be, layer, comm.rank(), k, in, slot_experts(placement, comm.rank(), k.hidden), nothing_before{});
    };
  };
  check_emulated_equals_host<Placement>(skewed4, replicated(moecomm::finemoe_split{}));
  check_emulated_equals_host<Placement>(skewed4, replicated(moecomm::even_split{}));
}

// Replicated experts (FineMoE's split) whose replicas move between two steps, from the cyclic
// placement to a load-aware one: parameters travel between the ranks' device memory.
struct moved_replicas {
  template <class Backend, class Comm>
  layer_result<float> operator()(Backend const& be, Comm& comm, shadow_case const& k, shadow_inputs<float> const& in) const {
    auto const start = moecomm::replica_placement::cyclic(4, 4, 2);  // 8 experts, 2 replicas each
    auto const to = moecomm::replica_placement::from_loads(4, 4, {8, 4, 2, 1, 1, 1, 1, 1}, 7);
    std::int32_t const me = comm.rank();
    moecomm::exchange_groups<Comm> groups(comm, moecomm::topology(k.ranks, k.per_node));
    moecomm::replicated_expert_layer<float, Backend, Comm, moecomm::finemoe_split> layer(be, groups, start, k.hidden);
    kernel_scale_bias_experts<float, Backend> experts(be, slot_experts(start, me, k.hidden));
    rank_buffers<Backend> io(be, k, in, me);
    for (int step = 0; step < 2; ++step) {
      if (step == 1) {
        layer.move_replicas(to, experts);
        for (std::int32_t l = 0; l < 4; ++l) CHECK(layer.placement().expert_at(me, l) == to.expert_at(me, l));
      }
      layer.forward(io.routing, io.x_view(), io.out_view(), experts);
      layer.backward(io.d_out_view(), io.d_x_view(), io.d_w_view(), experts);
    }
    return io.result(be, experts);
  }
};

TEST_CASE_TEMPLATE("replicated experts whose replicas move between steps (FineMoE's re-placement) on GPUs equal the host", Placement,
                   gpu_per_rank, ranks_on_one_gpu) {
  auto const start = moecomm::replica_placement::cyclic(4, 4, 2), to = moecomm::replica_placement::from_loads(4, 4, {8, 4, 2, 1, 1, 1, 1, 1}, 7);
  std::int32_t moved = 0;
  for (std::int32_t r = 0; r < 4; ++r)
    for (std::int32_t l = 0; l < 4; ++l) moved += start.expert_at(r, l) != to.expert_at(r, l);
  REQUIRE(moved > 0);
  check_emulated_equals_host<Placement>(skewed4, moved_replicas{});
}

// Pro-Prophet's block schedule over a stack of 4 shadowed blocks, each block's output the next
// one's input, two iterations (transfers begun a block ahead, aggregation finished after the
// backward): every block's output and gradients, concatenated.
struct scheduled_stack {
  static constexpr std::int32_t blocks = 4;
  template <class Backend, class Comm>
  layer_result<float> operator()(Backend const& be, Comm& comm, shadow_case const& k, shadow_inputs<float> const& in) const {
    using layer_t = moecomm::expert_parallel_layer<float, Backend, Comm, moecomm::dropless, moecomm::flat, moecomm::weighted,
                                                   moecomm::fastermoe_shadowing<>>;
    using experts_t = kernel_scale_bias_experts<float, Backend>;
    std::int32_t const me = comm.rank();
    moecomm::exchange_groups<Comm> groups(comm, moecomm::topology(k.ranks, k.per_node));
    moecomm::fastermoe_shadowing<> const shadowing{small_model(), {}, {}};
    std::vector<std::unique_ptr<layer_t>> owned_layers;
    std::vector<std::unique_ptr<experts_t>> owned_experts;
    std::vector<layer_t*> layers;
    std::vector<experts_t*> experts;
    for (std::int32_t i = 0; i < blocks; ++i) {
      owned_layers.push_back(std::make_unique<layer_t>(be, groups, k.experts, k.hidden, moecomm::dropless{}, moecomm::flat{},
                                                       moecomm::routing_checks{}, shadowing));
      owned_experts.push_back(std::make_unique<experts_t>(be, scale_bias_experts<float>(me, k.experts / k.ranks, k.hidden, true)));
      layers.push_back(owned_layers.back().get());
      experts.push_back(owned_experts.back().get());
    }
    moecomm::block_schedule<layer_t, experts_t> schedule(layers, experts);
    rank_buffers<Backend> io(be, k, in, me);
    std::int64_t const rows = io.tokens * k.hidden, weights = io.tokens * k.top_k;
    auto activations = upload(be, poisoned<float>(rows * blocks));  // block i's output
    auto d_inputs = upload(be, poisoned<float>(rows * blocks));     // block i's input gradient
    auto d_weights = upload(be, poisoned<float>(weights * blocks));
    for (int iteration = 0; iteration < 2; ++iteration) {
      for (std::int32_t i = 0; i < blocks; ++i) {
        schedule.before_forward(i);
        float const* input = i == 0 ? io.x.data() : activations.data() + (i - 1) * rows;
        layers[static_cast<std::size_t>(i)]->forward(io.routing, {input, io.tokens, k.hidden}, {activations.data() + i * rows, io.tokens, k.hidden},
                                                     *experts[static_cast<std::size_t>(i)]);
      }
      for (std::int32_t i = blocks - 1; i >= 0; --i) {
        float const* d_out = i == blocks - 1 ? io.d_out.data() : d_inputs.data() + (i + 1) * rows;
        layers[static_cast<std::size_t>(i)]->backward({d_out, io.tokens, k.hidden}, {d_inputs.data() + i * rows, io.tokens, k.hidden},
                                                      moecomm::array_view<float>{d_weights.data() + i * weights, weights},
                                                      *experts[static_cast<std::size_t>(i)]);
      }
      schedule.finish_backward();
    }
    layer_result<float> got{download(be, activations.data(), rows * blocks), download(be, d_inputs.data(), rows * blocks),
                            download(be, d_weights.data(), weights * blocks), {}};
    for (experts_t const* e : experts) {
      auto const g = e->gradients_on_host();
      got.grads.insert(got.grads.end(), g.begin(), g.end());
    }
    return got;
  }
};

TEST_CASE_TEMPLATE("Pro-Prophet's block schedule (4 shadowed blocks, transfers a block ahead) on GPUs equals the host", Placement,
                   gpu_per_rank, ranks_on_one_gpu) {
  check_emulated_equals_host<Placement>(skewed8, scheduled_stack{});
}

#if MOECOMM_CUDA_EMULATION()

// After `reserve`, 200 drifting steps of a layer on 4 emulated GPUs allocate no device memory (no
// cudaMalloc or cudaMallocAsync: a step can be captured in a CUDA graph). `with_layer(rank, use)`
// builds the layer and calls `use(layer, seed)`; ranks of one seed route the same tokens (Parm's MP
// peers). Each rank holds `local` experts or slots. The first step, of one token, sets up what a
// first call does whatever the batch, and sizes nothing for it.
//! `Scheduled`: each step is a scheduled one (Pro-Prophet's scheduler): planned a step ahead, its
//! replica transfers and gradient aggregation on the layer's lane.
template <bool Scheduled = false, class WithLayer>
std::int64_t device_allocations_after_reserve(std::int32_t local, WithLayer&& with_layer) {
  std::int64_t const T = 64, H = 16;
  std::int32_t const K = 2, E = 8;
  std::vector<std::int64_t> allocated(4);
  run_emulated_ranks(4, [&](emulated_rank& rank) {
    with_layer(rank, [&](auto& layer, std::int32_t seed) {
      kernel_scale_bias_experts<float, moecomm::cuda_backend> experts(rank.be, scale_bias_experts<float>(seed, local, H, false));
      reserve_layer(layer, {T, K, 0, 0}, experts);
      auto idx = rank.be.allocate<std::int32_t>(T * K);
      auto w = rank.be.allocate<float>(T * K);
      auto const x = upload(rank.be, finite_rows<float>(T, H, 7 + seed));
      auto out = rank.be.allocate<float>(T * H);
      auto d_x = rank.be.allocate<float>(T * H);
      auto d_w = rank.be.allocate<float>(T * K);
      std::mt19937 drift(static_cast<std::uint32_t>(77 + seed));
      for (int step = 0; step < 200; ++step) {
        std::int64_t const tokens = step == 0 ? 1 : T / 2 + static_cast<std::int64_t>(drift() % (T / 2 + 1));
        auto r = make_routing({tokens, K, E, 0.1, true, 1.2, static_cast<std::uint32_t>(31 * step + seed)});
        for (auto& e : r.idx) e = e < 0 ? e : (e + step) % E;  // the hot experts move
        rank.be.copy(idx.data(), r.idx.data(), tokens * K);
        rank.be.copy(w.data(), r.w.data(), tokens * K);
        rank.be.synchronize();
        std::int64_t const before = moecomm_emulation::device_allocations();
        if constexpr (Scheduled) (void)layer.begin_replica_transfer(experts);
        layer.forward({idx.data(), w.data(), tokens, K}, {x.data(), tokens, H}, {out.data(), tokens, H}, experts);
        layer.backward({x.data(), tokens, H}, {d_x.data(), tokens, H}, moecomm::array_view<float>{d_w.data(), tokens * K}, experts);
        if constexpr (Scheduled) layer.finish_replica_gradients();
        if (step > 0) allocated[static_cast<std::size_t>(rank.comm.rank())] += moecomm_emulation::device_allocations() - before;
      }
    });
  });
  auto const seen = take_violations();
  CHECK_MESSAGE(seen.empty(), "the emulation saw ", seen.size(), " broken contracts, the first: ", seen.empty() ? "" : seen.front());
  return allocated[0] + allocated[1] + allocated[2] + allocated[3];
}

// The expert-parallel layer with `policies` (make_expert_parallel_layer) over 4 emulated GPUs.
template <class... Policies>
auto expert_parallel(Policies const&... policies) {
  return [=](emulated_rank& rank, auto&& use) {
    moecomm::exchange_groups<moecomm::nccl_communicator> groups(rank.comm, moecomm::topology(4, 2, 2));
    auto layer = moecomm::make_expert_parallel_layer<float>(rank.be, groups, 8, 16, policies...);
    use(layer, rank.comm.rank());
  };
}

TEST_CASE("after reserve, 200 drifting steps of every layer on emulated GPUs allocate no device memory") {
  moecomm::fastermoe_cost_params slow_gemm;  // hot experts are worth shadowing
  slow_gemm.gemm_flops = 1e8;
  slow_gemm.net_bandwidth = slow_gemm.local_bandwidth = 1e9;
  auto const placement = moecomm::replica_placement::cyclic(4, 4, 2);  // 8 experts in 16 slots
  CHECK(device_allocations_after_reserve(2, expert_parallel()) == 0);
  CHECK(device_allocations_after_reserve(2, expert_parallel(moecomm::dedup_per_rank<moecomm::flat>{})) == 0);
  CHECK(device_allocations_after_reserve(2, expert_parallel(moecomm::dedup_per_node{4})) == 0);
  CHECK(device_allocations_after_reserve(
            2, expert_parallel(moecomm::hierarchical_2d{}, moecomm::capacity<moecomm::drop_by_position>{1.25, 0, true, {}})) == 0);
  CHECK(device_allocations_after_reserve(2, expert_parallel(moecomm::fastermoe_shadowing<>{slow_gemm}, moecomm::smart_schedule{2})) == 0);
  CHECK(device_allocations_after_reserve(2, expert_parallel(moecomm::hybridep{2})) == 0);
  CHECK(device_allocations_after_reserve(4, expert_parallel(moecomm::finemoe{placement})) == 0);
  CHECK(device_allocations_after_reserve(4, expert_parallel(moecomm::flexmoe{placement})) == 0);
  CHECK(device_allocations_after_reserve(4, [](emulated_rank& rank, auto&& use) {  // Parm S2, MP 2 x EP 2
          moecomm::parallel_groups<moecomm::nccl_communicator> groups(rank.comm, {2, 2, 1});
          moecomm::parm_layer<float, moecomm::cuda_backend, moecomm::nccl_communicator, moecomm::parm_s2> layer(
              rank.be, groups, 8, 16, moecomm::parm_s2{2});
          use(layer, groups.coordinates().ep);
        }) == 0);
  CHECK(device_allocations_after_reserve(4, [](emulated_rank& rank, auto&& use) {  // Parm S2 padded (a capturable step)
          moecomm::parallel_groups<moecomm::nccl_communicator> groups(rank.comm, {2, 2, 1});
          using padded = moecomm::capacity<moecomm::drop_by_position>;
          moecomm::parm_layer<float, moecomm::cuda_backend, moecomm::nccl_communicator, moecomm::parm_s2, padded> layer(
              rank.be, groups, 8, 16, moecomm::parm_s2{2}, padded{1.25, 0, true, {}});
          use(layer, groups.coordinates().ep);
        }) == 0);
}

// Scheduled steps after reserve: the lane transfers replicas and aggregates their gradients in the
// staging `reserve` sized on the layer's stream, which must be complete before the lane's stream
// uses it (reserve synchronizes). Pro-Prophet's planner, subsets of the ranks every step.
TEST_CASE("after reserve, 200 scheduled Pro-Prophet steps on emulated GPUs allocate no device memory and break no contract") {
  moecomm::proprophet_cost_params p;
  p.hidden = 16;
  p.balance_factor = 0;  // search until an expert repeats: subsets every step
  moecomm::fastermoe_shadowing<moecomm::point_to_point_path, moecomm::proprophet_planner<>> prophet{};
  prophet.planner.model = moecomm::proprophet_cost_model(p);
  CHECK(device_allocations_after_reserve<true>(2, expert_parallel(prophet)) == 0);
}

#endif  // the emulation counts device allocations

TEST_CASE_TEMPLATE("Parm's schedules (deepspeed_mp, S1, S2 pipelined on the lane) on 8 ranks on GPUs equal the oracle", Placement,
                   gpu_per_rank, ranks_on_one_gpu) {
  for (moecomm::parallel_sizes const sizes : {moecomm::parallel_sizes{2, 4, 2}, moecomm::parallel_sizes{4, 2, 2}}) {
    CAPTURE(sizes.model);
    CAPTURE(sizes.expert_slicing);
    run_device_ranks<Placement>(8, [&](auto& rank) {
      check_parm_schedules_on_rank<float>(rank.be, rank.comm, parm_case{sizes, 37, 8, 2, 0}, moecomm::dropless{});
      check_parm_schedules_on_rank<float>(rank.be, rank.comm, parm_case{sizes, 97, 16, 4, 0.75},
                                          moecomm::capacity<moecomm::drop_by_position>{0.75});
    });
    auto const seen = take_violations();
    CHECK_MESSAGE(seen.empty(), "the emulation saw ", seen.size(), " broken contracts, the first: ", seen.empty() ? "" : seen.front());
  }
}

// Parm with a padded capacity policy on `sizes`' GPUs: one step captured after an eager one,
// replayed 100 times on new routings, rows and parameters (the MP group's ranks given the same),
// each replay equal to the eager step bit for bit, with no host wait.
template <class Schedule, class Capacity>
void check_captured_parm(moecomm::parallel_sizes sizes, Schedule const& schedule, Capacity const& capacity) {
  std::string const schedule_name = Schedule::name, capacity_name = Capacity::name;
  CAPTURE(schedule_name);
  CAPTURE(capacity_name);
  CAPTURE(sizes.expert_slicing);
  int32_t const experts = 8;
  run_emulated_ranks(sizes.model * sizes.expert, [&](emulated_rank& rank) {
    using Layer = moecomm::parm_layer<float, moecomm::cuda_backend, moecomm::nccl_communicator, Schedule, Capacity>;
    moecomm::parallel_groups<moecomm::nccl_communicator> groups(rank.comm, sizes);
    Layer captured(rank.be, groups, experts, parm_hidden, schedule, capacity), eager(rank.be, groups, experts, parm_hidden, schedule, capacity);
    REQUIRE(captured.capture_blocker().empty());
    for (Layer* layer : {&captured, &eager}) layer->reserve(moecomm::step_bounds{24, 2, 0, 0});
    auto const at = groups.coordinates();
    parm_case const c{sizes, 24, experts, 2, 0};
    backend_sliced_mlp_experts<float, moecomm::cuda_backend> captured_experts(rank.be, parm_rank_experts<float>(at, c)),
        eager_experts(rank.be, parm_rank_experts<float>(at, c));
    replay_captured_step(rank, experts, captured, eager, captured_experts, eager_experts,
                         replay_shape{at.dp * sizes.expert + at.ep, parm_hidden});
  });
  require_no_violations();
}

TEST_CASE("a captured Parm step on one GPU (padded capacity, 8 local experts) replays 100 times equal to the eager step, with no host wait") {
  moecomm::capacity<moecomm::drop_by_position> const padded{0.75, 0, true, {}};
  check_captured_parm(moecomm::parallel_sizes{1, 1, 1}, moecomm::deepspeed_mp{}, padded);
  check_captured_parm(moecomm::parallel_sizes{1, 1, 1}, moecomm::parm_s2{2}, padded);
}

TEST_CASE("a captured Parm step on 4 GPUs (deepspeed_mp, S1, S2; padded capacity) replays 100 times equal to the eager step, with no host wait") {
  using moecomm::capacity;
  moecomm::parallel_sizes const sliced{2, 2, 2}, replicated{2, 2, 1};  // MP 2 x EP 2, ESP 2 or 1
  capacity<moecomm::drop_by_position> const uneven{0.75, 0, true, {}};  // C = 5: MP rank 1's share ends in a zero row
  check_captured_parm(sliced, moecomm::deepspeed_mp{}, uneven);
  check_captured_parm(sliced, moecomm::parm_s1{}, uneven);
  check_captured_parm(sliced, moecomm::parm_s2{2}, capacity<moecomm::drop_by_probability>{1.0, 0, true, {}});
  check_captured_parm(replicated, moecomm::parm_s2{3, moecomm::replica_gradients::left_to_trainer},
                      capacity<moecomm::drop_random>{1.25, 2, true, {7, 1}});
}

TEST_CASE("a Parm layer that is not capturable says why, and refuses capture by that reason before enqueuing anything") {
  using moecomm::capacity;
  run_emulated_ranks(4, [](emulated_rank& rank) {  // MP 2 x EP 2
    moecomm::parallel_groups<moecomm::nccl_communicator> groups(rank.comm, {2, 2, 1});
    using padded = capacity<moecomm::drop_by_position>;
    using moecomm::cuda_backend, moecomm::nccl_communicator;
    moecomm::parm_layer<float, cuda_backend, nccl_communicator, moecomm::parm_s2> layer(rank.be, groups, 8, 16, moecomm::parm_s2{2});
    moecomm::parm_layer<float, cuda_backend, nccl_communicator, moecomm::parm_s1, padded> unpadded(rank.be, groups, 8, 16, {},
                                                                                                   padded{1.0, 0, false, {}}),
        summed(rank.be, groups, 8, 16, {}, padded{1.0, 0, true, {}}),
        left(rank.be, groups, 8, 16, moecomm::parm_s1{moecomm::replica_gradients::left_to_trainer}, padded{1.0, 0, true, {}});
    moecomm::parm_layer<float, cuda_backend, nccl_communicator, moecomm::parm_auto> automatic(rank.be, groups, 8, 16,
                                                                                             moecomm::parm_auto{moecomm::parm_cost_model(), 32});
    CHECK(layer.capture_blocker().find("dropless") != std::string::npos);
    CHECK(unpadded.capture_blocker().find("without pad_to_capacity") != std::string::npos);
    CHECK(summed.capture_blocker().find("summed_here") != std::string::npos);  // ESP 1 < MP 2: replicas' gradients
    CHECK(left.capture_blocker().empty());
    CHECK(automatic.capture_blocker().find("parm_auto") != std::string::npos);
    check_error([&] { moecomm::parm_layer<float, cuda_backend, nccl_communicator, moecomm::parm_auto, padded>(
                          rank.be, groups, 8, 16, moecomm::parm_auto{moecomm::parm_cost_model(), 32}, padded{1.0, 0, true, {}}); },
                moecomm::status::invalid_argument, {"parm_layer", "pad_to_capacity with parm_auto"});
    std::int64_t const T = 6, H = 16;
    kernel_scale_bias_experts<float, moecomm::cuda_backend> experts(rank.be, scale_bias_experts<float>(1, 4, H, false));
    auto const r = make_routing({T, 2, 8, 0, true, 1.0, 5});
    auto const idx = upload(rank.be, r.idx);
    auto const w = upload(rank.be, r.w);
    auto const x = upload(rank.be, finite_rows<float>(T, H, 3));
    auto out = rank.be.allocate<float>(T * H);
    rank.be.synchronize();
    REQUIRE(cudaStreamBeginCapture(rank.be.stream(), cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    check_error([&] { layer.forward({idx.data(), w.data(), T, 2}, {x.data(), T, H}, {out.data(), T, H}, experts); },
                moecomm::status::invalid_usage, {"parm_layer::forward", "captures a CUDA graph", "dropless"});
    cudaGraph_t graph = nullptr;
    REQUIRE(cudaStreamEndCapture(rank.be.stream(), &graph) == cudaSuccess);  // nothing was enqueued
    (void)cudaGraphDestroy(graph);
    layer.forward({idx.data(), w.data(), T, 2}, {x.data(), T, H}, {out.data(), T, H}, experts);  // eager: still usable
  });
}

}  // namespace test
