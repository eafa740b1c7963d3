// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `dedup_plan`: the two row maps of a deduplicated exchange (`dedup_per_rank`, semantics §10a).
//! The source map sends each token row once to each destination rank that holds one of its sent
//! slots (and lays out the home experts' rows after them, as the plain plan does); the receive map
//! spreads each arrived row over its local slots, in the layout plain dispatch gives the experts.
//! Both are ordinary `permute_plan`s, so permute, unpermute and their backward passes move the
//! rows, each row read once.

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/buffer.hpp>
#include <moecomm/core/functional.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/core/topology.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/error.hpp>
#include <moecomm/collectives/alltoall.hpp>
#include <moecomm/rows/permute_plan.hpp>
#include <moecomm/rows/validate_routing.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! Where this rank's deduplicated exchange sends slot rows: a kept, valid slot whose expert is not
//! home here goes to its expert's rank, or to that rank's relay (per-node deduplication: the rank
//! of the expert's node with this rank's local index, which forwards it inside the node).
struct dedup_route {
  std::int32_t const* home_index;  //!< [E] the expert's index among this rank's home experts, or -1
  std::int32_t const* relay;       //!< [R] the rank that takes the rows bound for rank d, or null: d itself
  std::int32_t num_experts, local_experts;

  [[nodiscard]] MOECOMM_HOST_DEVICE bool is_home(std::int32_t e) const {
    return is_valid_expert(e, num_experts) && home_index[e] >= 0;
  }
  //! The rank slot id `e`'s row is sent to, or -1 when it is not sent (a masked, dropped or invalid
  //! slot, or a home expert, computed where its token is).
  [[nodiscard]] MOECOMM_HOST_DEVICE std::int32_t destination(std::int32_t e) const {
    if (!is_valid_expert(e, num_experts) || home_index[e] >= 0) return -1;
    std::int32_t const d = e / local_experts;
    return relay != nullptr ? relay[d] : d;
  }
  //! The first slot of a token's `ids` sent to rank `d` (`d` is the destination of some slot).
  [[nodiscard]] MOECOMM_HOST_DEVICE std::int32_t first_slot_to(std::int32_t d, std::int32_t const* ids) const {
    std::int32_t k = 0;
    while (destination(ids[k]) != d) ++k;
    return k;
  }
};

//! The source routing of token t: its first slot to each destination rank d names d (weight 1: the
//! row returns summed), a home slot names `R + ` its home expert's index (its own weight), every
//! other slot -1. Its plan's blocks are the rows for rank 0, 1, ..., then the home experts' rows.
struct dedup_source_slots {
  std::int32_t const* idx;
  float const* weights;  //!< may be null (an unweighted combine)
  dedup_route route;
  std::int32_t ranks, top_k;
  std::int32_t* source_idx;
  float* source_weights;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t t) const {
    std::int32_t const* ids = idx + t * top_k;
    for (std::int32_t k = 0; k < top_k; ++k) {
      std::int64_t const slot = t * top_k + k;
      std::int32_t const e = ids[k], d = route.destination(e);
      bool const home = route.is_home(e);
      source_idx[slot] = home ? ranks + route.home_index[e] : (d >= 0 && route.first_slot_to(d, ids) == k ? d : -1);
      source_weights[slot] = home ? (weights != nullptr ? weights[slot] : 0.0f) : 1.0f;
    }
  }
};

//! The rows of a block cut into `pieces` for overlapped hops (`dedup_node_plan`): row i of the block
//! (in token order) is in piece (the base-`pieces` digit sum of i) mod `pieces`. Every `pieces`
//! consecutive rows fill each piece once, so the pieces differ by at most a row whatever the
//! routing, and rows that take turns between destinations (replicas that alternate) still spread
//! over every piece, as rows in runs (a replicated layer's contiguous shares) do. Laid out, the
//! block holds its pieces one after the other, each in token order.
struct piece_cut {
  std::int64_t rows;
  std::int32_t pieces;

