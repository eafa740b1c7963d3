// SPDX-License-Identifier: Apache-2.0
// The plain expert-parallel layer on GPUs with each all-to-all algorithm, on both placements of the
// ranks; captured in CUDA graphs (with FasterMoE's shadowing too); over a staged host communicator
// (F3); streams that differ (F2); host waits per step.

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

// The host waits for `device`'s work so far (the emulation counts them; a GPU: 0, nothing checked).
inline std::int64_t host_waits_of([[maybe_unused]] int device) {
#if MOECOMM_CUDA_EMULATION()
  return moecomm_emulation::host_waits(device);
#else
  return 0;
#endif
}

// One rank's inputs of a step: routing (some slots masked), rows and the output gradient, drawn from
// `seed` (the step and the rank); written into the same device buffers each step, which a captured
// graph reads when it replays.
struct capture_inputs {
  std::vector<int32_t> idx;
  std::vector<float> w, x, d_out;
  capture_inputs(uint64_t seed, int64_t tokens, int32_t top_k, int32_t experts, int64_t hidden) {
    std::mt19937_64 rng(seed);
    for (int64_t t = 0; t < tokens; ++t)
      for (int32_t k = 0; k < top_k; ++k) {
        bool const masked = rng() % 9 == 0;
        idx.push_back(masked ? -1 : static_cast<int32_t>((rng() % 4 == 0 ? 0 : rng()) % static_cast<uint64_t>(experts)));
        w.push_back(static_cast<float>(rng() % 1000) / 997.0f);
      }
    for (int64_t i = 0; i < tokens * hidden; ++i) {
      x.push_back(static_cast<float>(static_cast<int64_t>(rng() % 2001) - 1000) / 64.0f);
      d_out.push_back(static_cast<float>(static_cast<int64_t>(rng() % 2001) - 1000) / 128.0f);
    }
  }
};

// One layer's step on device buffers: forward, then backward.
struct device_step {
  moecomm::cuda_backend::buffer_type<float> out, d_x, d_w;
  device_step(moecomm::cuda_backend const& be, int64_t tokens, int32_t top_k, int64_t hidden)
      : out(be.allocate<float>(tokens * hidden)), d_x(be.allocate<float>(tokens * hidden)), d_w(be.allocate<float>(tokens * top_k)) {}
  template <class Layer, class Experts>
  void run(Layer& layer, moecomm::routing_view const& routing, float const* x, float const* d_out, int64_t hidden, Experts& experts) {
    int64_t const tokens = routing.num_tokens;
    layer.forward(routing, {x, tokens, hidden}, {out.data(), tokens, hidden}, experts);
    layer.backward({d_out, tokens, hidden}, {d_x.data(), tokens, hidden}, moecomm::array_view<float>{d_w.data(), tokens * routing.top_k},
                   experts);
  }
};

// The experts' parameter gradients on the host: none for experts without parameters.
template <class Experts>
std::vector<float> parameter_gradients(Experts const&) {
  return {};
}
template <class Backend>
std::vector<float> parameter_gradients(kernel_scale_bias_experts<float, Backend> const& experts) {
  return experts.gradients_on_host();
}
// An optimizer's step between replays: new parameters, drawn from `seed` (none without parameters).
template <class Experts>
void step_parameters(Experts&, uint64_t) {}
template <class Backend>
void step_parameters(kernel_scale_bias_experts<float, Backend>& experts, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> p(experts.params.size());
  for (float& v : p) v = static_cast<float>(static_cast<int64_t>(rng() % 257) - 128) / 64.0f;
  experts.be.copy(experts.params.data(), p.data(), static_cast<int64_t>(p.size()));  // pageable: read when enqueued
}

