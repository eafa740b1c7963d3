// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `dedup_node_plan`: the row maps of a per-node deduplicated exchange (`dedup_per_node`, semantics
//! §10a), as two `dedup_plan` hops. Hop 1 sends each token once to each destination node, to the
//! relay there (the rank with this rank's local index), with the global experts of its slots on that
//! node; hop 2 is the relay's `dedup_per_rank` inside its node over the rows it got, whose lists name
//! each row's own source rank, so the experts see plain dispatch's layout. The combine's mirror sums
//! per rank, then per node on the relay, then at the source.

#include <moecomm/config.hpp>
#include <moecomm/core/atomic.hpp>
#include <moecomm/core/buffer.hpp>
#include <moecomm/core/functional.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/core/topology.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/collectives/alltoall.hpp>
#include <moecomm/dispatch/dedup_plan.hpp>
#include <moecomm/rows/permute.hpp>
#include <moecomm/rows/permute_plan.hpp>
#include <moecomm/rows/unpermute.hpp>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! `counts[d]` += the tokens that have a slot on rank d (a row each, had they gone straight there).
struct count_rows_per_rank {
  std::int32_t const* idx;
  dedup_route route;  //!< without relays
  std::int32_t top_k;
  std::int32_t* counts;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t t) const {
    std::int32_t const* ids = idx + t * top_k;
    for (std::int32_t k = 0; k < top_k; ++k) {
      std::int32_t const d = route.destination(ids[k]);
      if (d >= 0 && route.first_slot_to(d, ids) == k) atomic_add(&counts[d], 1);
    }
  }
};

}  // namespace detail

//! `dedup_plan`'s interface, for `dedup_per_node`. Built by the dispatcher's `route`.
template <class Backend>
class dedup_node_plan {
 public:
  //! This rank's side (hop 1's source map): as `dedup_plan::build_source`, the rows going to relays.
  //! Local.
  template <class Comm>
  void build_source(Backend const& be, routing_view const& kept, std::vector<std::int32_t> const& home, std::int32_t num_experts,
                    exchange_groups<Comm>& groups, workspace<Backend>& scratch) {
    use_relays(be, groups);
    to_relay_.build_source(be, kept, home, num_experts, groups.world().size(), scratch);
  }
  //! `build_source` without home experts and without a host wait (`dedup_plan::enqueue_source`).
  //! Besides the rows to each relay (`source_offsets()`), it counts the rows this rank's tokens
  //! would send each rank directly (`direct_rows()`): from every rank's, each relay knows what it
  //! forwards where, so hop 2 needs no count exchange of its own (`take_counts`).
  template <class Comm>
  void enqueue_source(Backend const& be, routing_view const& kept, std::int32_t num_experts, exchange_groups<Comm>& groups,
                      workspace<Backend>& scratch) {
    use_relays(be, groups);
    std::int32_t const ranks = groups.world().size();
    to_relay_.enqueue_source(be, kept, num_experts, ranks, scratch);
    std::int32_t* const direct = grow(be, direct_rows_, ranks).data();
    be.for_each_index(ranks, detail::fill_value<std::int32_t>{direct, 0});
    be.for_each_index(kept.num_tokens, detail::count_rows_per_rank{kept.topk_idx, to_relay_.direct_route(), kept.top_k, direct});
    hop2_from_counts_ = true;
  }
  [[nodiscard]] std::int32_t const* source_offsets() const { return to_relay_.source_offsets(); }
  //! `[R]` device counts of `enqueue_source`: the rows this rank's tokens would send each rank directly.
  [[nodiscard]] std::int32_t const* direct_rows() const { return direct_rows_.data(); }
  template <class Comm>
  void gather_counts(Comm& comm) {
    to_relay_.gather_counts(comm);
  }
  //! Rank s's rows to each relay at `all + s * stride`, and after `enqueue_source` its direct rows
  //! R words later: hop 2's counts follow from them (relay r forwards to rank d of its node the rows
  //! of every rank with r's local index).
  template <class Comm>
  void take_counts(Backend const& be, std::int64_t const* all, std::int64_t stride, exchange_groups<Comm>& groups) {
    topology const& topo = groups.topo();
    std::int32_t const ranks = topo.num_ranks(), me = groups.world().rank();
    to_relay_.take_counts(be, all, stride, me);
    if (!hop2_from_counts_) return;
    hop2_counts_.assign(static_cast<std::size_t>(ranks) * static_cast<std::size_t>(ranks), 0);
    for (std::int32_t s = 0; s < ranks; ++s)
      for (std::int32_t d = 0; d < ranks; ++d) {
        std::int32_t const relay = topo.rank_at(topo.node_of(d), topo.local_of(s));
        hop2_counts_[static_cast<std::size_t>(relay) * ranks + d] += all[s * stride + ranks + d];
      }
  }