  [[nodiscard]] MOECOMM_HOST_DEVICE std::int32_t piece_of(std::int64_t i) const {
    std::int64_t sum = 0;
    for (; pieces > 1 && i > 0; i /= pieces) sum = (sum + i % pieces) % pieces;
    return static_cast<std::int32_t>(sum);
  }
  //! Piece j's rows: one per round of `pieces` rows, and one of the last, partial round's.
  [[nodiscard]] MOECOMM_HOST_DEVICE std::int64_t rows_in(std::int32_t j) const {
    std::int64_t const rounds = rows / pieces, rest = rows % pieces;
    std::int32_t const first = piece_of(rounds * pieces);  // the partial round's pieces follow it
    return rounds + ((j - first + pieces) % pieces < rest ? 1 : 0);
  }
  [[nodiscard]] MOECOMM_HOST_DEVICE std::int64_t start(std::int32_t j) const {
    std::int64_t at = 0;
    for (std::int32_t p = 0; p < j; ++p) at += rows_in(p);
    return at;
  }
  //! Where row i lies once the block is laid out.
  [[nodiscard]] MOECOMM_HOST_DEVICE std::int64_t position(std::int64_t i) const { return start(piece_of(i)) + i / pieces; }
  //! The piece of the laid-out block's row at `position`.
  [[nodiscard]] MOECOMM_HOST_DEVICE std::int32_t piece_at(std::int64_t position) const {
    std::int32_t j = 0;
    for (std::int64_t end = rows_in(0); end <= position; end += rows_in(++j)) {}
    return j;
  }
};

//! `new_row[r]`: where row r of a source map goes when each of its first `blocks` blocks is laid
//! out in pieces (`piece_cut`); the rows after them stay.
struct lay_out_in_pieces {
  std::int32_t const* offsets;  //!< `[blocks + 1]`
  std::int32_t blocks, pieces;
  std::int32_t* new_row;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t r) const {
    if (r >= offsets[blocks]) {
      new_row[r] = static_cast<std::int32_t>(r);
      return;
    }
    std::int32_t const b = block_holding(offsets, blocks, r);
    new_row[r] = static_cast<std::int32_t>(offsets[b] + piece_cut{offsets[b + 1] - offsets[b], pieces}.position(r - offsets[b]));
  }
};

//! The slot list that travels with source row r (token t to rank d): for each slot k of t that goes
//! to d, the receive id `l * R + s` (local expert l of d, the token's source rank s: `origin_of[t]`,
//! or this rank) or, to a relay, the global expert id (the relay routes it on); -1 for every other
//! slot. With it, the slot's weight (0 when it does not go to d). Row r's list is `top_k` ids, `top_k`
//! weights and, when the lists carry source tokens, the token's index at its source rank
//! (`source_token_of[t]`, or t).
struct dedup_slot_lists {
  std::int32_t const* idx;
  float const* weights;  //!< may be null
  dedup_route route;
  std::int32_t const* token_of;
  std::int32_t const* slot_of;
  std::int32_t const* source_idx;
  std::int32_t const* origin_of;        //!< [tokens] the rank each token came from (a relay's), or null: this rank
  std::int32_t const* source_token_of;  //!< [tokens] its index there, or null: t
  std::int32_t ranks, top_k, me;
  std::int64_t list_bytes;
  bool with_source_token;
  char* lists;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t r) const {
    std::int64_t const t = token_of[r];
    std::int32_t const d = source_idx[t * top_k + slot_of[r]];
    std::int32_t const origin = origin_of != nullptr ? origin_of[t] : me;
    auto* const ids = reinterpret_cast<std::int32_t*>(lists + r * list_bytes);
    auto* const w = reinterpret_cast<float*>(ids + top_k);
    for (std::int32_t k = 0; k < top_k; ++k) {
      std::int32_t const e = idx[t * top_k + k];
      bool const here = route.destination(e) == d;
      ids[k] = !here ? -1 : route.relay != nullptr ? e : (e - d * route.local_experts) * ranks + origin;
      w[k] = here && weights != nullptr ? weights[t * top_k + k] : 0.0f;
    }
    if (with_source_token) ids[2 * top_k] = source_token_of != nullptr ? source_token_of[t] : static_cast<std::int32_t>(t);
  }
};

