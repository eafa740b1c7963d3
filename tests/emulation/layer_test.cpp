// SPDX-License-Identifier: Apache-2.0
// The plain expert-parallel layer on the emulated GPUs: cuda_backend over nccl_communicator, every
// rank its own emulated device, every capacity policy and all-to-all algorithm; the output and
// gradients equal the single-process oracle bit for bit (layer_cases.hpp), and the emulation saw
// no broken contract. The experts are kernels on the layer's stream.

#include "../patterns/layer_cases.hpp"
#include "emulated_ranks.hpp"

#include <moecomm/comm/inproc.hpp>
#include <moecomm/comm/staged.cuh>

#include <mutex>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

namespace test {

namespace {

// out[i] = in[i] * (expert + 1), as scale_experts does on the host.
template <class T>
struct scale_kernel {
  moecomm::matrix_view<T const> in;  // sized views: the emulation knows exactly which rows it touches
  moecomm::matrix_view<T> out;
  int32_t expert;
  MOECOMM_HOST_DEVICE void operator()(int64_t i) const {
    out.data[i] = moecomm::dtype_traits<T>::from_float(moecomm::dtype_traits<T>::to_float(in.data[i]) * static_cast<float>(expert + 1));
  }
};

// out[i] = in[i] * (expert + 1) over a block of rows cut among local experts by `offsets` (in
// device memory, as a grouped GEMM takes its problem sizes): one kernel for every expert. Its
// arguments are sized views, so the emulation knows exactly which rows it touches.
template <class T>
struct grouped_scale_kernel {
  moecomm::matrix_view<T const> in;
  moecomm::matrix_view<T> out;
  moecomm::array_view<int64_t const> offsets;
  int32_t first_expert;
  MOECOMM_HOST_DEVICE void operator()(int64_t i) const {
    int64_t const row = i / in.hidden;
    int32_t l = 0;
    while (row >= offsets.data[l + 1]) ++l;
    out.data[i] = moecomm::dtype_traits<T>::from_float(moecomm::dtype_traits<T>::to_float(in.data[i]) *
                                                       static_cast<float>(first_expert + l + 1));
  }
};

// The test's experts as kernels on the back-end each call is given (the layer's, or the lane's in
// the smart schedule), noting the streams they were given; `Grouped` adds the grouped form.
template <class T, bool Grouped = false>
struct device_scale_experts {
  int32_t first_expert;
  mutable std::mutex lock;
  mutable std::set<cudaStream_t> streams;

  void operator()(int32_t l, moecomm::matrix_view<T const> in, moecomm::matrix_view<T> out, moecomm::cuda_backend const& be) const {
    note(be);
    be.for_each_index(in.rows * in.hidden, scale_kernel<T>{in, out, first_expert + l});
  }
  void operator()(int32_t l, moecomm::matrix_view<T const>, moecomm::matrix_view<T const> d_out, moecomm::matrix_view<T> d_in,
                  moecomm::cuda_backend const& be) const {
    note(be);
    be.for_each_index(d_out.rows * d_out.hidden, scale_kernel<T>{d_out, d_in, first_expert + l});
  }
  template <bool G = Grouped, class = std::enable_if_t<G>>
  void forward_grouped(moecomm::grouped_rows<T> const& rows, moecomm::cuda_backend const& be) const {
    grouped(rows.in, rows.out, rows.offsets, be);
  }
  template <bool G = Grouped, class = std::enable_if_t<G>>
  void backward_grouped(moecomm::grouped_gradient_rows<T> const& rows, moecomm::cuda_backend const& be) const {
    grouped(rows.d_out, rows.d_in, rows.offsets, be);
  }
  [[nodiscard]] std::set<cudaStream_t> streams_seen() const {
    std::lock_guard<std::mutex> const hold(lock);
    return streams;
  }