  //! Hop 1's lists reach the relays; each relay builds hop 2 over the rows it got (its counts
  //! all-gathered in its node) and hop 2's lists reach the experts' ranks. Collective.
  //! `chunk_rows`: as `dedup_plan::build_receive`'s, for hop 2's receive map (its lists name each
  //! row's own source rank, so the counts are the source ranks' own).
  template <class Comm, class Algorithm>
  void build_receive(Backend const& be, exchange_groups<Comm>& groups, std::int64_t padded_capacity, Algorithm const& algorithm,
                     alltoall_stats& stats, alltoall_workspace<Backend>& exchange_scratch, workspace<Backend>& scratch,
                     std::int64_t const* chunk_rows = nullptr) {
    detail::require_no_padded_home(padded_capacity, to_relay_.has_home());
    routing_view const at_relay = to_relay_.exchange_lists(be, groups, algorithm, stats, exchange_scratch);
    std::int32_t const ranks = groups.world().size(), me = groups.world().rank();
    origin_table_.clear();  // the source rank of each row this relay got: they arrive by source rank
    for (std::int32_t s = 0; s < ranks; ++s) origin_table_.insert(origin_table_.end(), static_cast<std::size_t>(to_relay_.rows_between(s, me)), s);
    std::int64_t const relayed = at_relay.num_tokens;
    be.copy(grow(be, origin_, relayed).data(), origin_table_.data(), relayed);
    if (hop2_from_counts_) {  // hop 2's counts are known: its map is built without a wait
      from_relay_.enqueue_source(be, at_relay, to_relay_.num_experts(), ranks, scratch);
      from_relay_.take_counts(be, hop2_counts_.data(), ranks, me);
      hop2_from_counts_ = false;
    } else {
      from_relay_.build_source(be, at_relay, {}, to_relay_.num_experts(), ranks, scratch);
      from_relay_.gather_counts_in_node(groups);  // hop 2 stays inside the node
    }
    from_relay_.build_receive(be, groups, padded_capacity, algorithm, stats, exchange_scratch, scratch, chunk_rows,
                              origin_.data());
  }

  //! Sizes both hops, the relay's tables and rows for steps of at most `largest`'s slots, rows of
  //! `row_bytes`, and `received_rows` arriving at the experts. Local.
  template <class Comm>
  void reserve(Backend const& be, routing_view const& largest, std::int32_t num_experts, exchange_groups<Comm>& groups,
               std::int64_t received_rows, std::int64_t row_bytes, workspace<Backend>& scratch) {
    topology const& topo = groups.topo();
    std::int32_t const ranks = topo.num_ranks(), top_k = largest.top_k;
    use_relays(be, groups);
    // A relay gets at most one row per token from each node's rank of its local index.
    std::int64_t const relayed = std::int64_t{topo.num_nodes()} * largest.num_tokens;
    to_relay_.reserve(be, largest, num_experts, ranks, relayed, scratch);
    detail::largest_routing<Backend> const at_relay(be, relayed, top_k, num_experts);
    from_relay_.reserve(be, at_relay.view(), num_experts, ranks, received_rows, scratch);
    origin_table_.reserve(static_cast<std::size_t>(relayed));
    hop2_counts_.reserve(static_cast<std::size_t>(ranks) * static_cast<std::size_t>(ranks));
    grow(be, direct_rows_, ranks);
    grow(be, origin_, relayed);
    grow(be, relay_rows_, relayed * row_bytes);
    grow(be, relay_sent_, relayed * std::min(top_k, topo.ranks_per_node()) * row_bytes);
    be.synchronize();  // `at_relay` goes
  }

  //! Hop 1's source map: this rank's tokens -> the rows it sends each relay, then its home rows.
  [[nodiscard]] permute_plan<Backend> const& source() const { return to_relay_.source(); }
  //! Hop 2's receive map: the rows this rank receives -> its local experts' rows.
  [[nodiscard]] permute_plan<Backend> const& receive() const { return from_relay_.receive(); }
  [[nodiscard]] std::int64_t received_rows() const { return from_relay_.received_rows(); }