//! The arrived slot lists as a routing: `idx[i][k]`, `weights[i][k]`, and `source_token[i]` when
//! they carry it (else null).
struct split_slot_lists {
  char const* lists;
  std::int32_t top_k;
  std::int64_t list_bytes;
  std::int32_t* idx;
  float* weights;
  std::int32_t* source_token;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    auto const* ids = reinterpret_cast<std::int32_t const*>(lists + i * list_bytes);
    auto const* w = reinterpret_cast<float const*>(ids + top_k);
    for (std::int32_t k = 0; k < top_k; ++k) {
      idx[i * top_k + k] = ids[k];
      weights[i * top_k + k] = w[k];
    }
    if (source_token != nullptr) source_token[i] = ids[2 * top_k];
  }
};

//! Sort input for ordering arrived rows by their source token: `keys[i]` = the token, `values[i]` = i.
struct source_token_sort_input {
  std::int32_t const* source_token;
  std::uint32_t* keys;
  std::int32_t* values;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    keys[i] = static_cast<std::uint32_t>(source_token[i]);
    values[i] = static_cast<std::int32_t>(i);
  }
};

//! The weight gradient of slot (t, k): from the receiver's list of the row that carried it, from
//! the source's own dot for a home slot, 0 for a slot without a row.
struct gather_dedup_weight_grads {
  std::int32_t const* idx;
  dedup_route route;
  std::int32_t const* source_row_of;
  float const* home_grads;      //!< [T][K] the source plan's dots (valid at home slots); may be null without home slots
  float const* returned_grads;  //!< [sent rows][K] the receivers' dots
  std::int32_t top_k;
  float* d_weights;
  MOECOMM_HOST_DEVICE void operator()(std::int64_t slot) const {
    std::int64_t const t = slot / top_k;
    std::int32_t const e = idx[slot];
    std::int32_t const d = route.destination(e);
    if (d < 0) {
      d_weights[slot] = route.is_home(e) ? home_grads[slot] : 0.0f;
      return;
    }
    std::int32_t const first = route.first_slot_to(d, idx + t * top_k);
    d_weights[slot] = returned_grads[static_cast<std::int64_t>(source_row_of[t * top_k + first]) * top_k + slot % top_k];
  }
};

//! Padding a home expert's block has no destination: refused by name.
inline void require_no_padded_home(std::int64_t padded_capacity, bool has_home) {
  require(padded_capacity == 0 || !has_home, "dispatcher::route",
          "a deduplicated exchange with pad_to_capacity and home experts is not supported (the home experts' padding "
          "rows have no destination)");
}

}  // namespace detail

//! The row maps of one routing decision's deduplicated exchange, rebuilt in place each step (its
//! buffers only grow). Built by the dispatcher's `route` when its exchange is `dedup_per_rank`; two
//! of them, one per hop, make `dedup_node_plan`.
template <class Backend>
class dedup_plan {
 public:
  //! Sends rows bound for rank d to `relay[d]` instead, with lists of global expert ids (the first
  //! hop of `dedup_node_plan`). Set once, before any `build_source`.
  void send_to_relays(Backend const& be, std::vector<std::int32_t> relay) {
    relay_table_ = std::move(relay);
    be.copy(grow(be, relay_, static_cast<std::int64_t>(relay_table_.size())).data(), relay_table_.data(),
            static_cast<std::int64_t>(relay_table_.size()));
  }
  //! Lays the source map's block for each rank out in `pieces` (`detail::piece_cut`), which hops that
  //! overlap send one after the other (`dedup_node_plan`). Set once, before any `build_source`.
  void cut_blocks_into(std::int32_t pieces) { pieces_ = pieces; }
  //! The slot lists carry each row's source token, and the receive map orders each source's rows by
  //! it, in whatever order they arrive (pieces of a relay's rows). Set once, before `reserve`.
  void carry_source_tokens() { with_source_token_ = true; }

  //! This rank's side, for the kept routing `kept` (global expert ids) with `home` (this rank's home
  //! experts, ascending) computed here: the source map and the rows it sends each rank
  //! (`sent_counts()`, which every rank must then learn: `gather_counts` or `take_counts`). Local.
  void build_source(Backend const& be, routing_view const& kept, std::vector<std::int32_t> const& home, std::int32_t num_experts,
                    std::int32_t ranks, workspace<Backend>& scratch) {
    routing_view const source = source_routing(be, kept, home, num_experts, ranks);
    build_permute_plan(be, source, source_blocks(), source_, scratch, unchecked_routing);
    cut_blocks(be, scratch);
    std::int32_t const* offsets = source_.host_expert_offsets().data;
    sent_rows_ = offsets[ranks];
    my_counts_.resize(static_cast<std::size_t>(ranks));
    for (std::int32_t d = 0; d < ranks; ++d) my_counts_[static_cast<std::size_t>(d)] = offsets[d + 1] - offsets[d];
  }

