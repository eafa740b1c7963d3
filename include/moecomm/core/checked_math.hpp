// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Overflow-checked size arithmetic: every product of user-provided sizes goes through
//! these before it sizes a buffer or a loop, so a size that wraps is an error, never a small
//! allocation followed by a large write (reliability checklist items 1 and 13).

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! `a * b`, or an invalid-argument error "<what> = <a> * <b> overflows int64".
//! @param what the product in the user's terms, e.g. "routing.num_tokens * routing.top_k".
[[nodiscard]] inline std::int64_t checked_mul(std::int64_t a, std::int64_t b, char const* op, char const* what) {
  std::int64_t product = 0;
  require(!__builtin_mul_overflow(a, b, &product), op, what, " = ", a, " * ", b, " overflows int64");
  return product;
}

//! `a + b`, or an invalid-argument error "<what> overflows int64".
[[nodiscard]] inline std::int64_t checked_add(std::int64_t a, std::int64_t b, char const* op, char const* what) {
  std::int64_t sum = 0;
  require(!__builtin_add_overflow(a, b, &sum), op, what, " overflow int64");
  return sum;
}

//! `value` as an int32, or an invalid-argument error "<what> = <value> exceeds int32 (2^31 - 1): <why>".
//! @param why which int32 quantity the value must fit, e.g. "the plan's row ids are int32".
[[nodiscard]] inline std::int32_t checked_int32(std::int64_t value, char const* op, char const* what, char const* why) {
  require(value <= std::numeric_limits<std::int32_t>::max(), op, what, " = ", value, " exceeds int32 (2^31 - 1): ",
          why);
  return static_cast<std::int32_t>(value);
}

//! The bytes of `n` elements of `T` (0 for `n <= 0`), or an out-of-memory error when that many
//! bytes cannot even be counted: no allocator can meet such a request.
template <class T>
[[nodiscard]] std::size_t allocation_bytes(std::int64_t n, char const* op) {
  constexpr auto element = static_cast<std::int64_t>(sizeof(T));
  if (n <= 0) return 0;
  if (n > std::numeric_limits<std::int64_t>::max() / element)
    fail(status::out_of_memory, op, "cannot allocate ", n, " elements of ", element,
         " bytes: the size overflows int64");
  return static_cast<std::size_t>(n * element);
}

}  // namespace detail
MOECOMM_NAMESPACE_END
