// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `detail::agree_on`: the ranks of a group compare a few numbers (a layer's configuration at
//! construction, on every communicator). `detail::agree_across_world`: before an operation splits
//! its work over sub-groups, the ranks of the whole group compare a few numbers that decide which
//! sub-group calls they will make. Ranks that
//! disagree would otherwise wait in different sub-groups until the timeout (after which an MPI
//! communicator is unusable); this way every rank throws the same `invalid_usage` at once.
//!
//! It costs one all-gather of a few `int64` on the whole group, and runs only on a communicator with
//! `checks_collectives()` true (in-process always; MPI in its checked mode). It needs host buffers,
//! so it is skipped on the NCCL communicator, which has no `checks_collectives()`.

#include <moecomm/comm/communicator.hpp>
#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

template <class Comm, class = void>
struct has_checks_collectives : std::false_type {};
template <class Comm>
struct has_checks_collectives<Comm, std::void_t<decltype(std::declval<Comm const&>().checks_collectives())>>
    : std::true_type {};

//! True if `comm` compares calls across ranks (and takes host buffers for it).
template <class Comm>
[[nodiscard]] bool checks_collectives(Comm const& comm) {
  if constexpr (has_checks_collectives<Comm>::value) return comm.checks_collectives();
  else return false;
}

//! Every rank of `world` passes the same `values` (named by `names`), or every rank throws
//! `error(invalid_usage)` from `op`, saying what they disagree on (`what`, e.g. "on the layer's
//! configuration") and naming two ranks and their values. `Value` is `std::int64_t` or `double`
//! (compared bit for bit, printed to 17 digits). Collective over `world`, on any communicator
//! (`allgather_host`). `all` receives the gathered values: the caller keeps it, so a steady state
//! allocates nothing (a thread_local would be shared by simulated ranks, which run on one thread
//! and yield inside the all-gather).
template <class Comm, class Value, std::size_t N>
void agree_on(Comm& world, char const* op, char const* what, char const* const (&names)[N], Value const (&values)[N],
              std::vector<Value>& all) {
  static_assert(std::is_same_v<Value, std::int64_t> || std::is_same_v<Value, double>);
  all.resize(N * static_cast<std::size_t>(world.size()));
  allgather_host(world, values, all.data(), static_cast<std::int64_t>(sizeof(values)));
  auto const describe = [&](int r) {
    std::ostringstream fields;
    fields.precision(17);
    for (std::size_t i = 0; i < N; ++i) fields << (i > 0 ? ", " : "") << names[i] << " " << all[static_cast<std::size_t>(r) * N + i];
    return concat("rank ", r, " has (", fields.str(), ")");
  };
  for (int r = 1; r < world.size(); ++r)
    for (std::size_t i = 0; i < N; ++i)
      if (std::memcmp(&all[static_cast<std::size_t>(r) * N + i], &all[i], sizeof(Value)) != 0)
        fail(status::invalid_usage, op, "ranks disagree ", what, ": ", describe(0), ", but ", describe(r),
             " (ranks of the whole group; they differ in ", names[i], ")");
}

//! Every rank of `world` passes the same `text` (at most `agreed_text_words * 8` characters: a
//! pattern's, an algorithm's or a layer's name), or every rank throws `error(invalid_usage)` from
//! `op`: "ranks disagree on <what>: rank 0 has 'flat', but rank 2 has 'pairwise'". Collective over
//! `world`, on any communicator; `all` as `agree_on`'s.
constexpr std::size_t agreed_text_words = 8;
template <class Comm>
void agree_on_text(Comm& world, char const* op, char const* what, std::string const& text, std::vector<std::int64_t>& all) {
  constexpr std::size_t bytes = agreed_text_words * sizeof(std::int64_t);
  require(text.size() <= bytes, op, "'", text, "' is longer than the ", bytes, " characters ranks compare");
  std::int64_t mine[agreed_text_words] = {};
  std::memcpy(mine, text.data(), text.size());
  all.resize(agreed_text_words * static_cast<std::size_t>(world.size()));
  allgather_host(world, mine, all.data(), static_cast<std::int64_t>(sizeof(mine)));
  auto const text_of = [&](int r) {
    char const* const c = reinterpret_cast<char const*>(all.data() + static_cast<std::size_t>(r) * agreed_text_words);
    return std::string(c, strnlen(c, bytes));
  };
  for (int r = 1; r < world.size(); ++r)
    if (text_of(r) != text_of(0))
      fail(status::invalid_usage, op, "ranks disagree ", what, ": rank 0 has '", text_of(0), "', but rank ", r, " has '",
           text_of(r), "' (ranks of the whole group)");
}

//! `agree_on` before an operation's sub-group phases, on a communicator that checks its
//! collectives (the others skip it: the check is per step, and NCCL's would cost a host wait).
template <class Comm, std::size_t N>
void agree_across_world(Comm& world, char const* op, char const* const (&names)[N], std::int64_t const (&values)[N],
                        std::vector<std::int64_t>& all) {
  if (checks_collectives(world)) agree_on(world, op, "before the sub-group phases", names, values, all);
}

}  // namespace detail
MOECOMM_NAMESPACE_END