  //! `build_source` without home experts and without a host wait: the source map is built on the
  //! device, and the rows it sends each rank (`[R + 1]` offsets, `source_offsets()`) ride on the
  //! caller's count all-gather, whose result completes it (`take_counts`). Local.
  void enqueue_source(Backend const& be, routing_view const& kept, std::int32_t num_experts, std::int32_t ranks,
                      workspace<Backend>& scratch) {
    routing_view const source = source_routing(be, kept, {}, num_experts, ranks);
    detail::enqueue_permute_plan(be, source, source_blocks(), source_, scratch, unchecked_routing, grow(be, status_, 2).data());
    cut_blocks(be, scratch);
    source_pending_ = true;
  }
  //! The same over `groups`' ranks (`dedup_node_plan`'s form).
  template <class Comm>
  void enqueue_source(Backend const& be, routing_view const& kept, std::int32_t num_experts, exchange_groups<Comm>& groups,
                      workspace<Backend>& scratch) {
    enqueue_source(be, kept, num_experts, groups.world().size(), scratch);
  }
  //! Where each slot's row goes (to a relay, when set), after a `build_source`.
  [[nodiscard]] detail::dedup_route sent_route() const { return route(); }
  //! Where each slot's row would go without relays, over the same home experts (after a `build_source`).
  [[nodiscard]] detail::dedup_route direct_route() const {
    return {home_index_.data(), nullptr, num_experts(), local_experts()};
  }
  //! `[R + 1]` device offsets of the rows this rank sends each rank (the source map's first blocks).
  [[nodiscard]] std::int32_t const* source_offsets() const { return source_.expert_offsets(); }

  //! The same over `groups`' ranks (`dedup_node_plan`'s form).
  template <class Comm>
  void build_source(Backend const& be, routing_view const& kept, std::vector<std::int32_t> const& home, std::int32_t num_experts,
                    exchange_groups<Comm>& groups, workspace<Backend>& scratch) {
    build_source(be, kept, home, num_experts, groups.world().size(), scratch);
  }

  //! `[R]` rows this rank sends each rank (after `build_source`).
  [[nodiscard]] std::vector<std::int64_t> const& sent_counts() const { return my_counts_; }
  //! Every rank learns every rank's `sent_counts()`: one all-gather. Collective.
  template <class Comm>
  void gather_counts(Backend const& /*be*/, exchange_groups<Comm>& groups) {
    counts_.resize(my_counts_.size() * my_counts_.size());
    allgather_host(groups.world(), my_counts_.data(), counts_.data(), static_cast<std::int64_t>(my_counts_.size() * sizeof(std::int64_t)));
  }
  //! The same from a gather the caller made: rank s's counts at `all + s * stride`; a source map
  //! from `enqueue_source` is completed from rank `me`'s.
  void take_counts(Backend const& be, std::int64_t const* all, std::int64_t stride, std::int32_t me) {
    auto const ranks = static_cast<std::size_t>(ranks_);
    if (source_pending_) {
      my_counts_.assign(all + me * stride, all + me * stride + ranks);
      block_counts_.assign(static_cast<std::size_t>(source_blocks()), 0);  // no home experts: blocks past R are empty
      std::copy(my_counts_.begin(), my_counts_.end(), block_counts_.begin());
      detail::complete_permute_plan(be, source_, block_counts_.data(), -1, 0);
      sent_rows_ = source_.num_rows();
      source_pending_ = false;
    }
    counts_.resize(ranks * ranks);
    for (std::size_t s = 0; s < ranks; ++s) std::copy_n(all + s * stride, ranks, counts_.begin() + static_cast<std::ptrdiff_t>(s * ranks));
  }
  //! The same over `groups`' ranks (`dedup_node_plan`'s form).
  template <class Comm>
  void take_counts(Backend const& be, std::int64_t const* all, std::int64_t stride, exchange_groups<Comm>& groups) {
    take_counts(be, all, stride, groups.world().rank());
  }
  //! Rows rank s sends rank d (after the counts are known).
  [[nodiscard]] std::int64_t rows_between(std::int32_t s, std::int32_t d) const {
    return counts_[static_cast<std::size_t>(s) * my_counts_.size() + static_cast<std::size_t>(d)];
  }
  [[nodiscard]] bool has_home() const { return has_home_; }
  [[nodiscard]] std::int32_t num_experts() const { return static_cast<std::int32_t>(home_table_.size()); }

