// SPDX-License-Identifier: Apache-2.0
// The plain expert-parallel layer on GPUs with each all-to-all algorithm, on both placements of the
// ranks; captured in CUDA graphs (with FasterMoE's shadowing too); over a staged host communicator
// (F3); streams that differ (F2); host waits per step.

#include "captured_steps.hpp"
#include "device_experts.hpp"
#include "device_layer_cases.hpp"

#include <cstring>
#include <random>
#include <tuple>

namespace test {

TEST_CASE_TEMPLATE("the expert-parallel layer on GPUs equals the oracle", Placement, gpu_per_rank, ranks_on_one_gpu) {
  for (layer_case const& c : {layer_case{2, 2, 4, 2, 16, {40, 0}, 1.2}, layer_case{4, 2, 8, 2, 8, {30, 1, 0, 57}, 0.0},
                              layer_case{8, 4, 16, 4, 8, {20, 33, 0, 7, 64, 1, 12, 40}, 1.2}}) {
    check_emulated_layer<Placement, float>(c, moecomm::flat{});
    check_emulated_layer<Placement, float>(c, moecomm::hierarchical_2d{});
    check_emulated_layer<Placement, float>(c, moecomm::pairwise{1});
    check_emulated_layer<Placement, float>(c, moecomm::smart_schedule{c.per_node});
  }
}

// Rank `comm.rank()` of an in-process world on `device`: the layer over a host-memory communicator
// (MPI's kind), staged through pinned memory. Unstaged, the combination does not compile.
template <class Algorithm, class Capacity>
void staged_layer_on_device(moecomm::inproc_communicator comm, int device, layer_case const& c, layer_inputs<float> const& in,
                            Capacity const& capacity) {
  moecomm::detail::cuda_check(cudaSetDevice(device), "cudaSetDevice");
  cudaStream_t stream = nullptr;
  moecomm::detail::cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  {
    moecomm::cuda_backend const be(stream, std::chrono::seconds(10));
    using Staged = moecomm::staged_communicator<moecomm::inproc_communicator>;
    Staged world(comm, be);
    moecomm::exchange_groups<Staged> groups(world, moecomm::topology(c.ranks, c.per_node));
    moecomm::expert_parallel_layer<float, moecomm::cuda_backend, Staged, Capacity, Algorithm> layer(be, groups, c.experts, c.hidden, capacity);
    CHECK(layer.capture_blocker().find("driven by the host") != std::string::npos);  // whatever the capacity policy
    check_device_layer_step(layer, be, comm.rank(), c, in, std::is_same_v<Algorithm, moecomm::smart_schedule>);
    be.synchronize();
  }
  (void)cudaStreamDestroy(stream);
}

TEST_CASE_TEMPLATE("over a host-memory communicator (MPI's kind) the layer stages device rows through pinned memory (F3)", Placement,
                   gpu_per_rank, ranks_on_one_gpu) {
  layer_case const c{4, 2, 8, 2, 8, {30, 1, 0, 57}, 0.0};
  bool const one_gpu = std::is_same_v<Placement, ranks_on_one_gpu>;
  if (visible_devices() < (one_gpu ? 1 : c.ranks)) {
    MESSAGE("NOT RUN: this case needs ", one_gpu ? 1 : c.ranks, " GPUs, the machine has ", visible_devices());
    return;
  }
  for_each_capacity([&](auto const& capacity, oracle::drop_rule rule, bool drops) {
    CAPTURE(std::decay_t<decltype(capacity)>::name);
    auto const in = make_layer_inputs<float>(c, capacity, rule, drops);
    moecomm::inproc_world const world(c.ranks, std::chrono::seconds(30));
    world.run([&](moecomm::inproc_communicator comm) {
      staged_layer_on_device<moecomm::hierarchical_2d>(comm, one_gpu ? 0 : comm.rank(), c, in, capacity);
    });
  });
  auto const seen = take_violations();
  CHECK_MESSAGE(seen.empty(), "the emulation saw ", seen.size(), " broken contracts, the first: ", seen.empty() ? "" : seen.front());
}

// ---- CUDA graphs: a padded capacity step captured once, replayed on changing routings and rows
// (captured_steps.hpp)

// The plain layer with a padded capacity policy over `algorithm`, two experts per rank.
template <class Capacity, class Algorithm>
void check_captured_layer(int32_t ranks, int32_t per_node, Capacity const& capacity, Algorithm const& algorithm) {
  std::string const capacity_name = Capacity::name;
  CAPTURE(capacity_name);
  std::string const algorithm_name = Algorithm::name;
  CAPTURE(algorithm_name);
  int32_t const experts = 2 * ranks;
  run_emulated_ranks(ranks, [&](emulated_rank& rank) {
    using Layer = moecomm::expert_parallel_layer<float, moecomm::cuda_backend, moecomm::nccl_communicator, Capacity, Algorithm>;
    moecomm::exchange_groups<moecomm::nccl_communicator> groups(rank.comm, moecomm::topology(ranks, per_node));
    Layer captured(rank.be, groups, experts, 8, capacity, algorithm), eager(rank.be, groups, experts, 8, capacity, algorithm);
    REQUIRE(captured.capture_blocker().empty());
    for (Layer* layer : {&captured, &eager}) layer->reserve(moecomm::step_bounds{24, 2, 0, 0});
    device_scale_experts<float> scale{rank.comm.rank() * 2, {}, {}}, same_scale{rank.comm.rank() * 2, {}, {}};
    replay_captured_step(rank, experts, captured, eager, scale, same_scale);
  });
  require_no_violations();
}

// FasterMoE's shadowing (point-to-point path) over `flat` with a padded capacity policy: the
// planner's fixed choice (`shadowing`'s) is the eager step's, which the graph keeps; every replay
// still sends the owners' parameters to the replicas and sums the replicas' gradients back.
template <class Capacity, class Shadowing>
void check_captured_fastermoe(int32_t ranks, Capacity const& capacity, Shadowing const& shadowing) {
  std::string const capacity_name = Capacity::name;
  CAPTURE(capacity_name);
  int32_t const experts = 2 * ranks;
  run_emulated_ranks(ranks, [&](emulated_rank& rank) {
    using Layer = moecomm::expert_parallel_layer<float, moecomm::cuda_backend, moecomm::nccl_communicator, Capacity, moecomm::flat,
                                                 moecomm::weighted, Shadowing>;
    moecomm::exchange_groups<moecomm::nccl_communicator> groups(rank.comm, moecomm::topology(ranks, ranks));
    Layer captured(rank.be, groups, experts, 8, capacity, {}, {}, shadowing), eager(rank.be, groups, experts, 8, capacity, {}, {}, shadowing);
    REQUIRE(captured.capture_blocker().empty());
    scale_bias_experts<float> const initial(rank.comm.rank(), 2, 8, true);
    kernel_scale_bias_experts<float, moecomm::cuda_backend> captured_experts(rank.be, initial), eager_experts(rank.be, initial);
    captured.reserve(moecomm::step_bounds{24, 2, 0, 0}, captured_experts);
    eager.reserve(moecomm::step_bounds{24, 2, 0, 0}, eager_experts);
    replay_captured_step(rank, experts, captured, eager, captured_experts, eager_experts);
    REQUIRE(!captured.shadow_state().decision().shadowed.empty());
  });
  require_no_violations();
}

TEST_CASE("a captured step of a padded capacity layer on one GPU replays 100 times equal to the eager step, with no host wait") {
  check_captured_layer(1, 1, moecomm::capacity<moecomm::drop_by_probability>{1.0, 0, true, {}}, moecomm::flat{});
}

TEST_CASE("a captured step of a padded capacity layer on 2 and 4 GPUs replays 100 times equal to the eager step, with no host wait") {
  using moecomm::capacity;
  check_captured_layer(2, 2, capacity<moecomm::drop_by_position>{1.0, 0, true, {}}, moecomm::flat{});
  check_captured_layer(2, 2, capacity<moecomm::drop_by_probability>{0.75, 0, true, {}}, moecomm::flat{});
  check_captured_layer(2, 2, capacity<moecomm::drop_random>{1.25, 2, true, {7, 1}}, moecomm::flat{});
  check_captured_layer(4, 2, capacity<moecomm::drop_by_probability>{1.0, 0, true, {}}, moecomm::hierarchical_2d{});
  check_captured_layer(4, 2, capacity<moecomm::drop_by_position>{0.5, 0, true, {}}, moecomm::pairwise{1});
}

TEST_CASE("a captured FasterMoE step (its shadowed experts kept) replays 100 times equal to the eager step, with no host wait") {
  using moecomm::capacity;
  moecomm::fastermoe_shadowing<moecomm::point_to_point_path, fixed_planner> const everywhere{small_model(), {64}, {{0, 3}}};
  check_captured_fastermoe(2, capacity<moecomm::drop_by_probability>{1.0, 0, true, {}}, everywhere);
  check_captured_fastermoe(4, capacity<moecomm::drop_by_position>{0.75, 0, true, {}}, everywhere);
  // Pro-Prophet's kind of choice: replicas on subsets (expert 0 on ranks 2 and 3, expert 5 on rank 0).
  moecomm::fastermoe_shadowing<moecomm::point_to_point_path, fixed_subset_planner> const subsets{
      small_model(), {64}, {{0, 5}, {0, 2, 3}, {2, 3, 0}}};
  check_captured_fastermoe(4, capacity<moecomm::drop_random>{1.25, 2, true, {7, 1}}, subsets);
}

TEST_CASE("a layer that is not capturable says why, and refuses capture by that reason") {
  using moecomm::capacity;
  run_emulated_ranks(2, [](emulated_rank& rank) {
    moecomm::cuda_backend const& be = rank.be;
    moecomm::exchange_groups<moecomm::nccl_communicator> groups(rank.comm, moecomm::topology(2, 2));
    auto dropless = moecomm::make_expert_parallel_layer<float>(be, groups, 4, 8);
    auto unpadded = moecomm::make_expert_parallel_layer<float>(be, groups, 4, 8, capacity<moecomm::drop_by_position>{1.0, 0, false, {}});
    auto padded = moecomm::make_expert_parallel_layer<float>(be, groups, 4, 8, capacity<moecomm::drop_by_position>{1.0, 0, true, {}});
    CHECK(dropless.capture_blocker().find("dropless") != std::string::npos);
    CHECK(unpadded.capture_blocker().find("without pad_to_capacity") != std::string::npos);
    CHECK(padded.capture_blocker().empty());
    capture_inputs const in(5, 6, 2, 4, 8);
    auto const idx = upload(be, in.idx);
    auto const w = upload(be, in.w);
    auto const x = upload(be, in.x);
    auto out = be.allocate<float>(6 * 8);
    device_scale_experts<float> const scale{rank.comm.rank() * 2, {}, {}};
    moecomm::routing_view const routing{idx.data(), w.data(), 6, 2};
    be.synchronize();
    auto capture_forward = [&](auto& layer, moecomm::routing_view const& r, std::vector<std::string> const& fragments,
                               moecomm::status code = moecomm::status::invalid_usage) {
      REQUIRE(cudaStreamBeginCapture(be.stream(), cudaStreamCaptureModeThreadLocal) == cudaSuccess);
      check_error([&] { layer.forward(r, {x.data(), r.num_tokens, 8}, {out.data(), r.num_tokens, 8}, scale); }, code, fragments);
      cudaGraph_t graph = nullptr;
      REQUIRE(cudaStreamEndCapture(be.stream(), &graph) == cudaSuccess);  // nothing was enqueued
      (void)cudaGraphDestroy(graph);
    };
    capture_forward(dropless, routing, {"not capturable", "dropless", "pad_to_capacity = true"});
    capture_forward(unpadded, routing, {"not capturable", "without pad_to_capacity"});
    capture_forward(padded, routing, {"eager route of the same shape", "there was none"});
    padded.set_training(false);
    padded.forward(routing, {x.data(), 6, 8}, {out.data(), 6, 8}, scale);  // eager, 6 tokens
    be.synchronize();
    moecomm::routing_view shorter = routing;
    shorter.num_tokens = 5;
    capture_forward(padded, shorter, {"argument 'routing' has 5 tokens", "eager route before the capture had 6"},
                    moecomm::status::invalid_argument);
  });
}

TEST_CASE("a layer whose back-end and communicator enqueue on different streams is refused (F2)") {
  run_emulated_ranks(2, [](emulated_rank& rank) {
    cudaStream_t other = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking) == cudaSuccess);
    moecomm::exchange_groups<moecomm::nccl_communicator> groups(rank.comm, moecomm::topology(2, 2));
    check_error([&] { (void)moecomm::make_expert_parallel_layer<float>(moecomm::cuda_backend{other}, groups, 4, 8); },
                moecomm::status::invalid_argument,
                {"dispatcher: the back-end enqueues on stream", "but the communicator on stream", "cuda_backend{comm.stream()}"});
    (void)cudaStreamDestroy(other);
  });
}

}  // namespace test

