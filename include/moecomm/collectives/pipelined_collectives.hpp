// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Two collectives on two communicators as one pipeline (Parm's unified collectives, schedule S2):
//! every block is cut into `pieces` row slices (`row_slice`), and while this rank's thread runs the
//! first collective on piece c, the back-end's lane (core/lane.hpp: a thread, or an S4U actor in
//! simulation) runs the second on piece c − 1. With the all-to-all across nodes and the gather
//! inside a node, the two use different links and their times overlap.
//!
//! - `alltoall_allgather`: `out = AllGather_gather(AllToAll_a2a(in))`. Block (g, p) of `out` is
//!   what gather rank g received from all-to-all rank p (Parm's `all_to_all_overlap_all_gather`).
//! - `reduce_scatter_alltoall`, its mirror: gather rank g's block (g, ·) is summed over the gather
//!   group, left to right in ascending gather rank (fp32 for 16-bit rows: bitwise the same on every
//!   transport), and its part p goes back to all-to-all rank p.
//!
//! With `pieces = 1` nothing overlaps: they are the two collectives one after the other (schedule
//! S1). Each piece moves one message per peer and collective, so more pieces mean more latency terms.
//! Over a communicator that enqueues on the back-end's stream (NCCL's) the lane needs no thread:
//! this thread enqueues piece c's second collective on the lane's stream after its first
//! (`cuda_lane::enqueue`, ordered by events), so the device overlaps the two streams, the host waits
//! for nothing, and a CUDA graph capturing the step forks to the lane's stream and joins back. A
//! piece of a gather is packed into one contiguous message and unpacked after it arrives (one device copy per block and piece that holds rows; models/parm_cost_model.hpp
//! prices each copy's launch).
//!
//! Both take `recv_rows` `[G][P]`: the rows gather rank g receives from all-to-all rank p (the same
//! table on every gather rank), and `send_rows` `[P]`: the rows this rank sends all-to-all rank p.
//! The all-to-all groups of the gather ranks must have the same size P. A communicator that runs one
//! collective per thread needs to allow calls from two threads (MPI: `MPI_THREAD_MULTIPLE`).

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/checked_math.hpp>
#include <moecomm/core/lane.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/core/simulation_hooks.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/error.hpp>
#include <moecomm/core/matrix_checks.hpp>
#include <moecomm/collectives/row_collectives.hpp>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! What the pipelined collectives keep between calls: the lane (made once), the lane's own copies
//! of the communicators it uses (split once, on the lane's back-end) and one workspace for each of
//! the two threads of calls.
template <class Backend>
class pipeline_workspace {
 public:
  [[nodiscard]] workspace<Backend>& first() { return first_; }
  [[nodiscard]] workspace<Backend>& second() { return second_; }
  [[nodiscard]] lane_t<Backend>& lane(Backend const& be) {
    if (!lane_) lane_ = std::make_unique<lane_t<Backend>>(be);
    return *lane_;
  }
  //! The lane's copy of `comm` (`split_for`: collective over `comm` the first time).
  template <class Comm>
  [[nodiscard]] Comm& lane_copy(Comm& comm, Backend const& be) {
    for (auto const& [original, copy] : lane_comms_)
      if (original == &comm) return *static_cast<Comm*>(copy.get());
    lane_comms_.emplace_back(&comm, std::make_shared<Comm>(split_for(comm, lane_backend(lane(be), be))));
    return *static_cast<Comm*>(lane_comms_.back().second.get());
  }

 private:
  workspace<Backend> first_, second_;
  std::unique_ptr<lane_t<Backend>> lane_;
  std::vector<std::pair<void const*, std::shared_ptr<void>>> lane_comms_;  //!< (original, its copy)
};

namespace detail {

//! Host tables of a `piece_layout`.
struct piece_tables {
  std::int64_t* block;   //!< `[G * P + 1]`
  std::int64_t* packed;  //!< `[G * W * (P + 1)]`
};

//! Where every piece of every block lies: in the `[g][p]` matrix of blocks (`block`), and in the
//! packed `[g][c][p]` layout where piece c of gather rank g is one contiguous run (`packed`).
class piece_layout {
 public:
  piece_layout(char const* op, array_view<std::int64_t const> recv_rows, std::int32_t gather_ranks, std::int32_t peers,
               std::int32_t pieces, piece_tables tables)
      : recv_(recv_rows), g_(gather_ranks), p_(peers), w_(pieces), block_(tables.block), packed_(tables.packed) {
    require(recv_rows.size == std::int64_t{g_} * p_, op, "argument 'recv_rows' has ", recv_rows.size,
            " entries, gather ranks x all-to-all ranks = ", std::int64_t{g_} * p_);
    block_[0] = 0;
    for (std::int64_t i = 0; i < std::int64_t{g_} * p_; ++i) {
      require(recv_.data[i] >= 0, op, "recv_rows[", i / p_, "][", i % p_, "] = ", recv_.data[i], " is negative");
      block_[i + 1] = checked_add(block_[i], recv_.data[i], op, "the rows of recv_rows");
    }
    std::int64_t at = 0;
    for (std::int32_t g = 0; g < g_; ++g)
      for (std::int32_t c = 0; c < w_; ++c)
        for (std::int32_t p = 0; p <= p_; ++p) {
          packed_[(std::int64_t{g} * w_ + c) * (p_ + 1) + p] = at;
          if (p < p_) at += piece(g, p, c).count;
        }
  }