  //! The slot lists travel (`list_bytes()` per row), once every rank's counts are known; returns the
  //! rows this rank receives (by source rank, each source's in its order) as a routing: their receive
  //! ids (global expert ids from a relay's source) and weights, -1 for the slots they do not carry
  //! (and, lists that carry them, their source tokens: `received_source_tokens()`).
  //! @param origin_of `[tokens]` each source token's own source rank, or null: this rank.
  //! @param source_token_of `[tokens]` its index at that rank, or null: its index here. Collective.
  template <class Comm, class Algorithm>
  routing_view exchange_lists(Backend const& be, exchange_groups<Comm>& groups, Algorithm const& algorithm, alltoall_stats& stats,
                              alltoall_workspace<Backend>& exchange_scratch, std::int32_t const* origin_of = nullptr,
                              std::int32_t const* source_token_of = nullptr) {
    std::int32_t const me = groups.world().rank(), top_k = kept_.top_k;
    received_rows_ = 0;
    for (std::int32_t s = 0; s < ranks_; ++s) received_rows_ += rows_between(s, me);
    std::int64_t const list_bytes = this->list_bytes(top_k);
    char* const lists = grow(be, sent_lists_, sent_rows_ * list_bytes).data();
    be.for_each_index(sent_rows_, detail::dedup_slot_lists{kept_.topk_idx, kept_.topk_weights, route(), source_.token_of(),
                                                           source_.slot_of(), source_idx_.data(), origin_of, source_token_of, ranks_,
                                                           top_k, me, list_bytes, with_source_token_, lists});
    char* const arrived = grow(be, received_lists_, received_rows_ * list_bytes).data();
    byte_matrix const& m = row_matrix(list_bytes, matrix_);
    alltoallv(be, groups, m, array_view<char const>{lists, m.send_total(me)}, array_view<char>{arrived, m.recv_total(me)},
              stats, exchange_scratch, algorithm);
    std::int64_t const received_slots = received_rows_ * top_k;
    routing_view received{grow(be, received_idx_, received_slots).data(), grow(be, received_weights_, received_slots).data(),
                          received_rows_, top_k};
    std::int32_t* const tokens = with_source_token_ ? grow(be, received_tokens_, received_rows_).data() : nullptr;
    be.for_each_index(received_rows_, detail::split_slot_lists{arrived, top_k, list_bytes, received_idx_.data(), received_weights_.data(),
                                                               tokens});
    return received;
  }
  //! After `exchange_lists` of lists that carry source tokens: each arrived row's.
  [[nodiscard]] std::int32_t const* received_source_tokens() const { return received_tokens_.data(); }
  //! Bytes of a row's slot list: `top_k` ids and weights, and its source token when the lists carry it.
  [[nodiscard]] std::int64_t list_bytes(std::int32_t top_k) const { return 8 * std::int64_t{top_k} + (with_source_token_ ? 4 : 0); }

  //! The receiving side: the lists travel (`exchange_lists`) and the receive map spreads the rows
  //! this rank gets over its experts. Collective.
  //! @param padded_capacity C when every (source, expert) chunk is padded to C rows, else 0.
  //! @param chunk_rows `[L][R]` (host), the slots each source rank sends each local expert, as the
  //!        count exchange gave them: unpadded, the receive map takes its sizes from them instead of
  //!        reading them back (the lists were made from validated routings, so they are not
  //!        scanned again); null: the map is built and checked on its own.
  template <class Comm, class Algorithm>
  void build_receive(Backend const& be, exchange_groups<Comm>& groups, std::int64_t padded_capacity, Algorithm const& algorithm,
                     alltoall_stats& stats, alltoall_workspace<Backend>& exchange_scratch, workspace<Backend>& scratch,
                     std::int64_t const* chunk_rows = nullptr, std::int32_t const* origin_of = nullptr,
                     std::int32_t const* source_token_of = nullptr) {
    detail::require_no_padded_home(padded_capacity, has_home_);
    routing_view const received = exchange_lists(be, groups, algorithm, stats, exchange_scratch, origin_of, source_token_of);
    // The receive id l * R + s orders the arrived rows by (expert, source, token, slot), padded per
    // chunk: each source's rows arrive in token order, or are put in it by their source tokens.
    std::int32_t const receive_ids = local_experts() * ranks_;
    std::int32_t const* const order = with_source_token_ ? order_by_source_token(be, scratch) : nullptr;
    if (chunk_rows != nullptr && padded_capacity == 0) {
      detail::enqueue_permute_plan(be, received, receive_ids, receive_, scratch, unchecked_routing, grow(be, status_, 2).data(), order);
      detail::complete_permute_plan(be, receive_, chunk_rows, -1, 0);
    } else {
      detail::build_ordered_permute_plan(be, received, receive_ids, receive_, scratch, routing_checks{}, padded_capacity, order);
    }
  }

