// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Row collectives over a group (Parm's MP split, MP/ESP all-gather and ESP reduce-scatter): a
//! matrix of `rows x hidden` is cut into one contiguous slice per group rank (`row_slice`: the first
//! `rows % n` slices one row longer), and
//! - `row_slice` is the MP split: this rank's slice of rows every rank holds (no traffic);
//! - `row_allgather`: every rank's slice to every rank, into the whole matrix;
//! - `ordered_reduce_scatter`: slice r of the element-wise sum of every rank's matrix to rank r,
//!   added left to right in ascending rank (fp32 for 16-bit rows), so the bits are the same on
//!   every transport.
//! Both move their rows by the communicator's `exchange` (grouped send/receive: `n − 1` messages out
//! and in per rank), with message lists and staging kept in the caller's `workspace`.

#include <moecomm/comm/communicator.hpp>
#include <moecomm/config.hpp>
#include <moecomm/core/dtype.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/core/row_slice.hpp>
#include <moecomm/core/simulation_hooks.hpp>
#include <moecomm/core/workspace.hpp>
#include <moecomm/error.hpp>
#include <moecomm/core/matrix_checks.hpp>

#include <cstdint>
#include <type_traits>
#include <utility>

MOECOMM_NAMESPACE_BEGIN

//! `matrix`'s slice for group rank `part` of `parts`, as a view (the MP split: no traffic).
template <class T>
[[nodiscard]] matrix_view<T> row_slice(matrix_view<T> matrix, std::int32_t parts, std::int32_t part) {
  row_range const s = row_slice(matrix.rows, parts, part);
  return {matrix.data + s.begin * matrix.hidden, s.count, matrix.hidden};
}

namespace detail {

//! `out[i]` = the sum over ranks of `staged[r][i]`, left to right in ascending rank, in fp32 for
//! 16-bit rows (float and double in their own type).
template <class T>
struct sum_staged_in_rank_order {
  T const* staged;  //!< `[ranks][n]`
  std::int64_t n;
  std::int32_t ranks;
  T* out;
  //! Every rank's element read, the sum written (the simulated back-end prices the kernel by it).
  [[nodiscard]] std::int64_t bytes_per_index() const { return (ranks + std::int64_t{1}) * std::int64_t{sizeof(T)}; }
  MOECOMM_HOST_DEVICE void operator()(std::int64_t i) const {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      T acc = staged[i];
      for (std::int32_t r = 1; r < ranks; ++r) acc = acc + staged[r * n + i];
      out[i] = acc;
    } else {
      float acc = dtype_traits<T>::to_float(staged[i]);
      for (std::int32_t r = 1; r < ranks; ++r) acc = acc + dtype_traits<T>::to_float(staged[r * n + i]);
      out[i] = dtype_traits<T>::from_float(acc);
    }
  }
};

//! Checks a whole matrix and this rank's slice view of it (same hidden, enough rows, memory behind
//! them) before any message; returns the slice's rows.
template <class Whole, class Slice>
row_range check_sliced(char const* op, Whole const& whole, char const* whole_name, Slice const& slice,
                       char const* slice_name, std::int32_t n, std::int32_t me) {
  require(whole.rows >= 0, op, "argument '", whole_name, "' has rows = ", whole.rows);
  check_rows(whole, whole.rows, op, whole_name, "its own rows");
  row_range const own = row_slice(whole.rows, n, me);
  require(slice.hidden == whole.hidden, op, "argument '", slice_name, "' has hidden = ", slice.hidden, ", '", whole_name,
          "' has ", whole.hidden);
  check_rows(slice, own.count, op, slice_name, "this rank's slice of the rows");
  return own;
}

//! One grouped exchange with every other rank: `send_to(r)` and `receive_from(r)` give the block
//! to and from rank r as (pointer, rows) of `row_bytes` each.
template <class Comm, class SendTo, class ReceiveFrom>
void exchange_with_every_rank(Comm& comm, message_lists& lists, std::int64_t row_bytes, SendTo&& send_to,
                              ReceiveFrom&& receive_from) {
  lists.clear_messages();
  for (std::int32_t r = 0; r < comm.size(); ++r) {
    if (r == comm.rank()) continue;
    auto const out = send_to(r);
    auto const in = receive_from(r);
    lists.sends.push_back({r, out.first, out.second * row_bytes});
    lists.recvs.push_back({r, in.first, in.second * row_bytes});
  }
  exchange_in_stream_order(comm, lists.sends, lists.recvs);
}