  //! Rows of all blocks.
  [[nodiscard]] std::int64_t total() const { return block_[std::int64_t{g_} * p_]; }
  //! First row of block (g, p) in the `[g][p]` layout.
  [[nodiscard]] std::int64_t block(std::int32_t g, std::int32_t p) const { return block_[std::int64_t{g} * p_ + p]; }
  //! Piece c of block (g, p), relative to the block.
  [[nodiscard]] row_range piece(std::int32_t g, std::int32_t p, std::int32_t c) const {
    return row_slice(recv_.data[std::int64_t{g} * p_ + p], w_, c);
  }
  //! First row of piece c of block (g, p) in the packed layout; `p = P` gives the end of the run.
  [[nodiscard]] std::int64_t packed(std::int32_t g, std::int32_t c, std::int32_t p = 0) const {
    return packed_[(std::int64_t{g} * w_ + c) * (p_ + 1) + p];
  }
  [[nodiscard]] std::int64_t packed_rows(std::int32_t g, std::int32_t c) const { return packed(g, c, p_) - packed(g, c); }

  //! The host tables a layout needs.
  [[nodiscard]] static std::int64_t table_entries(std::int32_t g, std::int32_t p, std::int32_t w) {
    return std::int64_t{g} * p + 1 + std::int64_t{g} * w * (p + 1);
  }

 private:
  array_view<std::int64_t const> recv_;
  std::int32_t g_, p_, w_;
  std::int64_t* block_;
  std::int64_t* packed_;
};

//! Checks shared by both directions; returns the layout, its tables in `scratch`'s host memory.
template <class Backend, class T>
piece_layout checked_layout(char const* op, std::int32_t gather_ranks, std::int32_t peers,
                            array_view<std::int64_t const> send_rows, array_view<std::int64_t const> recv_rows,
                            matrix_view<T const> blocks, char const* blocks_name, matrix_view<T const> rows,
                            char const* rows_name, std::int32_t pieces, workspace<Backend>& scratch) {
  require(pieces >= 1, op, "pieces = ", pieces, " must be at least 1");
  require(send_rows.size == peers, op, "argument 'send_rows' has ", send_rows.size, " entries, the all-to-all ranks ", peers);
  std::int64_t sent = 0;
  for (std::int32_t p = 0; p < peers; ++p) {
    require(send_rows.data[p] >= 0, op, "send_rows[", p, "] = ", send_rows.data[p], " is negative");
    sent = checked_add(sent, send_rows.data[p], op, "the rows of send_rows");
  }
  std::int64_t const entries = piece_layout::table_entries(gather_ranks, peers, pieces);
  std::int64_t* const tables = scratch.template host<std::int64_t>(entries);
  piece_layout layout(op, recv_rows, gather_ranks, peers, pieces, {tables, tables + std::int64_t{gather_ranks} * peers + 1});
  check_rows(rows, sent, op, rows_name, "the sum of send_rows");
  check_rows(blocks, layout.total(), op, blocks_name, "the sum of recv_rows");
  require(rows.hidden == blocks.hidden, op, "argument '", rows_name, "' has hidden = ", rows.hidden, ", '", blocks_name,
          "' has ", blocks.hidden);
  return layout;
}

//! Runs `first(c)` for c = 0 .. pieces − 1 on this thread and `second(c)` on the lane, `second(c)`
//! after `first(c)`, concurrently with `first(c + 1)`; returns when every piece is done and
//! rethrows the first failure (the lane stops at its failure; this thread at its own). Over a
//! communicator that enqueues on the stream, both on this thread: `second(c)` enqueued on the lane's
//! stream after `first(c)`, and the back-end's stream after every piece.
template <class Comm, class Backend, class First, class Second>
void run_pipeline(Backend const& be, pipeline_workspace<Backend>& scratch, std::int32_t pieces, First&& first,
                  Second&& second) {
  lane_t<Backend>& lane = scratch.lane(be);
  if constexpr (enqueues_on_stream_v<Comm>) {
    struct join_lane {  // on every exit, the back-end's stream after what the lane's holds
      lane_t<Backend>& l;
      ~join_lane() { l.join(); }
    } const joined{lane};
    for (std::int32_t c = 0; c < pieces; ++c) {
      first(c);
      lane.enqueue(second, c);
    }
    return;
  }
  auto job = [&](std::int32_t c) { second(c); };
  lane.start(job, pieces);
  struct finish_job {  // on every exit, the lane lets go of `job` before it goes out of scope
    lane_t<Backend>& l;
    ~finish_job() { l.finish(); }
  } const finish{lane};
  for (std::int32_t c = 0; c < pieces; ++c) {
    first(c);
    lane.release(c);
  }
  lane.wait(pieces - 1);
}

}  // namespace detail