  //! Sizes both maps and the lists for steps of at most `largest`'s slots (a routing of the largest
  //! step, every slot valid) and `received_rows` arriving rows, so that building them allocates
  //! nothing. Local.
  void reserve(Backend const& be, routing_view const& largest, std::int32_t num_experts, std::int32_t ranks,
               std::int64_t received_rows, workspace<Backend>& scratch) {
    std::int32_t const top_k = largest.top_k, local_experts = num_experts / ranks;
    home_table_.reserve(static_cast<std::size_t>(num_experts));
    counts_.reserve(static_cast<std::size_t>(ranks) * static_cast<std::size_t>(ranks));
    block_counts_.reserve(static_cast<std::size_t>(std::max(ranks + num_experts, top_k)));
    grow(be, status_, 2);
    std::vector<std::int32_t> every_expert(static_cast<std::size_t>(num_experts));
    for (std::int32_t e = 0; e < num_experts; ++e) every_expert[static_cast<std::size_t>(e)] = e;
    build_source(be, largest, every_expert, num_experts, ranks, scratch);  // the most source blocks a step can have
    std::int64_t const sent = largest.num_tokens * std::min(top_k, ranks);
    grow(be, sent_lists_, sent * list_bytes(top_k));
    grow(be, sent_grads_, sent * top_k);
    grow(be, received_lists_, received_rows * list_bytes(top_k));
    grow(be, received_grads_, received_rows * top_k);
    if (with_source_token_)
      for (auto* b : {&received_tokens_, &arrival_order_}) grow(be, *b, received_rows);
    // The receive map of as many rows, every slot valid: at least the arrays and sort of any step's
    // (a padded one has at most these rows).
    std::int64_t const slots = received_rows * top_k;
    std::vector<std::int32_t> ids(static_cast<std::size_t>(slots));
    for (std::int64_t i = 0; i < slots; ++i) ids[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i % (local_experts * ranks));
    routing_view received{grow(be, received_idx_, slots).data(), grow(be, received_weights_, slots).data(), received_rows, top_k};
    be.copy(received_idx_.data(), ids.data(), slots);
    be.for_each_index(slots, detail::fill_value<float>{received_weights_.data(), 1.0f});
    build_permute_plan(be, received, local_experts * ranks, receive_, scratch, unchecked_routing);
    be.synchronize();  // `ids` goes
  }

  //! The same over `groups`' ranks (`dedup_node_plan`'s form; a row's size does not matter here).
  template <class Comm>
  void reserve(Backend const& be, routing_view const& largest, std::int32_t num_experts, exchange_groups<Comm>& groups,
               std::int64_t received_rows, std::int64_t /*row_bytes*/, workspace<Backend>& scratch) {
    reserve(be, largest, num_experts, groups.world().size(), received_rows, scratch);
  }

  //! This rank's tokens -> the rows it sends rank 0, rank 1, ..., then its home experts' rows.
  [[nodiscard]] permute_plan<Backend> const& source() const { return source_; }
  //! The rows this rank receives (by source rank) -> its local experts' rows, as plain dispatch lays them out.
  [[nodiscard]] permute_plan<Backend> const& receive() const { return receive_; }
  [[nodiscard]] std::int64_t sent_rows() const { return sent_rows_; }
  [[nodiscard]] std::int64_t received_rows() const { return received_rows_; }
  //! Bytes rank s sends rank d, for rows of `row_bytes`, in `m` (its memory kept between steps).
  byte_matrix& row_matrix(std::int64_t row_bytes, byte_matrix& m) const {
    m.assign_zeros(ranks_);
    for (std::int32_t s = 0; s < ranks_; ++s)
      for (std::int32_t d = 0; d < ranks_; ++d) m.add(s, d, rows_between(s, d) * row_bytes);
    return m;
  }