// Captures one forward + backward of `captured` (after `reserve`) after an eager warm-up step,
// replays the graph on 100 new routings and rows (the inputs rewritten in place), and checks each
// replay against the eager step of `eager` (built alike, with experts of its own, equal) on the same
// inputs, bit for bit, the experts' parameter gradients included; the parameters change before
// every replay (an optimizer's step), so a replay must move them again. The capture and the replays
// wait for nothing on the host.
template <class Layer, class Experts>
void replay_captured_step(emulated_rank& rank, int32_t experts, Layer& captured, Layer& eager, Experts& captured_experts,
                          Experts& eager_experts) {
  int32_t const me = rank.comm.rank(), top_k = 2;
  int64_t const tokens = 24, hidden = 8;
  int const replays = 100;
  moecomm::cuda_backend const& be = rank.be;
  auto idx = be.allocate<int32_t>(tokens * top_k);
  auto w = be.allocate<float>(tokens * top_k);
  auto x = be.allocate<float>(tokens * hidden);
  auto d_out = be.allocate<float>(tokens * hidden);
  moecomm::routing_view const routing{idx.data(), w.data(), tokens, top_k};
  auto write_inputs = [&](int step, int32_t slot_3 = 0) {  // slot_3: a value for slot 3 (0: as drawn)
    capture_inputs in(static_cast<uint64_t>(step) * 1000 + static_cast<uint64_t>(me), tokens, top_k, experts, hidden);
    if (slot_3 != 0) in.idx[3] = slot_3;
    be.copy(idx.data(), in.idx.data(), tokens * top_k);  // pageable: read when enqueued
    be.copy(w.data(), in.w.data(), tokens * top_k);
    be.copy(x.data(), in.x.data(), tokens * hidden);
    be.copy(d_out.data(), in.d_out.data(), tokens * hidden);
  };
  device_step mine(be, tokens, top_k, hidden), reference(be, tokens, top_k, hidden);
  write_inputs(0);
  mine.run(captured, routing, x.data(), d_out.data(), hidden, captured_experts);  // the eager warm-up: its capacity is the graph's
  reference.run(eager, routing, x.data(), d_out.data(), hidden, eager_experts);   // (and its parameter gradients)
  be.synchronize();
  std::int64_t waits = host_waits_of(rank.device);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaStreamBeginCapture(be.stream(), cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  mine.run(captured, routing, x.data(), d_out.data(), hidden, captured_experts);
  REQUIRE(cudaStreamEndCapture(be.stream(), &graph) == cudaSuccess);
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  CHECK_MESSAGE(host_waits_of(rank.device) == waits, "the captured step waited on the host");
  CHECK(captured.dispatch_state().report().kept_slots == -1);
  auto require_equal_steps = [&](int step) {
    for (auto const& output : {std::tuple{&mine.out, &reference.out, "out"}, std::tuple{&mine.d_x, &reference.d_x, "d_x"},
                               std::tuple{&mine.d_w, &reference.d_w, "d_weights"}}) {
      std::string const what = std::get<2>(output);
      auto const a = download(be, std::get<0>(output)->data(), std::get<0>(output)->size());
      auto const b = download(be, std::get<1>(output)->data(), std::get<1>(output)->size());
      REQUIRE_MESSAGE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0, "rank ", me, " replay ", step, ": the captured ",
                      what, " differs from the eager step's");
    }
    auto const a = parameter_gradients(captured_experts), b = parameter_gradients(eager_experts);
    REQUIRE_MESSAGE((a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0), "rank ", me, " replay ",
                    step, ": the captured step's parameter gradients differ from the eager step's");
  };
  for (int step = 1; step <= replays; ++step) {
    write_inputs(step);
    for (Experts* e : {&captured_experts, &eager_experts}) step_parameters(*e, static_cast<uint64_t>(step) * 7919 + static_cast<uint64_t>(me));
    waits = host_waits_of(rank.device);
    REQUIRE(cudaGraphLaunch(exec, be.stream()) == cudaSuccess);
    REQUIRE_MESSAGE(host_waits_of(rank.device) == waits, "a replay waited on the host");
    reference.run(eager, routing, x.data(), d_out.data(), hidden, eager_experts);
    require_equal_steps(step);
    captured.dispatch_state().check_captured_routing();
  }
  // An id out of range on rank 1: the replay masks it (the eager step with that slot masked is
  // equal), and check_captured_routing raises it there, naming the slot.
  write_inputs(replays + 1, me == 1 ? experts + 5 : 0);
  REQUIRE(cudaGraphLaunch(exec, be.stream()) == cudaSuccess);
  write_inputs(replays + 1, me == 1 ? -1 : 0);
  reference.run(eager, routing, x.data(), d_out.data(), hidden, eager_experts);
  require_equal_steps(replays + 1);
  write_inputs(replays + 1, me == 1 ? experts + 5 : 0);
  if (me == 1)
    check_error([&] { captured.dispatch_state().check_captured_routing(); }, moecomm::status::invalid_argument,
                {"check_captured_routing", "topk_idx[1][1] = " + std::to_string(experts + 5), "out of range"});
  else
    captured.dispatch_state().check_captured_routing();
  (void)cudaGraphExecDestroy(exec);
  (void)cudaGraphDestroy(graph);
}

void require_no_violations() {
  auto const seen = take_violations();
  CHECK_MESSAGE(seen.empty(), "the emulation saw ", seen.size(), " broken contracts, the first: ", seen.empty() ? "" : seen.front());
}

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
