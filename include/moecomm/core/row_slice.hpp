// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `row_slice`: how rows are cut into contiguous slices, one per group rank (Parm's MP split, the
//! row collectives' slices, and the adviser's pricing of them).

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <cstdint>

MOECOMM_NAMESPACE_BEGIN

//! Rows `[begin, begin + count)` of a matrix cut into `parts` contiguous slices.
struct row_range {
  std::int64_t begin = 0;
  std::int64_t count = 0;
};

//! Slice `part` of `rows` rows cut into `parts` slices, the first `rows % parts` one row longer.
[[nodiscard]] inline row_range row_slice(std::int64_t rows, std::int32_t parts, std::int32_t part) {
  detail::require(rows >= 0, "row_slice", "rows = ", rows, " must be >= 0");
  detail::require(parts >= 1 && part >= 0 && part < parts, "row_slice", "part = ", part, " is not in [0, ", parts, ")");
  std::int64_t const base = rows / parts, longer = rows % parts;
  return {part * base + (part < longer ? part : longer), base + (part < longer ? 1 : 0)};
}

MOECOMM_NAMESPACE_END