  //! This rank's source rows (`sent`, in source-plan order) -> the rows it receives (`arrived`, by
  //! source rank). Collective.
  template <class T, class Comm, class Algorithm>
  void forward_rows(Backend const& be, exchange_groups<Comm>& groups, Algorithm const& algorithm, char const* sent, char* arrived,
                    std::int64_t hidden, alltoall_stats& stats, alltoall_workspace<Backend>& exchange_scratch) {
    byte_matrix const& m = row_matrix(hidden * static_cast<std::int64_t>(sizeof(T)), matrix_);
    std::int32_t const me = groups.world().rank();
    alltoallv(be, groups, m, array_view<char const>{sent, m.send_total(me)}, array_view<char>{arrived, m.recv_total(me)}, stats,
              exchange_scratch, algorithm);
  }
  //! The way back: a row per received row (`sums`) -> the source's sent rows (`back`). Collective.
  template <class T, class Comm, class Algorithm>
  void return_rows(Backend const& be, exchange_groups<Comm>& groups, Algorithm const& algorithm, char const* sums, char* back,
                   std::int64_t hidden, alltoall_stats& stats, alltoall_workspace<Backend>& exchange_scratch) {
    back_matrix_.assign_transposed(row_matrix(hidden * static_cast<std::int64_t>(sizeof(T)), matrix_));
    std::int32_t const me = groups.world().rank();
    alltoallv(be, groups, back_matrix_, array_view<char const>{sums, back_matrix_.send_total(me)},
              array_view<char>{back, back_matrix_.recv_total(me)}, stats, exchange_scratch, algorithm);
  }

  //! `[received_rows()][K]`: where the receiver puts its dots for the weight gradient.
  float* receiver_weight_grads(Backend const& be) {
    return grow(be, received_grads_, received_rows_ * kept_.top_k).data();
  }
  //! Returns the receivers' dots to their sources and, when `d_weights` is wanted, gathers every
  //! slot's gradient into it (`home_grads`: the source plan's dots, read at home slots). Collective.
  template <class Comm, class Algorithm>
  void return_weight_grads(Backend const& be, exchange_groups<Comm>& groups, Algorithm const& algorithm, alltoall_stats& stats,
                           alltoall_workspace<Backend>& exchange_scratch, float const* home_grads, array_view<float> d_weights) {
    std::int32_t const me = groups.world().rank(), top_k = kept_.top_k;
    float* const returned = grow(be, sent_grads_, sent_rows_ * top_k).data();
    back_matrix_.assign_transposed(row_matrix(4 * std::int64_t{top_k}, matrix_));
    alltoallv(be, groups, back_matrix_,
              array_view<char const>{reinterpret_cast<char const*>(received_grads_.data()), back_matrix_.send_total(me)},
              array_view<char>{reinterpret_cast<char*>(returned), back_matrix_.recv_total(me)}, stats, exchange_scratch, algorithm);
    if (d_weights.data == nullptr) return;
    be.for_each_index(kept_.num_tokens * top_k, detail::gather_dedup_weight_grads{kept_.topk_idx, route(), source_.row_of(),
                                                                                  home_grads, returned, top_k, d_weights.data});
  }

 private:
  [[nodiscard]] std::int32_t local_experts() const { return num_experts() / ranks_; }
  //! A source plan's blocks: one per rank, then the home experts; blocks past them are empty (a
  //! plan has at least K).
  [[nodiscard]] std::int32_t source_blocks() const {
    return std::max(ranks_ + static_cast<std::int32_t>(home_count_), kept_.top_k);
  }

