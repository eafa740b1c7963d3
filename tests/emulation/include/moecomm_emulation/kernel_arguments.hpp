// SPDX-License-Identifier: Apache-2.0
#pragma once
// The pointers among a kernel functor's members, found by type, not by reading its bytes (which
// include padding, and padding may hold a stale pointer): an aggregate's members are enumerated
// with structured bindings (its member count probed by brace-initialisation, as Boost.PFR does),
// nested aggregates recursively. A sized view among them (moecomm's `matrix_view`: `data`, `rows`,
// `hidden`; `array_view`: `data`, `size`) gives its exact bytes; a raw pointer's extent is unknown.
// A functor that is not an aggregate of at most 16 members is read word by word instead
// (`fallback` is then true).

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace moecomm_emulation::detail {

//! A pointer a kernel was given, and the bytes it may touch from there (`unknown`: to the end of
//! its allocation). `typed`: a pointer member found by type; false for a word of a functor read
//! word by word, which may be any value.
struct kernel_pointer {
  static constexpr std::size_t unknown = ~std::size_t{0};
  std::uintptr_t address;
  std::size_t bytes;
  bool typed = true;
};

template <class V, class = void>
struct is_matrix_view : std::false_type {};
template <class V>
struct is_matrix_view<V, std::void_t<decltype(*std::declval<V const&>().data), decltype(std::declval<V const&>().rows),
                                     decltype(std::declval<V const&>().hidden)>> : std::true_type {};
template <class V, class = void>
struct is_array_view : std::false_type {};
template <class V>
struct is_array_view<V, std::enable_if_t<std::is_pointer_v<decltype(std::declval<V const&>().data)> &&
                                         std::is_integral_v<decltype(std::declval<V const&>().size)>>> : std::true_type {};

//! Converts to anything: `T{any_member{}...}` compiles while there are at most as many as T's members.
struct any_member {
  template <class U>
  operator U() const;  // declared only: used in unevaluated contexts
};

template <class T, class Seq, class = void>
struct brace_constructible : std::false_type {};
template <class T, std::size_t... I>
struct brace_constructible<T, std::index_sequence<I...>, std::void_t<decltype(T{(I, any_member{})...})>> : std::true_type {};

//! The number of members of aggregate `T` (at most 16), or 17 when it has more or cannot be counted.
template <class T, std::size_t N = 16>
constexpr std::size_t member_count() {
  if constexpr (N == 0) return 0;
  else if constexpr (brace_constructible<T, std::make_index_sequence<N>>::value) return N;
  else return member_count<T, N - 1>();
}

template <class T>
void collect_pointers(T const& value, std::vector<kernel_pointer>& out, bool& fallback);

template <class M>
void collect_member(M const& m, std::vector<kernel_pointer>& out, bool& fallback) {
  using U = std::remove_cv_t<M>;
  if constexpr (std::is_pointer_v<U>) {
    if constexpr (!std::is_function_v<std::remove_pointer_t<U>>)  // a function pointer is code, not data
      out.push_back({reinterpret_cast<std::uintptr_t>(m), kernel_pointer::unknown});
  } else if constexpr (is_matrix_view<U>::value) {
    if (m.rows * m.hidden > 0)
      out.push_back({reinterpret_cast<std::uintptr_t>(m.data), static_cast<std::size_t>(m.rows * m.hidden) * sizeof(*m.data)});
  } else if constexpr (is_array_view<U>::value) {
    if (m.size > 0) out.push_back({reinterpret_cast<std::uintptr_t>(m.data), static_cast<std::size_t>(m.size) * sizeof(*m.data)});
  } else if constexpr (std::is_class_v<U>) {
    collect_pointers(m, out, fallback);
  }
  else if constexpr (std::is_array_v<U>) fallback = true;  // not expected in a kernel's arguments
}

template <class... M>
void collect_each(std::vector<kernel_pointer>& out, bool& fallback, M const&... m) {
  (collect_member(m, out, fallback), ...);
}

template <class T>
void collect_pointers(T const& value, std::vector<kernel_pointer>& out, bool& fallback) {
  if constexpr (!std::is_aggregate_v<T> || std::is_empty_v<T>) {
    if constexpr (!std::is_empty_v<T>) fallback = true;
  } else {
    constexpr std::size_t count = member_count<T>();
    if constexpr (count == 0 || count > 16) {
      fallback = true;
    } else {
      // Structured bindings of 1 to 16 members, each handed to collect_member.
      if constexpr (count == 1) { auto const& [a] = value; collect_each(out, fallback, a); }
      if constexpr (count == 2) { auto const& [a, b] = value; collect_each(out, fallback, a, b); }
      if constexpr (count == 3) { auto const& [a, b, c] = value; collect_each(out, fallback, a, b, c); }
      if constexpr (count == 4) { auto const& [a, b, c, d] = value; collect_each(out, fallback, a, b, c, d); }
      if constexpr (count == 5) { auto const& [a, b, c, d, e] = value; collect_each(out, fallback, a, b, c, d, e); }
      if constexpr (count == 6) { auto const& [a, b, c, d, e, f] = value; collect_each(out, fallback, a, b, c, d, e, f); }
      if constexpr (count == 7) { auto const& [a, b, c, d, e, f, g] = value; collect_each(out, fallback, a, b, c, d, e, f, g); }
      if constexpr (count == 8) { auto const& [a, b, c, d, e, f, g, h] = value; collect_each(out, fallback, a, b, c, d, e, f, g, h); }
      if constexpr (count == 9) {
        auto const& [a, b, c, d, e, f, g, h, i] = value;
        collect_each(out, fallback, a, b, c, d, e, f, g, h, i);
      }
      if constexpr (count == 10) {
        auto const& [a, b, c, d, e, f, g, h, i, j] = value;
        collect_each(out, fallback, a, b, c, d, e, f, g, h, i, j);
      }
      if constexpr (count == 11) {
        auto const& [a, b, c, d, e, f, g, h, i, j, k] = value;
        collect_each(out, fallback, a, b, c, d, e, f, g, h, i, j, k);
      }
      if constexpr (count == 12) {
        auto const& [a, b, c, d, e, f, g, h, i, j, k, l] = value;
        collect_each(out, fallback, a, b, c, d, e, f, g, h, i, j, k, l);
      }
      if constexpr (count == 13) {
        auto const& [a, b, c, d, e, f, g, h, i, j, k, l, m] = value;
        collect_each(out, fallback, a, b, c, d, e, f, g, h, i, j, k, l, m);
      }
      if constexpr (count == 14) {
        auto const& [a, b, c, d, e, f, g, h, i, j, k, l, m, n] = value;
        collect_each(out, fallback, a, b, c, d, e, f, g, h, i, j, k, l, m, n);
      }
      if constexpr (count == 15) {
        auto const& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o] = value;
        collect_each(out, fallback, a, b, c, d, e, f, g, h, i, j, k, l, m, n, o);
      }
      if constexpr (count == 16) {
        auto const& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p] = value;
        collect_each(out, fallback, a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p);
      }
    }
  }
}

}  // namespace moecomm_emulation::detail
