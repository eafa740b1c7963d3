// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `matrix_view`: a non-owning, row-major `rows x hidden` token matrix with 64-bit offsets.

#include <moecomm/config.hpp>

#include <cstdint>
#include <type_traits>

MOECOMM_NAMESPACE_BEGIN

//! A contiguous row-major matrix of `rows` token rows, each `hidden` elements wide. Element
//! offsets are `int64_t`, so buffers past 2^31 elements or bytes are addressed correctly.
//! The memory may be host or device memory; the back-end that reads it decides.
//! @tparam T element type; `T const` for an input.
template <class T>
struct matrix_view {
  T* data = nullptr;        //!< first element of row 0
  std::int64_t rows = 0;    //!< number of rows the memory holds
  std::int64_t hidden = 0;  //!< elements per row

  matrix_view() = default;
  MOECOMM_HOST_DEVICE matrix_view(T* data_, std::int64_t rows_, std::int64_t hidden_)
      : data(data_), rows(rows_), hidden(hidden_) {}
  //! A writable view converts to a read-only one.
  template <class U, class = std::enable_if_t<std::is_same_v<U const, T> && !std::is_same_v<U, T>>>
  MOECOMM_HOST_DEVICE matrix_view(matrix_view<U> const& other) : data(other.data), rows(other.rows), hidden(other.hidden) {}

  //! Pointer to the first element of row `r`.
  MOECOMM_HOST_DEVICE T* row(std::int64_t r) const { return data + r * hidden; }
  //! Bytes in one row.
  MOECOMM_HOST_DEVICE std::int64_t row_bytes() const { return hidden * static_cast<std::int64_t>(sizeof(T)); }
};

//! Builds a view; `T` is deduced from the pointer.
template <class T>
[[nodiscard]] matrix_view<T> make_matrix_view(T* data, std::int64_t rows, std::int64_t hidden) {
  return {data, rows, hidden};
}

MOECOMM_NAMESPACE_END