  //! The home table and the source routing of `kept`: one row per (token, destination), then the home rows.
  routing_view source_routing(Backend const& be, routing_view const& kept, std::vector<std::int32_t> const& home,
                              std::int32_t num_experts, std::int32_t ranks) {
    std::int32_t const top_k = kept.top_k;
    std::int64_t const slots = kept.num_tokens * top_k;
    home_table_.assign(static_cast<std::size_t>(num_experts), -1);
    for (std::size_t i = 0; i < home.size(); ++i) home_table_[static_cast<std::size_t>(home[i])] = static_cast<std::int32_t>(i);
    be.copy(grow(be, home_index_, num_experts).data(), home_table_.data(), num_experts);
    kept_ = kept;
    has_home_ = !home.empty();
    home_count_ = home.size();
    ranks_ = ranks;
    source_pending_ = false;
    routing_view source{grow(be, source_idx_, slots).data(), grow(be, source_weights_, slots).data(), kept.num_tokens, top_k};
    be.for_each_index(kept.num_tokens, detail::dedup_source_slots{kept.topk_idx, kept.topk_weights, route(), ranks, top_k,
                                                                  source_idx_.data(), source_weights_.data()});
    return source;
  }
  [[nodiscard]] detail::dedup_route route() const {
    return {home_index_.data(), relay_table_.empty() ? nullptr : relay_.data(), num_experts(), local_experts()};
  }

  //! The source map's blocks for ranks, each laid out in `pieces_` (`cut_blocks_into`).
  void cut_blocks(Backend const& be, workspace<Backend>& scratch) {
    if (pieces_ == 1) return;
    std::int64_t const rows = source_.row_bound();
    std::int32_t* const new_row = grow(be, new_row_, rows).data();
    be.for_each_index(rows, detail::lay_out_in_pieces{source_.expert_offsets(), ranks_, pieces_, new_row});
    detail::move_plan_rows(be, source_, new_row, rows, scratch);
  }
  //! The arrived rows by source token (a stable sort: ties, rows of different sources, keep their
  //! order), as the receive map's token order.
  std::int32_t const* order_by_source_token(Backend const& be, workspace<Backend>& scratch) {
    std::int64_t const n = received_rows_;
    std::size_t const sort_bytes = be.stable_sort_scratch_bytes(n);
    auto* const base = scratch.template get<std::int32_t>(be, 3 * n + static_cast<std::int64_t>(sort_bytes / 4 + 1));
    auto* const keys = reinterpret_cast<std::uint32_t*>(base);
    std::uint32_t* const sorted_keys = keys + n;
    std::int32_t* const arrivals = base + 2 * n;
    std::int32_t* const order = grow(be, arrival_order_, n).data();
    be.for_each_index(n, detail::source_token_sort_input{received_tokens_.data(), keys, arrivals});
    be.stable_sort_by_key(keys, sorted_keys, arrivals, order, n, 31, base + 3 * n, sort_bytes);
    return order;
  }

  template <class T>
  using buffer_t = typename Backend::template buffer_type<T>;
  routing_view kept_{};
  std::int32_t ranks_ = 1;
  std::vector<std::int32_t> home_table_;   //!< [E] home expert index, or -1
  std::vector<std::int32_t> relay_table_;  //!< [R] where rows bound for each rank go, or empty: there
  std::vector<std::int64_t> my_counts_;    //!< [R] rows this rank sends each rank
  std::vector<std::int64_t> counts_;       //!< [R][R] rows each rank sends each rank
  std::vector<std::int64_t> block_counts_;  //!< a pending source map's rows per block
  std::int64_t sent_rows_ = 0, received_rows_ = 0;
  std::size_t home_count_ = 0;
  bool has_home_ = false;
  bool source_pending_ = false;  //!< the source map waits for `take_counts` (`enqueue_source`)
  std::int32_t pieces_ = 1;      //!< `cut_blocks_into`'s
  bool with_source_token_ = false;  //!< `carry_source_tokens`
  buffer_t<std::int32_t> home_index_, relay_, source_idx_, received_idx_;
  buffer_t<std::int32_t> new_row_, received_tokens_, arrival_order_;
  buffer_t<std::int64_t> status_;  //!< the status words of the plans built without a host wait
  buffer_t<float> source_weights_, received_weights_, received_grads_, sent_grads_;
  buffer_t<char> sent_lists_, received_lists_;
  byte_matrix matrix_, back_matrix_;
  permute_plan<Backend> source_, receive_;
};

MOECOMM_NAMESPACE_END
