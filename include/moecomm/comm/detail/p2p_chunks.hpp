// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Host-side helpers of the communicators: the argument checks that every model (in-process, MPI,
//! NCCL) runs before it moves data, so a bad argument throws the same `error(invalid_argument)`
//! naming it on every transport and the communicator stays usable; and the split of a large
//! point-to-point message into chunks.
//!
//! Plain C++17: compiled and tested by the host compiler.

#include <moecomm/comm/communicator.hpp>
#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! One piece of a message: `bytes` bytes starting `offset` bytes into it.
struct byte_chunk {
  std::int64_t offset;  //!< bytes from the start of the message
  std::int64_t bytes;   //!< length of this piece, in `[1, max_chunk]`
};

//! The number of chunks of at most `max_chunk` bytes that cover `bytes` bytes (0 for an empty message).
//! @throws error (invalid_argument) if `bytes < 0` or `max_chunk <= 0`.
[[nodiscard]] inline std::int64_t chunk_count(std::int64_t bytes, std::int64_t max_chunk) {
  require(bytes >= 0, "chunk_count", "bytes = ", bytes, " must be >= 0");
  require(max_chunk > 0, "chunk_count", "max_chunk = ", max_chunk, " must be positive");
  return bytes / max_chunk + (bytes % max_chunk != 0 ? 1 : 0);
}

//! The chunks of at most `max_chunk` bytes that cover `[0, bytes)`, in order: all full but the last.
//! A range computed on the fly (it allocates nothing: a steady state cuts messages every step).
class chunk_range {
 public:
  chunk_range(std::int64_t bytes, std::int64_t max_chunk)
      : bytes_(bytes), max_chunk_(max_chunk), count_(chunk_count(bytes, max_chunk)) {}

  [[nodiscard]] std::size_t size() const { return static_cast<std::size_t>(count_); }
  [[nodiscard]] bool empty() const { return count_ == 0; }
  [[nodiscard]] byte_chunk operator[](std::size_t i) const {
    std::int64_t const offset = static_cast<std::int64_t>(i) * max_chunk_;
    return {offset, bytes_ - offset < max_chunk_ ? bytes_ - offset : max_chunk_};
  }

  class iterator {
   public:
    iterator(chunk_range const* range, std::size_t i) : range_(range), i_(i) {}
    byte_chunk operator*() const { return (*range_)[i_]; }
    iterator& operator++() {
      ++i_;
      return *this;
    }
    bool operator!=(iterator const& other) const { return i_ != other.i_; }

   private:
    chunk_range const* range_;
    std::size_t i_;
  };
  [[nodiscard]] iterator begin() const { return {this, 0}; }
  [[nodiscard]] iterator end() const { return {this, size()}; }

 private:
  std::int64_t bytes_, max_chunk_, count_;
};

//! The split depends only on `(bytes, max_chunk)`, so a sender and a receiver that agree on the
//! message size post matching sequences of chunks.
//! @throws error (invalid_argument) if `bytes < 0` or `max_chunk <= 0`.
[[nodiscard]] inline chunk_range split_into_chunks(std::int64_t bytes, std::int64_t max_chunk) {
  return chunk_range(bytes, max_chunk);
}

//! Checks that `value` (the argument called `name` of operation `op`) is not negative and that
//! `value * unit` bytes still fit in 64 bits: `unit` is the bytes per element, times the ranks for a
//! gathered buffer, and `unit_name` says so in the message (e.g. " bytes of 4 ranks").
inline void validate_size(char const* op, char const* name, std::int64_t value, std::int64_t unit = 1,
                          char const* unit_name = "") {
  require(value >= 0, op, name, " = ", value, " must be >= 0");
  require(unit <= 1 || value <= std::numeric_limits<std::int64_t>::max() / unit, op, name, " = ", value,
          " is too large: ", name, " x ", unit, unit_name, " overflows a 64-bit byte count");
}

//! Checks that buffer `name` is not null when its size (bytes or elements) is positive.
inline void validate_buffer(char const* op, char const* name, void const* data, std::int64_t size) {
  require(data != nullptr || size <= 0, op, name, " is null but its size is ", size);
}

//! Checks that `root` is a rank of a group of `group_size`.
inline void validate_root(char const* op, int root, int group_size) {
  require(root >= 0 && root < group_size, op, "root = ", root, " is not a rank of this group of ", group_size);
}

//! The arguments of `allgather` on a group of `group_size`: `bytes` not negative, `recv` of
//! `group_size * bytes` addressable, no null buffer with bytes.
inline void validate_allgather(char const* op, void const* send, void const* recv, std::int64_t bytes, int group_size) {
  validate_size(op, "bytes", bytes, group_size, " ranks");
  validate_buffer(op, "send", send, bytes);
  validate_buffer(op, "recv", recv, bytes);
}

