// SPDX-License-Identifier: Apache-2.0
// The plain expert-parallel layer on GPUs with each all-to-all algorithm, on both placements of the
// ranks; over a staged host communicator (F3); streams that differ (F2); host waits per step.

#include "device_layer_cases.hpp"

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
      {"dedup_per_node", host_waits_of_a_step(moecomm::dedup_per_node{}, moecomm::dropless{}), {1, 0}},
      {"flat + capacity<drop_by_position>",
       host_waits_of_a_step(moecomm::flat{}, capacity<moecomm::drop_by_position>{1.0, 0, false, {}}), {2, 0}},
      {"flat + capacity<drop_by_probability>, padded",
       host_waits_of_a_step(moecomm::flat{}, capacity<moecomm::drop_by_probability>{0.5, 0, true, {}}), {2, 0}},
      {"flat + capacity<drop_random>", host_waits_of_a_step(moecomm::flat{}, capacity<moecomm::drop_random>{0.75, 0, false, {42, 0}}),
       {2, 0}},
      {"flat + receiver_budget", host_waits_of_a_step(moecomm::flat{}, moecomm::receiver_budget{40}), {2, 0}},
      {"dedup_per_node + capacity<drop_by_position>",
       host_waits_of_a_step(moecomm::dedup_per_node{}, capacity<moecomm::drop_by_position>{1.0, 0, false, {}}), {2, 0}}};
  for (counted const& c : steps) {
    MESSAGE(std::string(c.name), ": forward ", c.got.first, ", backward ", c.got.second);
    CHECK_MESSAGE(c.got == c.goal, c.name, " waits ", c.got.first, " + ", c.got.second, "; the goal is ", c.goal.first, " + ",
                  c.goal.second);
  }
}

#endif  // the emulation counts host waits

}  // namespace test
