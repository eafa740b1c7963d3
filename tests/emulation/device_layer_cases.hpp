// SPDX-License-Identifier: Apache-2.0
#pragma once
// The plain expert-parallel layer on GPUs (emulated under g++, real under nvcc): cuda_backend over a
// device communicator, every capacity policy and all-to-all algorithm; the output and gradients
// equal the single-process oracle bit for bit (layer_cases.hpp), and the emulation saw no broken
// contract. The experts are kernels on the layer's stream. Shared by layer_test.cpp and
// layer_dedup_test.cpp, two files so that they compile in parallel.

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

}  // namespace test
