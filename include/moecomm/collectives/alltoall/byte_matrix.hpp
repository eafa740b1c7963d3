// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `byte_matrix`: the R x R bytes every rank sends every other rank, known on every rank (the
//! result of the count exchange). All-to-all algorithms plan their messages from it.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <cstdint>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN

//! `bytes(s, d)`: what rank s sends rank d. Row s is the send layout of rank s (blocks by
//! destination, ascending); column d the receive layout of rank d (blocks by source, ascending).
class byte_matrix {
 public:
  byte_matrix() = default;
  //! @param cells row-major `ranks x ranks`, each `>= 0`.
  byte_matrix(std::int32_t ranks, std::vector<std::int64_t> cells) : ranks_(ranks), cells_(std::move(cells)) {
    detail::require(ranks > 0 && cells_.size() == static_cast<std::size_t>(ranks) * static_cast<std::size_t>(ranks),
                    "byte_matrix", "needs ranks x ranks = ", std::int64_t{ranks} * ranks, " cells, got ", cells_.size());
    for (std::int32_t s = 0; s < ranks; ++s)
      for (std::int32_t d = 0; d < ranks; ++d)
        detail::require(bytes(s, d) >= 0, "byte_matrix", "bytes(", s, ", ", d, ") = ", bytes(s, d), " is negative");
  }

  [[nodiscard]] std::int32_t ranks() const { return ranks_; }
  [[nodiscard]] std::int64_t bytes(std::int32_t from, std::int32_t to) const {
    return cells_[static_cast<std::size_t>(from) * static_cast<std::size_t>(ranks_) + static_cast<std::size_t>(to)];
  }
  //! Offset of the block for `to` in rank `from`'s send buffer.
  [[nodiscard]] std::int64_t send_offset(std::int32_t from, std::int32_t to) const {
    std::int64_t at = 0;
    for (std::int32_t d = 0; d < to; ++d) at += bytes(from, d);
    return at;
  }
  //! Offset of the block from `from` in rank `to`'s receive buffer.
  [[nodiscard]] std::int64_t recv_offset(std::int32_t from, std::int32_t to) const {
    std::int64_t at = 0;
    for (std::int32_t s = 0; s < from; ++s) at += bytes(s, to);
    return at;
  }
  [[nodiscard]] std::int64_t send_total(std::int32_t from) const { return send_offset(from, ranks_); }
  [[nodiscard]] std::int64_t recv_total(std::int32_t to) const { return recv_offset(ranks_, to); }
  //! Makes this a `ranks x ranks` matrix of zeros, keeping the memory (a steady state reuses one).
  void assign_zeros(std::int32_t ranks) {
    detail::require(ranks > 0, "byte_matrix::assign_zeros", "ranks = ", ranks, " must be positive");
    ranks_ = ranks;
    cells_.assign(static_cast<std::size_t>(ranks) * static_cast<std::size_t>(ranks), 0);
  }
  //! Adds `bytes` (>= 0) to what `from` sends `to`.
  void add(std::int32_t from, std::int32_t to, std::int64_t bytes) {
    detail::require(bytes >= 0, "byte_matrix::add", "bytes = ", bytes, " is negative");
    cells_[static_cast<std::size_t>(from) * static_cast<std::size_t>(ranks_) + static_cast<std::size_t>(to)] += bytes;
  }
  //! Makes this the transpose of `m`, keeping the memory.
  void assign_transposed(byte_matrix const& m) {
    assign_zeros(m.ranks_);
    for (std::int32_t s = 0; s < ranks_; ++s)
      for (std::int32_t d = 0; d < ranks_; ++d) add(d, s, m.bytes(s, d));
  }

  //! The matrix of the reverse exchange (combine): what d sends s.
  [[nodiscard]] byte_matrix transposed() const {
    std::vector<std::int64_t> t(cells_.size());
    for (std::int32_t s = 0; s < ranks_; ++s)
      for (std::int32_t d = 0; d < ranks_; ++d) t[static_cast<std::size_t>(d) * ranks_ + s] = bytes(s, d);
    return byte_matrix(ranks_, std::move(t));
  }

 private:
  std::int32_t ranks_ = 0;
  std::vector<std::int64_t> cells_;
};

MOECOMM_NAMESPACE_END
