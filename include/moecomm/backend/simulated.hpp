// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `simulated_backend<Inner>`: runs every call on `Inner` (the host back-end) for real, so results
//! are exactly the host's, and charges the device time the call would take to the simulated clock
//! of the calling S4U actor (`<moecomm/simulation/device_time.hpp>`):
//!
//! | call | charged bytes (one kernel each) |
//! |---|---|
//! | `for_each_row(rows, k)` | `Σ_r k.bytes_of_row(r)` (rows of the hidden size: scaled; a slot kernel counts the slots that map to a row) |
//! | `for_each_index(n, f)` | `n × 8` (an index read and written); `n × f.bytes_per_index()`, scaled inside a payload scope, when `f` declares it (a kernel over row elements) |
//! | `reduce(n, ...)`, `reduce_into(result, n, ...)` | `n × 8` |
//! | `stable_sort_by_key(n, end_bit)` | `⌈end_bit / 8⌉` radix passes × `n × 16` (key and value, read and written) |
//! | `exclusive_sum(n)` | `n × 8` (an element read and written) |
//! | `copy(n)` | `2 × n × sizeof(T)`, scaled inside a payload scope |
//!
//! Compute the back-end cannot see (the caller's experts) is charged through `charge_flops`, scaled
//! by `flop_scale`, at the efficiency of GEMMs of the rows it is given (large ones by default). Use it on the ranks of a `simgrid_world` only (it needs a running actor).

#include <moecomm/backend/host.hpp>
#include <moecomm/config.hpp>
#include <moecomm/core/simulation_hooks.hpp>
#include <moecomm/error.hpp>
#include <moecomm/simulation/actor_lane.hpp>
#include <moecomm/simulation/device_time.hpp>

#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

MOECOMM_NAMESPACE_BEGIN

namespace detail {
template <class Kernel, class = void>
struct declares_row_bytes : std::false_type {};
template <class Kernel>
struct declares_row_bytes<Kernel, std::void_t<decltype(std::declval<Kernel const&>().bytes_of_row(std::int64_t{}))>> : std::true_type {};
template <class Kernel, class = void>
struct declares_index_bytes : std::false_type {};
template <class Kernel>
struct declares_index_bytes<Kernel, std::void_t<decltype(std::declval<Kernel const&>().bytes_per_index())>> : std::true_type {};
}  // namespace detail

template <class Inner = host_backend>
class simulated_backend {
  static_assert(Inner::is_host_accessible, "moecomm::simulated_backend runs the real work on a host back-end");

 public:
  template <class T>
  using buffer_type = typename Inner::template buffer_type<T>;
  static constexpr bool is_host_accessible = true;
  //! Overlapped work runs on a second actor of the rank (`<moecomm/core/lane.hpp>`).
  using lane_type = actor_lane;

  explicit simulated_backend(Inner inner = Inner{}, simulation_scale scale = {}) : inner_(std::move(inner)), scale_(scale) {
    detail::require(scale.payload > 0 && scale.parameters > 0 && scale.flops > 0, "simulated_backend",
                    "simulation_scale {payload = ", scale.payload, ", parameters = ", scale.parameters, ", flops = ",
                    scale.flops, "} must be positive");
  }

  [[nodiscard]] Inner const& inner() const { return inner_; }

  template <class T>
  [[nodiscard]] buffer_type<T> allocate(std::int64_t n) const {
    return inner_.template allocate<T>(n);
  }

  template <class F>
  void for_each_index(std::int64_t n, F const& f) const {
    inner_.for_each_index(n, f);
    if constexpr (detail::declares_index_bytes<F>::value)  // elements of rows: as many more as a row stands for
      detail::charge_memory(detail::current_payload_scale() * static_cast<double>(n) * static_cast<double>(f.bytes_per_index()));
    else
      detail::charge_memory(8.0 * static_cast<double>(n));
  }

  template <class F>
  void for_each_row(std::int64_t rows, F const& f) const {
    static_assert(detail::declares_row_bytes<F>::value, "a row kernel declares bytes_of_row(r) for the simulated device");
    inner_.for_each_row(rows, f);
    double bytes = 0;  // the host's memory: the kernel's indices are readable here
    for (std::int64_t r = 0; r < rows; ++r) bytes += static_cast<double>(f.bytes_of_row(r));
    detail::charge_memory(scale_.payload * bytes);
  }

  template <class T, class Map, class Op>
  [[nodiscard]] T reduce(std::int64_t n, T init, Map const& map, Op const& op) const {
    T const result = inner_.reduce(n, init, map, op);
    detail::charge_memory(8.0 * static_cast<double>(n));
    return result;
  }

  template <class T, class Map, class Op>
  void reduce_into(T* result, std::int64_t n, T init, Map const& map, Op const& op) const {
    inner_.reduce_into(result, n, init, map, op);
    detail::charge_memory(8.0 * static_cast<double>(n));
  }

  [[nodiscard]] static std::size_t stable_sort_scratch_bytes(std::int64_t n) { return Inner::stable_sort_scratch_bytes(n); }

  void stable_sort_by_key(std::uint32_t const* keys_in, std::uint32_t* keys_out, std::int32_t const* values_in,
                          std::int32_t* values_out, std::int64_t n, int end_bit, void* scratch, std::size_t scratch_bytes) const {
    inner_.stable_sort_by_key(keys_in, keys_out, values_in, values_out, n, end_bit, scratch, scratch_bytes);
    int const passes = end_bit <= 0 ? 1 : (end_bit + 7) / 8;
    detail::charge_memory(16.0 * passes * static_cast<double>(n));
  }

  [[nodiscard]] static std::size_t exclusive_sum_scratch_bytes(std::int64_t n) { return Inner::exclusive_sum_scratch_bytes(n); }

  void exclusive_sum(std::int32_t const* in, std::int32_t* out, std::int64_t n, void* scratch, std::size_t scratch_bytes) const {
    inner_.exclusive_sum(in, out, n, scratch, scratch_bytes);
    detail::charge_memory(8.0 * static_cast<double>(n));
  }

  template <class T>
  void copy(T* dst, T const* src, std::int64_t n) const {
    inner_.copy(dst, src, n);
    detail::charge_memory(detail::current_payload_scale() * 2.0 * static_cast<double>(n) * sizeof(T));
  }

  void synchronize() const { inner_.synchronize(); }

  //! `flops` of the caller's compute (its experts), times `simulated_scale().flops`.
  //! `flops` (scaled) in GEMMs of `rows` rows, whose efficiency the platform's roofline gives.
  void charge_flops(double flops, double rows = std::numeric_limits<double>::infinity()) const {
    detail::charge_flops(scale_.flops * flops, rows);
  }

  //! The scale: what moves, and what the layer's planners price (`detail::simulated_scale`).
  [[nodiscard]] simulation_scale simulated_scale() const { return scale_; }

  //! While the result lives, the calling actor's messages and copies are scaled by `simulated_scale().payload`
  //! (rows) or `.parameters` (see `<moecomm/core/simulation_hooks.hpp>`).
  [[nodiscard]] detail::actor_payload_scope payload_scope(detail::payload_kind kind) const {
    switch (kind) {
      case detail::payload_kind::rows: return detail::actor_payload_scope(scale_.payload);
      case detail::payload_kind::parameters: return detail::actor_payload_scope(scale_.parameters);
      case detail::payload_kind::control: break;
    }
    return detail::actor_payload_scope(1.0);
  }

 private:
  Inner inner_;
  simulation_scale scale_;
};

MOECOMM_NAMESPACE_END
