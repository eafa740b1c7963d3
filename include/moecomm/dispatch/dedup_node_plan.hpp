// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `dedup_node_plan`: the row maps of a per-node deduplicated exchange (`dedup_per_node`, semantics
//! §10a), as two `dedup_plan` hops. Hop 1 sends each token once to each destination node, to the
//! relay there (the rank with this rank's local index), with the global experts of its slots on that
//! node; hop 2 is the relay's `dedup_per_rank` inside its node over the rows it got, whose lists name
//! each row's own source rank, so the experts see plain dispatch's layout. The combine's mirror sums
//! per rank, then per node on the relay, then at the source.
//!
//! The hops overlap (DeepEP's internode pipeline): the rows each rank sends each relay are cut into
//! `pieces` (`detail::piece_cut`: every `pieces` consecutive rows fill each piece once), and one
//! grouped exchange carries piece j's first hop together with piece j − 1's second (the relay
//! forwards a piece while the next crosses between nodes); the way back mirrors it. Every piece
//! carries its share of every link's rows on both hops, whatever the routing's order: token ranges
//! would not (a routing whose first tokens go to one node, or to one replica of an expert, as a
//! replicated layer's contiguous shares make, would load a few links per piece). The rows each rank
//! sends each relay ride on the count all-gather (with home experts, on an all-gather of their own),
//! with the rows each relay forwards each rank per piece, so every piece's sizes are known on every
//! rank before a row moves. A relay keeps what it got piece-major (piece j of every source before
//! piece j + 1), so that each piece it forwards is one contiguous block per destination rank; the
//! slot lists carry each row's source token, by which the experts' ranks put each source's rows
//! back in token order.

#include <moecomm/config.hpp>
#include <moecomm/core/atomic.hpp>
#include <moecomm/core/buffer.hpp>
#include <moecomm/core/functional.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/core/topology.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/collectives/alltoall.hpp>
#include <moecomm/collectives/alltoall/stats.hpp>
#include <moecomm/comm/communicator.hpp>
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

//! `counts[j * R + d]` += the rows rank d gets from the relay of its node in piece j: one per token
//! with a slot on d whose row to that relay is in piece j of the block this rank sends the relay
//! (`row_of` and `offsets` of hop 1's source map).
struct count_forwarded_rows_per_piece {
  std::int32_t const* idx;
  dedup_route to_relay, direct;
  std::int32_t const* row_of;
  std::int32_t const* offsets;
  std::int32_t top_k, pieces, ranks;
  std::int32_t* counts;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t t) const {
    std::int32_t const* ids = idx + t * top_k;
    for (std::int32_t k = 0; k < top_k; ++k) {
      std::int32_t const d = direct.destination(ids[k]);
      if (d < 0 || direct.first_slot_to(d, ids) != k) continue;
      std::int32_t const relay = to_relay.destination(ids[k]);
      std::int64_t const row = row_of[t * top_k + to_relay.first_slot_to(relay, ids)];
      std::int32_t const j = piece_cut{offsets[relay + 1] - offsets[relay], pieces}.piece_at(row - offsets[relay]);
      atomic_add(&counts[j * ranks + d], 1);
    }
  }
};

//! `to[i] = from[i]`, int32 counts widened for an int64 all-gather row.
struct widen_counts {
  std::int32_t const* from;
  std::int64_t* to;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const { to[i] = from[i]; }
};

//! `to[i] = from[order[i]]` (or, `scatter`, `to[order[i]] = from[i]`), rows of `width` elements.
template <class T>
struct move_rows_by_index {
  T const* from;
  std::int32_t const* order;
  std::int32_t width;
  bool scatter;
  T* to;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    std::int64_t const a = scatter ? i : order[i], b = scatter ? order[i] : i;
    for (std::int32_t w = 0; w < width; ++w) to[b * width + w] = from[a * width + w];
  }
};

//! One hop's rows per (piece, peer), both ways, and where each block lies: `out` in the forward
//! sender's buffer (peer-major: a block per peer, its pieces in order), `in` in the forward
//! receiver's (peer-major, or piece-major on a relay). Host tables, `[pieces][R]`.
struct piece_hop {
  std::vector<std::int64_t> out_rows, out_at, in_rows, in_at;