 private:
  void note(moecomm::cuda_backend const& be) const {
    std::lock_guard<std::mutex> const hold(lock);
    streams.insert(be.stream());
  }
  void grouped(moecomm::matrix_view<T const> in, moecomm::matrix_view<T> out, moecomm::array_view<int64_t const> offsets,
               moecomm::cuda_backend const& be) const {
    note(be);
    auto on_device = be.allocate<int64_t>(offsets.size);  // freed in stream order after the kernel
    be.copy(on_device.data(), offsets.data, offsets.size);
    be.for_each_index(in.rows * in.hidden, grouped_scale_kernel<T>{in, out, {on_device.data(), offsets.size}, first_expert});
  }};

template <class T>
moecomm::cuda_backend::buffer_type<T> poisoned_on(moecomm::cuda_backend const& be, int64_t n) {
  return upload(be, poisoned<T>(n));
}

// One forward and backward of `layer` on rank `me`, inputs and outputs in device memory.
// `grouped`: the experts have the grouped form. The experts' kernels must run on the layer's stream,
// except in the smart schedule, where they overlap the exchanges on the lane's (F7).
template <class T, bool Grouped = false, class Layer>
void check_device_layer_step(Layer& layer, moecomm::cuda_backend const& be, int32_t me, layer_case const& c,
                             layer_inputs<T> const& in, bool overlapped) {
  auto const& r = in.routing[static_cast<std::size_t>(me)];
  int64_t const tokens = r.tokens;
  auto const idx = upload(be, r.idx);
  auto const w = upload(be, r.w);
  auto const x = upload(be, in.x[static_cast<std::size_t>(me)]);
  auto const d_out = upload(be, in.d_out[static_cast<std::size_t>(me)]);
  auto out = poisoned_on<T>(be, tokens * c.hidden);
  auto d_x = poisoned_on<T>(be, tokens * c.hidden);
  auto d_w = poisoned_on<float>(be, tokens * r.top_k);
  device_scale_experts<T, Grouped> const experts{me * (c.experts / c.ranks), {}, {}};
  layer.forward({idx.data(), w.data(), tokens, r.top_k}, {x.data(), tokens, c.hidden}, {out.data(), tokens, c.hidden}, experts);
  check_bitwise(download(be, out.data(), tokens * c.hidden), in.want[static_cast<std::size_t>(me)].out, c.hidden, "layer output");
  CHECK(layer.dispatch_state().report().dropped_slots == in.want[static_cast<std::size_t>(me)].dropped);
  layer.backward({d_out.data(), tokens, c.hidden}, {d_x.data(), tokens, c.hidden},
                 moecomm::array_view<float>{d_w.data(), tokens * r.top_k}, experts);
  check_bitwise(download(be, d_x.data(), tokens * c.hidden), in.want[static_cast<std::size_t>(me)].d_x, c.hidden, "input gradient");
  auto const got_w = download(be, d_w.data(), tokens * r.top_k);
  auto const& want_w = in.want[static_cast<std::size_t>(me)].d_w;
  for (std::size_t i = 0; i < got_w.size(); ++i)
    REQUIRE_MESSAGE(std::fabs(got_w[i] - want_w[i]) <= 1e-5f * std::fabs(want_w[i]) + 1e-6f * float(c.hidden), "rank ", me,
                    " d_weights[", i, "] = ", got_w[i], ", oracle ", want_w[i]);
  std::set<cudaStream_t> const streams = experts.streams_seen();
  if (overlapped) {
    CHECK_MESSAGE((streams.size() == 1 && streams.count(be.stream()) == 0),
                  "the smart schedule's experts must run on the lane's stream, not the layer's");
  } else if (!streams.empty()) {
    CHECK_MESSAGE((streams.size() == 1 && streams.count(be.stream()) == 1), "the experts must run on the layer's stream");
  }
}

template <class Placement, class T, class Algorithm, bool Grouped = false>
void check_emulated_layer(layer_case const& c, Algorithm const& algorithm) {
  CAPTURE(c.ranks);
  CAPTURE(Algorithm::name);
  for_each_capacity([&](auto const& capacity, oracle::drop_rule rule, bool drops) {
    using Capacity = std::decay_t<decltype(capacity)>;
    CAPTURE(Capacity::name);
    auto const in = make_layer_inputs<T>(c, capacity, rule, drops, sum_order_of<Algorithm>());
    run_device_ranks<Placement>(c.ranks, [&](auto& rank) {
      using Comm = std::decay_t<decltype(rank.comm)>;
      moecomm::exchange_groups<Comm> groups(rank.comm, moecomm::topology(c.ranks, c.per_node));
      moecomm::expert_parallel_layer<T, moecomm::cuda_backend, Comm, Capacity, Algorithm> layer(
          rank.be, groups, c.experts, c.hidden, capacity, algorithm);
      check_device_layer_step<T, Grouped>(layer, rank.be, rank.comm.rank(), c, in, std::is_same_v<Algorithm, moecomm::smart_schedule>);
    });
  });
  auto const seen = take_violations();
  CHECK_MESSAGE(seen.empty(), "the emulation saw ", seen.size(), " broken contracts, the first: ", seen.empty() ? "" : seen.front());
}

}  // namespace

TEST_CASE_TEMPLATE("the expert-parallel layer on GPUs equals the oracle", Placement, gpu_per_rank, ranks_on_one_gpu) {
  for (layer_case const& c : {layer_case{2, 2, 4, 2, 16, {40, 0}, 1.2}, layer_case{4, 2, 8, 2, 8, {30, 1, 0, 57}, 0.0},
                              layer_case{8, 4, 16, 4, 8, {20, 33, 0, 7, 64, 1, 12, 40}, 1.2}}) {
    check_emulated_layer<Placement, float>(c, moecomm::flat{});
    check_emulated_layer<Placement, float>(c, moecomm::hierarchical_2d{});
    check_emulated_layer<Placement, float>(c, moecomm::pairwise{1});
    check_emulated_layer<Placement, float>(c, moecomm::smart_schedule{c.per_node});
  }
}

TEST_CASE_TEMPLATE("the layer with a deduplicated exchange on GPUs equals the oracle's per-rank (and per-node) sums", Placement,
                   gpu_per_rank, ranks_on_one_gpu) {
  for (layer_case const& c : {layer_case{2, 2, 4, 3, 16, {40, 0}, 1.2}, layer_case{8, 4, 16, 8, 8, {20, 33, 0, 7, 64, 1, 12, 40}, 1.2}}) {
    check_emulated_layer<Placement, float>(c, moecomm::dedup_per_rank<moecomm::flat>{});
    check_emulated_layer<Placement, float>(c, moecomm::dedup_per_rank<moecomm::hierarchical_2d>{});
    check_emulated_layer<Placement, float>(c, moecomm::dedup_per_node{});
  }
  check_emulated_layer<Placement, __nv_bfloat16>(layer_case{4, 2, 8, 4, 16, {30, 1, 0, 57}, 2.0},
                                                 moecomm::dedup_per_rank<moecomm::pairwise>{});
}

TEST_CASE_TEMPLATE("grouped experts (one call for every local expert) on GPUs equal the oracle", Placement, gpu_per_rank,
                   ranks_on_one_gpu) {
  layer_case const c{4, 2, 16, 2, 8, {30, 1, 0, 57}, 1.2};
  check_emulated_layer<Placement, float, moecomm::flat, true>(c, moecomm::flat{});
  check_emulated_layer<Placement, float, moecomm::smart_schedule, true>(c, moecomm::smart_schedule{c.per_node});
}

TEST_CASE_TEMPLATE("the layer on GPUs handles bf16 rows", Placement, gpu_per_rank, ranks_on_one_gpu) {
  check_emulated_layer<Placement, __nv_bfloat16>(layer_case{4, 2, 8, 2, 16, {30, 1, 0, 57}, 8.0}, moecomm::hierarchical_2d{});
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
  moecomm::capacity<moecomm::drop_by_position> const drop{1.0, 0, false, {}};
  CHECK(host_waits_of_a_step(moecomm::flat{}, moecomm::dropless{}) == waits{3, 1});
  CHECK(host_waits_of_a_step(moecomm::hierarchical_2d{}, moecomm::dropless{}) == waits{3, 1});
  CHECK(host_waits_of_a_step(moecomm::pairwise{1}, moecomm::dropless{}) == waits{3, 1});
  CHECK(host_waits_of_a_step(moecomm::flat{}, drop) == waits{6, 1});
  for (auto const& [name, got] : {std::pair<char const*, waits>{"flat", host_waits_of_a_step(moecomm::flat{}, moecomm::dropless{})},
                                  {"hierarchical_2d", host_waits_of_a_step(moecomm::hierarchical_2d{}, moecomm::dropless{})},
                                  {"pairwise", host_waits_of_a_step(moecomm::pairwise{1}, moecomm::dropless{})},
                                  {"flat + capacity", host_waits_of_a_step(moecomm::flat{}, drop)}})
    MESSAGE(std::string(name), ": forward ", got.first, ", backward ", got.second);
}

#endif  // the emulation counts host waits

}  // namespace test
