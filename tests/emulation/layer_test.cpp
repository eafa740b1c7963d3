// SPDX-License-Identifier: Apache-2.0
// The plain expert-parallel layer on the emulated GPUs: cuda_backend over nccl_communicator, every
// rank its own emulated device, every capacity policy and all-to-all algorithm; the output and
// gradients equal the single-process oracle bit for bit (layer_cases.hpp), and the emulation saw
// no broken contract. The experts are kernels on the layer's stream.

#include "../patterns/layer_cases.hpp"
#include "emulated_ranks.hpp"

#include <string>
#include <vector>

namespace test {

namespace {

// out[i] = in[i] * (expert + 1), as scale_experts does on the host.
template <class T>
struct scale_kernel {
  T const* in;
  T* out;
  int32_t expert;
  MOECOMM_HOST_DEVICE void operator()(int64_t i) const {
    out[i] = moecomm::dtype_traits<T>::from_float(moecomm::dtype_traits<T>::to_float(in[i]) * static_cast<float>(expert + 1));
  }
};

// The test's experts as kernels on the back-end's stream (the layer's stream).
template <class T>
struct device_scale_experts {
  moecomm::cuda_backend be;
  int32_t first_expert;
  void operator()(int32_t l, moecomm::matrix_view<T const> in, moecomm::matrix_view<T> out) const {
    be.for_each_index(in.rows * in.hidden, scale_kernel<T>{in.data, out.data, first_expert + l});
  }
  void operator()(int32_t l, moecomm::matrix_view<T const>, moecomm::matrix_view<T const> d_out, moecomm::matrix_view<T> d_in) const {
    be.for_each_index(d_out.rows * d_out.hidden, scale_kernel<T>{d_out.data, d_in.data, first_expert + l});
  }
};

template <class T>
moecomm::cuda_backend::buffer_type<T> poisoned_on(moecomm::cuda_backend const& be, int64_t n) {
  return upload(be, poisoned<T>(n));
}

// One forward and backward of `layer` on rank `me`, inputs and outputs in device memory.
template <class T, class Layer>
void check_device_layer_step(Layer& layer, moecomm::cuda_backend const& be, int32_t me, layer_case const& c,
                             layer_inputs<T> const& in) {
  auto const& r = in.routing[static_cast<std::size_t>(me)];
  int64_t const tokens = r.tokens;
  auto const idx = upload(be, r.idx);
  auto const w = upload(be, r.w);
  auto const x = upload(be, in.x[static_cast<std::size_t>(me)]);
  auto const d_out = upload(be, in.d_out[static_cast<std::size_t>(me)]);
  auto out = poisoned_on<T>(be, tokens * c.hidden);
  auto d_x = poisoned_on<T>(be, tokens * c.hidden);
  auto d_w = poisoned_on<float>(be, tokens * r.top_k);
  device_scale_experts<T> const experts{be, me * (c.experts / c.ranks)};
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
}

template <class T, class Algorithm>
void check_emulated_layer(layer_case const& c, Algorithm const& algorithm) {
  CAPTURE(c.ranks);
  CAPTURE(Algorithm::name);
  for_each_capacity([&](auto const& capacity, oracle::drop_rule rule, bool drops) {
    using Capacity = std::decay_t<decltype(capacity)>;
    CAPTURE(Capacity::name);
    auto const in = make_layer_inputs<T>(c, capacity, rule, drops);
    run_emulated_ranks(c.ranks, [&](emulated_rank& rank) {
      moecomm::exchange_groups<moecomm::nccl_communicator> groups(rank.comm, moecomm::topology(c.ranks, c.per_node));
      moecomm::expert_parallel_layer<T, moecomm::cuda_backend, moecomm::nccl_communicator, Capacity, Algorithm> layer(
          rank.be, groups, c.experts, c.hidden, capacity, algorithm);
      check_device_layer_step(layer, rank.be, rank.comm.rank(), c, in);
    });
  });
  auto const seen = moecomm_emulation::violations();
  CHECK_MESSAGE(seen.empty(), "the emulation saw ", seen.size(), " broken contracts, the first: ", seen.empty() ? "" : seen.front());
  moecomm_emulation::clear_violations();
}

}  // namespace

TEST_CASE("the expert-parallel layer on emulated GPUs over NCCL equals the oracle") {
  for (layer_case const& c : {layer_case{2, 2, 4, 2, 16, {40, 0}, 1.2}, layer_case{4, 2, 8, 2, 8, {30, 1, 0, 57}, 0.0}}) {
    check_emulated_layer<float>(c, moecomm::flat{});
    check_emulated_layer<float>(c, moecomm::hierarchical_2d{});
    check_emulated_layer<float>(c, moecomm::pairwise{1});
    check_emulated_layer<float>(c, moecomm::smart_schedule{c.per_node});
  }
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