  void clear(std::size_t cells) {
    for (auto* v : {&out_rows, &out_at, &in_rows, &in_at}) v->assign(cells, 0);
  }
  //! The positions, once the rows are in.
  void lay_out(std::int32_t pieces, std::int32_t ranks, bool in_piece_major) {
    std::int64_t out = 0, in = 0;
    for (std::int32_t p = 0; p < ranks; ++p)
      for (std::int32_t j = 0; j < pieces; ++j) {
        std::size_t const c = cell(j, p, ranks);
        out_at[c] = out;
        out += out_rows[c];
      }
    for (std::int32_t a = 0; a < (in_piece_major ? pieces : ranks); ++a)
      for (std::int32_t b = 0; b < (in_piece_major ? ranks : pieces); ++b) {
        std::size_t const c = in_piece_major ? cell(a, b, ranks) : cell(b, a, ranks);
        in_at[c] = in;
        in += in_rows[c];
      }
  }
  [[nodiscard]] static std::size_t cell(std::int32_t piece, std::int32_t peer, std::int32_t ranks) {
    return static_cast<std::size_t>(piece) * static_cast<std::size_t>(ranks) + static_cast<std::size_t>(peer);
  }
};

}  // namespace detail

//! `dedup_plan`'s interface, for `dedup_per_node`. Built by the dispatcher's `route`.
template <class Backend>
class dedup_node_plan {
 public:
  //! Cuts the rows each rank sends each relay into `pieces` whose hops overlap (1: store-and-forward). Before
  //! `reserve`, the same on every rank. On one node the first hop is a copy to itself and nothing
  //! overlaps: one piece.
  void cut_into(std::int32_t pieces, topology const& topo) {
    pieces_ = topo.num_nodes() > 1 ? pieces : 1;
    if (pieces_ == 1) return;
    to_relay_.cut_blocks_into(pieces_);
    to_relay_.carry_source_tokens();
    from_relay_.carry_source_tokens();
  }

