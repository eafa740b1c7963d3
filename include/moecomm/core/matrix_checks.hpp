// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Argument checks shared by the ops that read and write token matrices: all O(1), all before any
//! work, each naming the operation and the argument.

#include <moecomm/config.hpp>
#include <moecomm/core/array_view.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/error.hpp>

#include <cstdint>
#include <limits>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! `m` must hold at least `rows` rows (and memory behind them).
template <class T>
void check_rows(matrix_view<T> const& m, std::int64_t rows, char const* op, char const* name, char const* why) {
  require(m.hidden >= 0, op, "argument '", name, "' has negative hidden = ", m.hidden);
  std::int64_t const max_elements = std::numeric_limits<std::int64_t>::max() / static_cast<std::int64_t>(sizeof(T));
  require(m.rows <= 0 || m.hidden <= max_elements / m.rows, op, "argument '", name, "' has ", m.rows,
          " rows of hidden = ", m.hidden, ": its size in bytes overflows int64");
  require(m.rows >= rows, op, "argument '", name, "' has ", m.rows, " rows; needs at least ", rows, " (", why, ")");
  require(rows == 0 || m.hidden == 0 || m.data != nullptr, op, "argument '", name, "' is null but must hold ", rows,
          " rows");
}

//! Two matrices must have the same row width.
template <class A, class B>
void check_same_hidden(matrix_view<A> const& a, char const* a_name, matrix_view<B> const& b, char const* b_name,
                       char const* op) {
  require(a.hidden == b.hidden, op, "argument '", a_name, "' has hidden = ", a.hidden, " but '", b_name,
          "' has hidden = ", b.hidden);
}

//! The first `a_rows` rows of `a` must not overlap the first `b_rows` rows of `b` (no op here works
//! in place).
template <class A, class B>
void check_no_overlap(matrix_view<A> const& a, std::int64_t a_rows, char const* a_name, matrix_view<B> const& b,
                      std::int64_t b_rows, char const* b_name, char const* op) {
  auto const* a0 = reinterpret_cast<char const*>(a.data);
  auto const* b0 = reinterpret_cast<char const*>(b.data);
  auto const* a1 = a0 + a_rows * a.row_bytes();
  auto const* b1 = b0 + b_rows * b.row_bytes();
  require(a0 == a1 || b0 == b1 || a1 <= b0 || b1 <= a0, op, "arguments '", a_name, "' and '", b_name,
          "' overlap; this operation does not work in place");
}

//! The checks of an op that reads `in_rows` rows of `in` and writes `out_rows` rows of `out`: both
//! hold their rows, have the same width, and do not overlap.
template <class A, class B>
void check_row_move(matrix_view<A> const& in, std::int64_t in_rows, char const* in_name, char const* in_why,
                    matrix_view<B> const& out, std::int64_t out_rows, char const* out_name, char const* out_why,
                    char const* op) {
  check_rows(in, in_rows, op, in_name, in_why);
  check_rows(out, out_rows, op, out_name, out_why);
  check_same_hidden(in, in_name, out, out_name, op);
  check_no_overlap(in, in_rows, in_name, out, out_rows, out_name, op);
}

}  // namespace detail
MOECOMM_NAMESPACE_END