namespace test {

#if MOECOMM_CUDA_EMULATION()
// The host waits of one warm step of the plain layer on 2 emulated GPUs, per algorithm and capacity
// policy: the numbers docs/architecture.md (§2a) and docs/performance.md list, so that a change that
// adds one is seen. Counted per device: the waits of the rank's thread and of any other (a lane's).
template <class Algorithm, class Capacity>
std::pair<std::int64_t, std::int64_t> host_waits_of_a_step(Algorithm const& algorithm, Capacity const& capacity) {
  layer_case const c{2, 2, 4, 2, 16, {40, 9}, 1.2};
  auto const in = make_layer_inputs<float>(c, capacity, oracle::drop_rule::position, false);
  std::vector<std::int64_t> forward(2), backward(2);
  run_emulated_ranks(2, [&](emulated_rank& rank) {
    std::int32_t const me = rank.comm.rank();
    moecomm::exchange_groups<moecomm::nccl_communicator> groups(rank.comm, moecomm::topology(2, 2));
    moecomm::expert_parallel_layer<float, moecomm::cuda_backend, moecomm::nccl_communicator, Capacity, Algorithm> layer(
        rank.be, groups, c.experts, c.hidden, capacity, algorithm);
    auto const& r = in.routing[static_cast<std::size_t>(me)];
    auto const idx = upload(rank.be, r.idx);
    auto const w = upload(rank.be, r.w);
    auto const x = upload(rank.be, in.x[static_cast<std::size_t>(me)]);
    auto out = rank.be.allocate<float>(r.tokens * c.hidden);
    auto d_x = rank.be.allocate<float>(r.tokens * c.hidden);
    auto d_w = rank.be.allocate<float>(r.tokens * r.top_k);
    device_scale_experts<float> const experts{me * 2, {}, {}};
    for (int step = 0; step < 2; ++step) {  // the first step grows the buffers
      rank.be.synchronize();
      std::int64_t const before = moecomm_emulation::host_waits(rank.device);
      layer.forward({idx.data(), w.data(), r.tokens, r.top_k}, {x.data(), r.tokens, c.hidden}, {out.data(), r.tokens, c.hidden},
                    experts);
      std::int64_t const after_forward = moecomm_emulation::host_waits(rank.device);
      layer.backward({x.data(), r.tokens, c.hidden}, {d_x.data(), r.tokens, c.hidden},
                     moecomm::array_view<float>{d_w.data(), r.tokens * r.top_k}, experts);
      forward[static_cast<std::size_t>(me)] = after_forward - before;
      backward[static_cast<std::size_t>(me)] = moecomm_emulation::host_waits(rank.device) - after_forward;
    }
  });
  CHECK(forward[0] == forward[1]);
  CHECK(backward[0] == backward[1]);
  return {forward[0], backward[0]};
}

TEST_CASE("host waits per step of the plain layer on emulated GPUs") {
  using waits = std::pair<std::int64_t, std::int64_t>;
  using moecomm::capacity;
  struct counted {
    char const* name;
    waits got, goal;
  };
  // Dropless: the count all-gather is the one wait (the plan's counts and its value scan's verdict
  // ride on it). A capacity policy adds one: the capacity agreement (or the receiver budget's
  // dropless counts), which carries the dropless plan's counts and verdict.
  counted const steps[] = {
      {"flat", host_waits_of_a_step(moecomm::flat{}, moecomm::dropless{}), {1, 0}},
      {"hierarchical_2d", host_waits_of_a_step(moecomm::hierarchical_2d{}, moecomm::dropless{}), {1, 0}},
      {"pairwise", host_waits_of_a_step(moecomm::pairwise{1}, moecomm::dropless{}), {1, 0}},
      {"dedup_per_rank<flat>", host_waits_of_a_step(moecomm::dedup_per_rank<moecomm::flat>{}, moecomm::dropless{}), {1, 0}},
      {"dedup_per_node", host_waits_of_a_step(moecomm::dedup_per_node{4}, moecomm::dropless{}), {1, 0}},
      {"flat + capacity<drop_by_position>",
       host_waits_of_a_step(moecomm::flat{}, capacity<moecomm::drop_by_position>{1.0, 0, false, {}}), {2, 0}},
      {"flat + capacity<drop_by_probability>, padded",
       host_waits_of_a_step(moecomm::flat{}, capacity<moecomm::drop_by_probability>{0.5, 0, true, {}}), {2, 0}},
      {"flat + capacity<drop_random>", host_waits_of_a_step(moecomm::flat{}, capacity<moecomm::drop_random>{0.75, 0, false, {42, 0}}),
       {2, 0}},
      {"flat + receiver_budget", host_waits_of_a_step(moecomm::flat{}, moecomm::receiver_budget{40}), {2, 0}},
      {"dedup_per_node + capacity<drop_by_position>",
       host_waits_of_a_step(moecomm::dedup_per_node{4}, capacity<moecomm::drop_by_position>{1.0, 0, false, {}}), {2, 0}}};
  for (counted const& c : steps) {
    MESSAGE(std::string(c.name), ": forward ", c.got.first, ", backward ", c.got.second);
    CHECK_MESSAGE(c.got == c.goal, c.name, " waits ", c.got.first, " + ", c.got.second, "; the goal is ", c.goal.first, " + ",
                  c.goal.second);
  }
}

#endif  // the emulation counts host waits

}  // namespace test