//! `out = AllGather_gather(AllToAll_a2a(in))`, in pieces: block (g, p) of `out` (`[g][p]` order,
//! `recv_rows[g][p]` rows) is what gather rank g received from all-to-all rank p. Collective over
//! both communicators.
//! @param in this rank's rows for each all-to-all rank in turn (`send_rows[p]` rows for rank p).
//! @throws error (invalid_argument) naming the argument, before any message; (invalid_usage) from
//!         a communicator when ranks disagree on the sizes.
template <class Backend, class Comm, class T>
void alltoall_allgather(Backend const& be, Comm& a2a, Comm& gather, matrix_view<T const> in,
                        array_view<std::int64_t const> send_rows, array_view<std::int64_t const> recv_rows,
                        matrix_view<T> out, pipeline_workspace<Backend>& scratch, std::int32_t pieces) {
  char const* const op = "alltoall_allgather";
  detail::require_one_stream(be, a2a, op);
  std::int32_t const peers = a2a.size(), members = gather.size(), me = gather.rank();
  detail::piece_layout const at = detail::checked_layout(op, members, peers, send_rows, recv_rows, matrix_view<T const>(out),
                                                         "out", in, "in", pieces, scratch.first());
  std::int64_t const h = in.hidden, row_bytes = in.row_bytes();
  [[maybe_unused]] auto const payload = detail::payload_scope(be, detail::payload_kind::rows);
  T* const packed = scratch.first().template get<T>(be, at.total() * h);
  std::int64_t* const sent_before = scratch.second().template host<std::int64_t>(peers + 1);
  sent_before[0] = 0;
  for (std::int32_t p = 0; p < peers; ++p) sent_before[p + 1] = sent_before[p] + send_rows.data[p];
  auto exchange_piece = [&](std::int32_t c) {  // the all-to-all of piece c, received packed
    message_lists& lists = scratch.first().messages();
    lists.clear_messages();
    for (std::int32_t p = 0; p < peers; ++p) {
      row_range const mine = row_slice(send_rows.data[p], pieces, c);
      row_range const theirs = at.piece(me, p, c);
      if (mine.count > 0) lists.sends.push_back({p, in.data + (sent_before[p] + mine.begin) * h, mine.count * row_bytes});
      if (theirs.count > 0) lists.recvs.push_back({p, packed + at.packed(me, c, p) * h, theirs.count * row_bytes});
    }
    detail::exchange_in_stream_order(a2a, lists.sends, lists.recvs);
  };
  Comm& lane_gather = scratch.lane_copy(gather, be);
  Backend const& lane_be = lane_backend(scratch.lane(be), be);
  auto gather_piece = [&](std::int32_t c) {  // on the lane: the all-gather of piece c, then unpacked into out
    message_lists& lists = scratch.second().messages();
    lists.clear_messages();
    for (std::int32_t g = 0; g < members; ++g) {
      if (g == me) continue;
      if (at.packed_rows(me, c) > 0) lists.sends.push_back({g, packed + at.packed(me, c) * h, at.packed_rows(me, c) * row_bytes});
      if (at.packed_rows(g, c) > 0) lists.recvs.push_back({g, packed + at.packed(g, c) * h, at.packed_rows(g, c) * row_bytes});
    }
    if (members > 1) detail::exchange_in_stream_order(lane_gather, lists.sends, lists.recvs);
    for (std::int32_t g = 0; g < members; ++g)
      for (std::int32_t p = 0; p < peers; ++p) {
        row_range const piece = at.piece(g, p, c);
        if (piece.count > 0)
          lane_be.copy(out.data + (at.block(g, p) + piece.begin) * h, packed + at.packed(g, c, p) * h, piece.count * h);
      }
    detail::finish_before_messages<Comm>(lane_be);
  };
  detail::run_pipeline<Comm>(be, scratch, pieces, exchange_piece, gather_piece);
}