  //! This rank's source rows -> the relays, which forward them (a copy per destination rank) -> the
  //! experts' ranks (`arrived`, by relay). Collective.
  template <class T, class Comm, class Algorithm>
  void forward_rows(Backend const& be, exchange_groups<Comm>& groups, Algorithm const& algorithm, char const* sent, char* arrived,
                    std::int64_t hidden, alltoall_stats& stats, alltoall_workspace<Backend>& exchange_scratch) {
    auto const [relayed, forwarded] = relay_buffers<T>(be, hidden);
    to_relay_.template forward_rows<T>(be, groups, algorithm, sent, reinterpret_cast<char*>(relayed.data), hidden, stats,
                                       exchange_scratch);
    permute(be, from_relay_.source(), matrix_view<T const>(relayed), forwarded);
    from_relay_.template forward_rows<T>(be, groups, algorithm, reinterpret_cast<char const*>(forwarded.data), arrived, hidden,
                                         stats, exchange_scratch);
  }
  //! The way back: each received row's sum (`sums`) -> the relays, which add a token's rows from
  //! their node in first-slot order and round once -> the source's sent rows (`back`). Collective.
  template <class T, class Comm, class Algorithm>
  void return_rows(Backend const& be, exchange_groups<Comm>& groups, Algorithm const& algorithm, char const* sums, char* back,
                   std::int64_t hidden, alltoall_stats& stats, alltoall_workspace<Backend>& exchange_scratch) {
    auto const [relayed, forwarded] = relay_buffers<T>(be, hidden);
    from_relay_.template return_rows<T>(be, groups, algorithm, sums, reinterpret_cast<char*>(forwarded.data), hidden, stats,
                                        exchange_scratch);
    unpermute<unweighted>(be, from_relay_.source(), matrix_view<T const>(forwarded), relayed);
    to_relay_.template return_rows<T>(be, groups, algorithm, reinterpret_cast<char const*>(relayed.data), back, hidden, stats,
                                      exchange_scratch);
  }

  float* receiver_weight_grads(Backend const& be) { return from_relay_.receiver_weight_grads(be); }
  //! The receivers' dots -> the relays, which gather them per slot of the rows they got -> the
  //! sources. Collective.
  template <class Comm, class Algorithm>
  void return_weight_grads(Backend const& be, exchange_groups<Comm>& groups, Algorithm const& algorithm, alltoall_stats& stats,
                           alltoall_workspace<Backend>& exchange_scratch, float const* home_grads, array_view<float> d_weights) {
    std::int64_t const relayed_slots = from_relay_.source().routing().num_tokens * from_relay_.source().routing().top_k;
    from_relay_.return_weight_grads(be, groups, algorithm, stats, exchange_scratch, nullptr,
                                    array_view<float>{to_relay_.receiver_weight_grads(be), relayed_slots});
    to_relay_.return_weight_grads(be, groups, algorithm, stats, exchange_scratch, home_grads, d_weights);
  }

 private:
  //! Hop 1 goes to the rank of each destination's node with this rank's local index.
  template <class Comm>
  void use_relays(Backend const& be, exchange_groups<Comm>& groups) {
    if (relays_set_) return;
    topology const& topo = groups.topo();
    std::int32_t const me = groups.world().rank();
    std::vector<std::int32_t> relay(static_cast<std::size_t>(topo.num_ranks()));
    for (std::int32_t d = 0; d < topo.num_ranks(); ++d) relay[static_cast<std::size_t>(d)] = topo.rank_at(topo.node_of(d), topo.local_of(me));
    to_relay_.send_to_relays(be, std::move(relay));
    relays_set_ = true;
  }

  //! The relay's rows: those hop 1 brought (or hop 2's sums), and hop 2's copies.
  template <class T>
  std::pair<matrix_view<T>, matrix_view<T>> relay_buffers(Backend const& be, std::int64_t hidden) {
    std::int64_t const relayed = from_relay_.source().routing().num_tokens, forwarded = from_relay_.source().num_rows();
    std::int64_t const row_bytes = hidden * static_cast<std::int64_t>(sizeof(T));
    return {{reinterpret_cast<T*>(grow(be, relay_rows_, relayed * row_bytes).data()), relayed, hidden},
            {reinterpret_cast<T*>(grow(be, relay_sent_, forwarded * row_bytes).data()), forwarded, hidden}};
  }

  dedup_plan<Backend> to_relay_, from_relay_;
  bool relays_set_ = false;
  bool hop2_from_counts_ = false;       //!< `take_counts` gave hop 2's counts (`enqueue_source`)
  std::vector<std::int64_t> hop2_counts_;  //!< [R][R] rows each relay forwards each rank
  typename Backend::template buffer_type<std::int32_t> direct_rows_;
  std::vector<std::int32_t> origin_table_;  //!< [rows this relay got] their source ranks
  typename Backend::template buffer_type<std::int32_t> origin_;
  typename Backend::template buffer_type<char> relay_rows_, relay_sent_;
};

MOECOMM_NAMESPACE_END