  //! This rank's side (hop 1's source map) with home experts: as `dedup_plan::build_source`, the
  //! rows going to relays, and per piece the rows the relays forward each rank (`piece_rows()`);
  //! then `gather_counts`. Local.
  template <class Comm>
  void build_source(Backend const& be, routing_view const& kept, std::vector<std::int32_t> const& home, std::int32_t num_experts,
                    exchange_groups<Comm>& groups, workspace<Backend>& scratch) {
    use_relays(be, groups);
    to_relay_.build_source(be, kept, home, num_experts, groups.world().size(), scratch);
    count_pieces(be, kept, groups.world().size());
  }
  //! `build_source` without home experts and without a host wait (`dedup_plan::enqueue_source`):
  //! the rows to each relay (`source_offsets()`) and `piece_rows()` ride on the caller's count
  //! all-gather, from which every relay knows what it forwards where, piece by piece, so hop 2 needs
  //! no count exchange of its own (`take_counts`).
  template <class Comm>
  void enqueue_source(Backend const& be, routing_view const& kept, std::int32_t num_experts, exchange_groups<Comm>& groups,
                      workspace<Backend>& scratch) {
    use_relays(be, groups);
    to_relay_.enqueue_source(be, kept, num_experts, groups.world().size(), scratch);
    count_pieces(be, kept, groups.world().size());
  }
  [[nodiscard]] std::int32_t const* source_offsets() const { return to_relay_.source_offsets(); }
  //! `[pieces][R]` device counts: the rows of this rank's tokens that the relays forward each rank
  //! in each piece.
  [[nodiscard]] std::int32_t const* piece_rows() const { return piece_rows_.data(); }
  [[nodiscard]] std::int64_t piece_words(std::int32_t ranks) const { return std::int64_t{pieces_} * ranks; }
  //! The rows this rank sends `relay` in piece j's first hop, and, as a relay, forwards rank `d` in
  //! piece j's second (once the counts are known: 0 before).
  [[nodiscard]] std::int64_t rows_to_relay(std::int32_t j, std::int32_t relay) const { return piece_rows_of(hop1_, j, relay); }
  [[nodiscard]] std::int64_t rows_forwarded(std::int32_t j, std::int32_t d) const { return piece_rows_of(hop2_, j, d); }
  //! After `build_source`: every rank learns every rank's rows to each relay and `piece_rows()` (one
  //! all-gather), and so both hops' sizes (`take_counts`). Collective.
  template <class Comm>
  void gather_counts(Backend const& be, exchange_groups<Comm>& groups) {
    std::int32_t const ranks = groups.world().size();
    std::int64_t const words = piece_words(ranks), width = ranks + words;
    std::int64_t* const row = grow(be, count_row_, width).data();
    be.copy(row, to_relay_.sent_counts().data(), ranks);  // from pageable memory: read when the copy is enqueued
    be.for_each_index(words, detail::widen_counts{piece_rows_.data(), row + ranks});
    gathered_.resize(static_cast<std::size_t>(ranks * width));
    row_staging_.resize(static_cast<std::size_t>(width));
    allgather_to_host(groups.world(), be, row, gathered_.data(), width * static_cast<std::int64_t>(sizeof(std::int64_t)),
                      row_staging_.data());
    take_counts(be, gathered_.data(), width, groups);
  }
  //! Rank s's rows to each relay at `all + s * stride`, and its `piece_rows()` R words later: both
  //! hops' sizes per piece follow from them (relay r forwards to rank d of its node the rows of
  //! every rank with r's local index); a source map from `enqueue_source` is completed.
  template <class Comm>
  void take_counts(Backend const& be, std::int64_t const* all, std::int64_t stride, exchange_groups<Comm>& groups) {
    topology const& topo = groups.topo();
    std::int32_t const ranks = topo.num_ranks(), me = groups.world().rank(), pieces = pieces_;
    to_relay_.take_counts(be, all, stride, me);
    auto const cells = static_cast<std::size_t>(pieces) * static_cast<std::size_t>(ranks);
    hop1_.clear(cells);
    hop2_.clear(cells);
    hop2_counts_.assign(static_cast<std::size_t>(ranks) * static_cast<std::size_t>(ranks), 0);
    for (std::int32_t s = 0; s < ranks; ++s) {
      std::int64_t const* const to_relays = all + s * stride;
      std::int64_t const* const forwarded = to_relays + ranks;
      for (std::int32_t j = 0; j < pieces; ++j)
        for (std::int32_t d = 0; d < ranks; ++d) {
          std::size_t const c = detail::piece_hop::cell(j, d, ranks);
          std::int64_t const in_piece = detail::piece_cut{to_relays[d], pieces}.rows_in(j);
          if (s == me) hop1_.out_rows[c] = in_piece;
          if (d == me) hop1_.in_rows[detail::piece_hop::cell(j, s, ranks)] = in_piece;
          std::int32_t const relay = topo.rank_at(topo.node_of(d), topo.local_of(s));
          hop2_counts_[static_cast<std::size_t>(relay) * ranks + d] += forwarded[c];
          if (relay == me) hop2_.out_rows[c] += forwarded[c];
          if (d == me) hop2_.in_rows[detail::piece_hop::cell(j, relay, ranks)] += forwarded[c];
        }
    }
    hop1_.lay_out(pieces, ranks, true);
    hop2_.lay_out(pieces, ranks, false);
  }