//! The mirror of `alltoall_allgather`: gather rank g's blocks (g, ·) of `in` are summed over the
//! gather group, left to right in ascending gather rank, and the sum's block p goes back to
//! all-to-all rank p, into that rank's `out` at its own place. Collective over both communicators.
//! @param in `[g][p]` blocks as `alltoall_allgather`'s `out` (`recv_rows[g][p]` rows each).
//! @param out what each all-to-all rank p returns, in turn (`send_rows[p]` rows from rank p).
//! @throws error (invalid_argument) naming the argument, before any message; (invalid_usage) from
//!         a communicator when ranks disagree on the sizes.
template <class Backend, class Comm, class T>
void reduce_scatter_alltoall(Backend const& be, Comm& gather, Comm& a2a, matrix_view<T const> in,
                             array_view<std::int64_t const> recv_rows, array_view<std::int64_t const> send_rows,
                             matrix_view<T> out, pipeline_workspace<Backend>& scratch, std::int32_t pieces) {
  char const* const op = "reduce_scatter_alltoall";
  detail::require_one_stream(be, a2a, op);
  std::int32_t const peers = a2a.size(), members = gather.size(), me = gather.rank();
  detail::piece_layout const at = detail::checked_layout(op, members, peers, send_rows, recv_rows, in, "in",
                                                         matrix_view<T const>(out), "out", pieces, scratch.first());
  std::int64_t const h = in.hidden, row_bytes = in.row_bytes();
  [[maybe_unused]] auto const payload = detail::payload_scope(be, detail::payload_kind::rows);
  std::int64_t const own = at.total() == 0 ? 0 : at.packed(me, pieces - 1, peers) - at.packed(me, 0);
  // packed: every member's pieces of this rank's partial sums; staged: this rank's pieces from every
  // member ([c][g][rows of piece c]); reduced: their sums, packed as this rank's blocks, which the
  // lane sends while this thread sums the next piece: a buffer of its own (the second workspace's).
  T* const packed = scratch.first().template get<T>(be, (at.total() + members * own) * h);
  T* const staged = packed + at.total() * h;
  T* const reduced = scratch.second().template get<T>(be, own * h);
  std::int64_t const first_own = at.packed(me, 0);
  std::int64_t* const returned_before = scratch.second().template host<std::int64_t>(peers + 1);
  returned_before[0] = 0;
  for (std::int32_t p = 0; p < peers; ++p) returned_before[p + 1] = returned_before[p] + send_rows.data[p];
  auto reduce_piece = [&](std::int32_t c) {  // pack piece c for every member, exchange, sum
    for (std::int32_t g = 0; g < members; ++g)
      for (std::int32_t p = 0; p < peers; ++p) {
        row_range const piece = at.piece(g, p, c);
        if (piece.count > 0) be.copy(packed + at.packed(g, c, p) * h, in.data + (at.block(g, p) + piece.begin) * h, piece.count * h);
      }
    std::int64_t const rows = at.packed_rows(me, c);
    T* const from = staged + members * (at.packed(me, c) - first_own) * h;  // [g][rows]
    if (rows > 0) be.copy(from + me * rows * h, packed + at.packed(me, c) * h, rows * h);
    detail::finish_before_messages<Comm>(be);
    message_lists& lists = scratch.first().messages();
    lists.clear_messages();
    for (std::int32_t g = 0; g < members; ++g) {
      if (g == me) continue;
      if (at.packed_rows(g, c) > 0) lists.sends.push_back({g, packed + at.packed(g, c) * h, at.packed_rows(g, c) * row_bytes});
      if (rows > 0) lists.recvs.push_back({g, from + g * rows * h, rows * row_bytes});
    }
    if (members > 1) detail::exchange_in_stream_order(gather, lists.sends, lists.recvs);
    if (rows > 0)
      be.for_each_index(rows * h, detail::sum_staged_in_rank_order<T>{from, rows * h, members,
                                                                      reduced + (at.packed(me, c) - first_own) * h});
    detail::finish_before_messages<Comm>(be);
  };
  Comm& lane_a2a = scratch.lane_copy(a2a, be);
  auto return_piece = [&](std::int32_t c) {  // on the lane: the all-to-all of piece c's sums back to their sources
    message_lists& lists = scratch.second().messages();
    lists.clear_messages();
    for (std::int32_t p = 0; p < peers; ++p) {
      row_range const mine = at.piece(me, p, c);
      row_range const theirs = row_slice(send_rows.data[p], pieces, c);
      if (mine.count > 0)
        lists.sends.push_back({p, reduced + (at.packed(me, c, p) - first_own) * h, mine.count * row_bytes});
      if (theirs.count > 0) lists.recvs.push_back({p, out.data + (returned_before[p] + theirs.begin) * h, theirs.count * row_bytes});
    }
    detail::exchange_in_stream_order(lane_a2a, lists.sends, lists.recvs);
  };
  detail::run_pipeline<Comm>(be, scratch, pieces, reduce_piece, return_piece);
}

MOECOMM_NAMESPACE_END