//! Before a host-driven communicator reads rows the back-end wrote: its work must be done. One that
//! enqueues on the back-end's stream is ordered after it, and the host waits for nothing.
template <class Comm, class Backend>
void finish_before_messages(Backend const& be) {
  if constexpr (!enqueues_on_stream_v<Comm>) be.synchronize();
}

}  // namespace detail

//! `all` (every rank's `rows x hidden`, the same shape on every rank) receives, in slice r, group
//! rank r's `mine` (`row_slice(all.rows, size, r)` rows). Collective over `comm`.
//! @param kind what the rows are, for a simulated back-end's scale (token rows, or expert parameters
//!        gathered as rows).
//! @throws error (invalid_argument) naming `mine` or `all`, before any message; (invalid_usage) from
//!         the communicator when ranks disagree on the shape.
template <class Backend, class Comm, class T>
void row_allgather(Backend const& be, Comm& comm, matrix_view<T const> mine, matrix_view<T> all, workspace<Backend>& scratch,
                   detail::payload_kind kind = detail::payload_kind::rows) {
  detail::require_one_stream(be, comm, "row_allgather");
  std::int32_t const n = comm.size(), me = comm.rank();
  row_range const own = detail::check_sliced("row_allgather", all, "all", mine, "mine", n, me);
  [[maybe_unused]] auto const payload = detail::payload_scope(be, kind);
  be.copy(all.data + own.begin * all.hidden, mine.data, own.count * all.hidden);
  detail::finish_before_messages<Comm>(be);
  detail::exchange_with_every_rank(
      comm, scratch.messages(), all.hidden * static_cast<std::int64_t>(sizeof(T)),
      [&](std::int32_t) { return std::make_pair(static_cast<void const*>(mine.data), own.count); },
      [&](std::int32_t r) {
        row_range const theirs = row_slice(all.rows, n, r);
        return std::make_pair(static_cast<void*>(all.data + theirs.begin * all.hidden), theirs.count);
      });
}

//! `out` (`row_slice(in.rows, size, rank)` rows) = this rank's slice of the sum of every rank's `in`,
//! added left to right in ascending rank: bitwise the same on every transport. Collective over `comm`.
//! @param scratch holds the staged slices (`size x` this rank's slice) and the message lists.
//! @param kind what the rows are, for a simulated back-end's scale (as `row_allgather`'s).
//! @throws error (invalid_argument) naming `in` or `out`, before any message; (invalid_usage) from
//!         the communicator when ranks disagree on the shape.
template <class Backend, class Comm, class T>
void ordered_reduce_scatter(Backend const& be, Comm& comm, matrix_view<T const> in, matrix_view<T> out,
                            workspace<Backend>& scratch, detail::payload_kind kind = detail::payload_kind::rows) {
  detail::require_one_stream(be, comm, "ordered_reduce_scatter");
  std::int32_t const n = comm.size(), me = comm.rank();
  row_range const own = detail::check_sliced("ordered_reduce_scatter", in, "in", out, "out", n, me);
  std::int64_t const elements = own.count * in.hidden;
  T* const staged = scratch.template get<T>(be, elements * n);  // [rank][slice]
  [[maybe_unused]] auto const payload = detail::payload_scope(be, kind);
  be.copy(staged + me * elements, in.data + own.begin * in.hidden, elements);
  detail::finish_before_messages<Comm>(be);
  detail::exchange_with_every_rank(
      comm, scratch.messages(), in.hidden * static_cast<std::int64_t>(sizeof(T)),
      [&](std::int32_t r) {
        row_range const theirs = row_slice(in.rows, n, r);
        return std::make_pair(static_cast<void const*>(in.data + theirs.begin * in.hidden), theirs.count);
      },
      [&](std::int32_t r) { return std::make_pair(static_cast<void*>(staged + r * elements), own.count); });
  be.for_each_index(elements, detail::sum_staged_in_rank_order<T>{staged, elements, n, out.data});
  detail::finish_before_messages<Comm>(be);  // the staging is reused by the next call's messages
}

MOECOMM_NAMESPACE_END