  //! Hop 1's lists reach the relays; each relay builds hop 2 over the rows it got, piece-major (its
  //! counts known from `take_counts`, no wait), and hop 2's lists reach the experts' ranks.
  //! Collective.
  //! `chunk_rows`: as `dedup_plan::build_receive`'s, for hop 2's receive map (its lists name each
  //! row's own source rank, so the counts are the source ranks' own).
  template <class Comm, class Algorithm>
  void build_receive(Backend const& be, exchange_groups<Comm>& groups, std::int64_t padded_capacity, Algorithm const& algorithm,
                     alltoall_stats& stats, alltoall_workspace<Backend>& exchange_scratch, workspace<Backend>& scratch,
                     std::int64_t const* chunk_rows = nullptr) {
    detail::require_no_padded_home(padded_capacity, to_relay_.has_home());
    std::int32_t const ranks = groups.world().size(), me = groups.world().rank();
    routing_view const at_relay = piece_major(be, to_relay_.exchange_lists(be, groups, algorithm, stats, exchange_scratch), ranks);
    from_relay_.enqueue_source(be, at_relay, to_relay_.num_experts(), ranks, scratch);
    from_relay_.take_counts(be, hop2_counts_.data(), ranks, me);
    from_relay_.build_receive(be, groups, padded_capacity, algorithm, stats, exchange_scratch, scratch, chunk_rows, origin_.data(),
                              pieces_ > 1 ? relay_tokens_.data() : nullptr);
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
    auto const cells = static_cast<std::size_t>(pieces_) * static_cast<std::size_t>(ranks);
    for (detail::piece_hop* hop : {&hop1_, &hop2_}) hop->clear(cells);
    origin_table_.reserve(static_cast<std::size_t>(relayed));
    order_table_.reserve(static_cast<std::size_t>(relayed));
    hop2_counts_.reserve(static_cast<std::size_t>(ranks) * static_cast<std::size_t>(ranks));
    grow(be, piece_rows_, piece_words(ranks));
    std::int64_t const width = ranks + piece_words(ranks);
    grow(be, count_row_, width);
    gathered_.reserve(static_cast<std::size_t>(ranks * width));
    row_staging_.reserve(static_cast<std::size_t>(width));
    grow(be, origin_, relayed);
    grow(be, order_, relayed);
    for (auto* b : {&relay_weights_, &relay_grads_}) grow(be, *b, relayed * top_k);
    grow(be, relay_idx_, relayed * top_k);
    if (pieces_ > 1) grow(be, relay_tokens_, relayed);
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
  //! experts' ranks (`arrived`, by relay): piece j's first hop and piece j − 1's second in one
  //! grouped exchange, the relay's copies of piece j − 1 made before it. Collective.
  template <class T, class Comm, class Algorithm>
  void forward_rows(Backend const& be, exchange_groups<Comm>& groups, Algorithm const& /*algorithm*/, char const* sent, char* arrived,
                    std::int64_t hidden, alltoall_stats& stats, alltoall_workspace<Backend>& exchange_scratch) {
    auto const [relayed, forwarded] = relay_buffers<T>(be, hidden);
    auto* const relay_in = reinterpret_cast<char*>(relayed.data);
    auto* const relay_out = reinterpret_cast<char*>(forwarded.data);
    for (std::int32_t step = 0; step <= pieces_; ++step) {
      if (step > 0) {
        auto const [first, count] = relayed_piece(step - 1, groups.world().size());
        detail::scatter_token_rows(be, from_relay_.source(), matrix_view<T const>(relayed), forwarded, first, count);
      }
      exchange_scratch.clear_messages();
      if (step < pieces_) add_piece(be, groups, hop1_, step, sent, relay_in, relayed.row_bytes(), false, stats, exchange_scratch);
      if (step > 0) add_piece(be, groups, hop2_, step - 1, relay_out, arrived, relayed.row_bytes(), false, stats, exchange_scratch);
      run_piece_exchange(be, groups, stats, exchange_scratch);
    }
  }
  //! The way back: each received row's sum (`sums`) -> the relays, which add a token's rows from
  //! their node in first-slot order and round once -> the source's sent rows (`back`); piece j's
  //! second hop back and piece j − 1's first in one grouped exchange. Collective.
  template <class T, class Comm, class Algorithm>
  void return_rows(Backend const& be, exchange_groups<Comm>& groups, Algorithm const& /*algorithm*/, char const* sums, char* back,
                   std::int64_t hidden, alltoall_stats& stats, alltoall_workspace<Backend>& exchange_scratch) {
    auto const [relayed, forwarded] = relay_buffers<T>(be, hidden);
    auto* const relay_in = reinterpret_cast<char*>(relayed.data);
    auto* const relay_out = reinterpret_cast<char*>(forwarded.data);
    for (std::int32_t step = 0; step <= pieces_; ++step) {
      exchange_scratch.clear_messages();
      if (step < pieces_) add_piece(be, groups, hop2_, step, sums, relay_out, relayed.row_bytes(), true, stats, exchange_scratch);
      if (step > 0) add_piece(be, groups, hop1_, step - 1, relay_in, back, relayed.row_bytes(), true, stats, exchange_scratch);
      run_piece_exchange(be, groups, stats, exchange_scratch);
      if (step < pieces_) {
        auto const [first, count] = relayed_piece(step, groups.world().size());
        detail::combine_token_rows<false>(be, from_relay_.source(), matrix_view<T const>(forwarded), relayed, first, count);
      }
    }
  }

  float* receiver_weight_grads(Backend const& be) { return from_relay_.receiver_weight_grads(be); }
  //! The receivers' dots -> the relays, which gather them per slot of the rows they got (piece-major,
  //! put back by source for hop 1) -> the sources. Collective.
  template <class Comm, class Algorithm>
  void return_weight_grads(Backend const& be, exchange_groups<Comm>& groups, Algorithm const& algorithm, alltoall_stats& stats,
                           alltoall_workspace<Backend>& exchange_scratch, float const* home_grads, array_view<float> d_weights) {
    routing_view const& at_relay = from_relay_.source().routing();
    std::int64_t const relayed_slots = at_relay.num_tokens * at_relay.top_k;
    float* const by_source = to_relay_.receiver_weight_grads(be);
    float* const gathered = pieces_ > 1 ? grow(be, relay_grads_, relayed_slots).data() : by_source;
    from_relay_.return_weight_grads(be, groups, algorithm, stats, exchange_scratch, nullptr, array_view<float>{gathered, relayed_slots});
    if (pieces_ > 1)
      be.for_each_index(at_relay.num_tokens, detail::move_rows_by_index<float>{gathered, order_.data(), at_relay.top_k, true, by_source});
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

  //! `piece_rows()` of `kept`'s tokens, from hop 1's source map (on the device).
  void count_pieces(Backend const& be, routing_view const& kept, std::int32_t ranks) {
    std::int64_t const words = piece_words(ranks);
    std::int32_t* const rows = grow(be, piece_rows_, words).data();
    be.for_each_index(words, detail::fill_value<std::int32_t>{rows, 0});
    permute_plan<Backend> const& source = to_relay_.source();
    be.for_each_index(kept.num_tokens, detail::count_forwarded_rows_per_piece{kept.topk_idx, to_relay_.sent_route(), to_relay_.direct_route(),
                                                                              source.row_of(), source.expert_offsets(), kept.top_k,
                                                                              pieces_, ranks, rows});
  }

  //! The lists a relay got (by source rank) as it keeps its rows: piece-major, piece j of every
  //! source before piece j + 1 (the same order with one piece); each row's source rank, and its
  //! source token (several pieces).
  routing_view piece_major(Backend const& be, routing_view const& by_source, std::int32_t ranks) {
    std::int64_t const relayed = by_source.num_tokens;
    origin_table_.clear();
    for (std::int32_t j = 0; j < pieces_; ++j)
      for (std::int32_t s = 0; s < ranks; ++s)
        origin_table_.insert(origin_table_.end(), static_cast<std::size_t>(hop1_.in_rows[detail::piece_hop::cell(j, s, ranks)]), s);
    be.copy(grow(be, origin_, relayed).data(), origin_table_.data(), relayed);
    if (pieces_ == 1) return by_source;
    order_table_.assign(static_cast<std::size_t>(relayed), 0);
    std::int64_t at = 0;  // by source: each source's pieces in order
    for (std::int32_t s = 0; s < ranks; ++s)
      for (std::int32_t j = 0; j < pieces_; ++j) {
        std::size_t const c = detail::piece_hop::cell(j, s, ranks);
        for (std::int64_t r = 0; r < hop1_.in_rows[c]; ++r)
          order_table_[static_cast<std::size_t>(hop1_.in_at[c] + r)] = static_cast<std::int32_t>(at++);
      }
    be.copy(grow(be, order_, relayed).data(), order_table_.data(), relayed);
    std::int32_t const top_k = by_source.top_k;
    std::int32_t* const idx = grow(be, relay_idx_, relayed * top_k).data();
    float* const weights = grow(be, relay_weights_, relayed * top_k).data();
    be.for_each_index(relayed, detail::move_rows_by_index<std::int32_t>{by_source.topk_idx, order_.data(), top_k, false, idx});
    be.for_each_index(relayed, detail::move_rows_by_index<float>{by_source.topk_weights, order_.data(), top_k, false, weights});
    be.for_each_index(relayed, detail::move_rows_by_index<std::int32_t>{to_relay_.received_source_tokens(), order_.data(), 1, false,
                                                                        grow(be, relay_tokens_, relayed).data()});
    return {idx, weights, relayed, top_k};
  }

  //! The relay's rows of piece j: `[first, first + count)` of what it got.
  [[nodiscard]] std::pair<std::int64_t, std::int64_t> relayed_piece(std::int32_t j, std::int32_t ranks) const {
    std::int64_t count = 0;
    for (std::int32_t s = 0; s < ranks; ++s) count += hop1_.in_rows[detail::piece_hop::cell(j, s, ranks)];
    return {hop1_.in_at[detail::piece_hop::cell(j, 0, ranks)], count};
  }

  [[nodiscard]] std::int64_t piece_rows_of(detail::piece_hop const& hop, std::int32_t j, std::int32_t peer) const {
    auto const ranks = static_cast<std::int32_t>(hop.out_rows.size() / static_cast<std::size_t>(pieces_));
    if (j < 0 || j >= pieces_ || peer < 0 || peer >= ranks) return 0;
    return hop.out_rows[detail::piece_hop::cell(j, peer, ranks)];
  }

  //! Piece j of `hop` joins the step's messages: forward, `from` is the sender's buffer and `to` the
  //! receiver's; `back`, the other way (`from` the receiver's, `to` the sender's). The block to itself
  //! is a copy.
  template <class Comm>
  void add_piece(Backend const& be, exchange_groups<Comm>& groups, detail::piece_hop const& hop, std::int32_t j, char const* from,
                 char* to, std::int64_t row_bytes, bool back, alltoall_stats& stats, alltoall_workspace<Backend>& scratch) const {
    std::int32_t const ranks = groups.world().size(), me = groups.world().rank();
    std::vector<std::int64_t> const& send_rows = back ? hop.in_rows : hop.out_rows;
    std::vector<std::int64_t> const& send_at = back ? hop.in_at : hop.out_at;
    std::vector<std::int64_t> const& recv_rows = back ? hop.out_rows : hop.in_rows;
    std::vector<std::int64_t> const& recv_at = back ? hop.out_at : hop.in_at;
    for (std::int32_t p = 0; p < ranks; ++p) {
      std::size_t const c = detail::piece_hop::cell(j, p, ranks);
      char const* const send = from + send_at[c] * row_bytes;
      char* const recv = to + recv_at[c] * row_bytes;
      if (p == me) {
        be.copy(recv, send, send_rows[c] * row_bytes);
        continue;
      }
      if (send_rows[c] > 0) scratch.sends.push_back({p, send, send_rows[c] * row_bytes});
      if (recv_rows[c] > 0) scratch.recvs.push_back({p, recv, recv_rows[c] * row_bytes});
      stats.record(groups.topo(), me, p, send_rows[c] * row_bytes);
    }
  }
  //! One grouped exchange of the step's messages: a hop between nodes and one inside them have no
  //! peer in common, so each peer has one block each way.
  template <class Comm>
  static void run_piece_exchange(Backend const& be, exchange_groups<Comm>& groups, alltoall_stats& stats,
                                 alltoall_workspace<Backend>& scratch) {
    detail::require_one_stream(be, groups.world(), "dedup_per_node");
    detail::exchange_in_stream_order(groups.world(), scratch.sends, scratch.recvs);
    stats.rounds += 1;
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
  std::int32_t pieces_ = 1;  //!< `cut_into`'s
  bool relays_set_ = false;
  detail::piece_hop hop1_, hop2_;  //!< this rank's rows per piece and peer, and where they lie
  std::vector<std::int64_t> hop2_counts_;  //!< [R][R] rows each relay forwards each rank
  typename Backend::template buffer_type<std::int32_t> piece_rows_;
  typename Backend::template buffer_type<std::int64_t> count_row_;  //!< `gather_counts`' row
  std::vector<std::int64_t> gathered_, row_staging_;                //!< its all-gather, and its staging
  std::vector<std::int32_t> origin_table_;  //!< [rows this relay got] their source ranks, piece-major
  std::vector<std::int32_t> order_table_;   //!< [rows this relay got] piece-major -> by-source row
  typename Backend::template buffer_type<std::int32_t> origin_, order_, relay_idx_, relay_tokens_;  //!< relay_tokens_: source tokens, piece-major
  typename Backend::template buffer_type<float> relay_weights_, relay_grads_;
  typename Backend::template buffer_type<char> relay_rows_, relay_sent_;
};

MOECOMM_NAMESPACE_END
