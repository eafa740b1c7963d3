// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `dedup_per_rank<Inner>`: the dispatcher's exchange policy that sends each token once to each
//! rank holding at least one of its experts, and sums a token's expert outputs on that rank before
//! sending one row back (DeepEP's normal kernels; semantics §10a). The bytes move with `Inner`.

#include <moecomm/config.hpp>
#include <moecomm/collectives/alltoall/alltoall_workspace.hpp>
#include <moecomm/collectives/alltoall/byte_matrix.hpp>
#include <moecomm/collectives/alltoall/exchange_groups.hpp>
#include <moecomm/collectives/alltoall/flat.hpp>
#include <moecomm/collectives/alltoall/hierarchical_2d.hpp>
#include <moecomm/collectives/alltoall/pairwise.hpp>
#include <moecomm/collectives/alltoall/stats.hpp>

#include <type_traits>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! What the deduplicating policies (`dedup_per_rank`, `dedup_per_node`) do with the bytes: the
//! dispatcher has already made the rows unique, so the exchange is `Inner`'s own.
template <class Inner>
struct dedup_exchange {
  Inner inner{};

  template <class Backend, class Comm>
  void run(Backend const& be, exchange_groups<Comm>& groups, byte_matrix const& m, void const* send, void* recv,
           alltoall_stats& stats, alltoall_workspace<Backend>& scratch) const {
    inner.run(be, groups, m, send, recv, stats, scratch);
  }
};

}  // namespace detail

//! One row per (token, destination rank) instead of one per (token, expert) slot. `Inner` is the
//! all-to-all that moves the rows: `flat`, `hierarchical_2d` or `pairwise` (the smart schedule
//! pipelines slot rows and is not an inner algorithm).
template <class Inner = flat>
struct dedup_per_rank : detail::dedup_exchange<Inner> {
  static_assert(std::is_same_v<Inner, flat> || std::is_same_v<Inner, hierarchical_2d> || std::is_same_v<Inner, pairwise>,
                "moecomm::dedup_per_rank<Inner>: Inner must be flat, hierarchical_2d or pairwise");
  static constexpr char const* name = "dedup_per_rank";
};

namespace detail {
template <class Algorithm>
struct is_dedup : std::false_type {};
template <class Inner>
struct is_dedup<dedup_per_rank<Inner>> : std::true_type {};
template <class Algorithm>
inline constexpr bool is_dedup_v = is_dedup<Algorithm>::value;
}  // namespace detail

MOECOMM_NAMESPACE_END