//! The arguments of `allreduce` (`all`) and `reduce` to `root`: `count` not negative with
//! `count * sizeof(T)` addressable, buffers present, `root` a rank; `recv` may be null on a rank
//! that is not the root of a `reduce`.
template <class T>
void validate_reduction(char const* op, T const* send, T const* recv, std::int64_t count, bool all, int root, int rank,
                        int group_size) {
  validate_size(op, "count", count, static_cast<std::int64_t>(sizeof(T)), " bytes per element");
  validate_buffer(op, "send", send, count);
  if (!all) validate_root(op, root, group_size);
  if (all || rank == root) validate_buffer(op, "recv", recv, count);
}

//! The arguments of `broadcast`: `root` a rank, `bytes` not negative, `data` present.
inline void validate_broadcast(char const* op, void const* data, std::int64_t bytes, int root, int group_size) {
  validate_root(op, root, group_size);
  validate_size(op, "bytes", bytes);
  validate_buffer(op, "data", data, bytes);
}

//! The argument of `split`: colours are >= 0 (`MPI_UNDEFINED` is not supported).
inline void validate_split(char const* op, int color) { require(color >= 0, op, "color = ", color, " must be >= 0"); }

//! Runs `checks()`, which throws `error` for a bad argument, and returns that error instead, so that a
//! collective can post it for its peers (who then fail too, instead of waiting for this rank).
template <class Checks>
[[nodiscard]] std::optional<error> argument_error(Checks&& checks) {
  try {
    checks();
  } catch (error const& e) {
    return e;
  }
  return std::nullopt;
}

namespace p2p_detail {

//! Checks one list of blocks (`name` is "sends" or "recvs"): peers in range, sizes not negative,
//! buffers present, at most one block per peer.
template <class Block>
void validate_blocks(char const* op, char const* name, std::vector<Block> const& blocks, int group_size) {
  thread_local std::vector<std::int64_t> first;  // capacity kept: a steady state allocates nothing
  first.assign(static_cast<std::size_t>(group_size > 0 ? group_size : 0), -1);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    Block const& b = blocks[i];
    require(b.peer >= 0 && b.peer < group_size, op, name, "[", i, "].peer = ", b.peer,
            " is not a rank of this group of ", group_size);
    require(b.bytes >= 0, op, name, "[", i, "].bytes = ", b.bytes, " must be >= 0");
    require(b.data != nullptr || b.bytes == 0, op, name, "[", i, "].data is null but ", name, "[", i, "].bytes = ",
            b.bytes);
    std::int64_t& seen = first[static_cast<std::size_t>(b.peer)];
    require(seen < 0, op, name, "[", seen, "] and ", name, "[", i, "] both name peer ", b.peer,
            "; post one block per peer");
    seen = static_cast<std::int64_t>(i);
  }
}

}  // namespace p2p_detail

//! Checks the arguments of `exchange` for a group of `group_size` ranks: every peer is a rank of the
//! group, no size is negative, no buffer with bytes is null, and each list names a peer at most
//! once. It cannot check what only the peers know (that rank i's send to j matches j's receive).
//! @throws error (invalid_argument) naming the first bad block, e.g. "sends[2].peer = 9 ...".
inline void validate_exchange(char const* op, std::vector<send_block> const& sends,
                              std::vector<recv_block> const& recvs, int group_size) {
  p2p_detail::validate_blocks(op, "sends", sends, group_size);
  p2p_detail::validate_blocks(op, "recvs", recvs, group_size);
}

//! An exchange's message from this rank to itself, which host communicators copy rather than send:
//! its two blocks (null when absent) and their sizes (0 for an absent block).
struct self_message {
  send_block const* send = nullptr;
  recv_block const* recv = nullptr;
  std::int64_t sent = 0, expected = 0;

  //! Copies the message (host memory), when there is one. The sizes must agree.
  void copy() const {
    if (sent > 0) std::memcpy(recv->data, send->data, static_cast<std::size_t>(sent));
  }
};

//! The blocks of `sends` and `recvs` whose peer is `rank` (validated lists: at most one each).
[[nodiscard]] inline self_message find_self_message(std::vector<send_block> const& sends,
                                                    std::vector<recv_block> const& recvs, int rank) {
  self_message m;
  for (send_block const& s : sends)
    if (s.peer == rank) m.send = &s;
  for (recv_block const& r : recvs)
    if (r.peer == rank) m.recv = &r;
  m.sent = m.send != nullptr ? m.send->bytes : 0;
  m.expected = m.recv != nullptr ? m.recv->bytes : 0;
  return m;
}

}  // namespace detail
MOECOMM_NAMESPACE_END
