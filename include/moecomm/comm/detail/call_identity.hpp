// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The user's call a collective belongs to: "hybridep_layer::forward, step 12". A layer's public
//! calls set it on their world communicator for their duration (`call_scope`); the communicators that
//! compare calls across ranks (in-process, simulated, MPI in its checked mode) compare it too, so
//! that ranks in different calls or steps are stopped at their first collective, with an error that
//! names the user's calls instead of internal collectives, and a retry after a caught error cannot
//! pair with a peer's leftover calls of the failed step.
//!
//! The identity is held by the communicator, shared with the communicators split from it on the
//! same rank (a layer's sub-groups), not by a thread: simulated ranks share one thread. A lane's
//! copy (`split_for`) keeps the value it was split with, since its thread runs while the rank's
//! thread moves on to its next call.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! A layer's call: its name (a string literal, "hybridep_layer::forward") and the layer's step.
struct call_identity {
  char const* name = nullptr;  //!< null: outside any layer call
  std::int64_t step = 0;
  std::int64_t code = 0;  //!< `call_names::code(name)`, computed once per layer call (MPI sends it)
};

[[nodiscard]] inline bool same_call(call_identity const& a, call_identity const& b) {
  if (a.name == nullptr || b.name == nullptr) return a.name == b.name;
  return a.step == b.step && std::strcmp(a.name, b.name) == 0;
}

//! " in hybridep_layer::forward (step 12)", or "" outside a layer call.
[[nodiscard]] inline std::string describe_call(call_identity const& c) {
  return c.name == nullptr ? std::string() : concat(" in ", c.name, " (step ", c.step, ")");
}

//! A 63-bit code of a call's name, for communicators that compare numbers (MPI), and the name back
//! from a code this process has seen (every rank runs the same program, so it has seen its peers').
class call_names {
 public:
  [[nodiscard]] static std::int64_t code(char const* name) {
    if (name == nullptr) return 0;
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (char const* c = name; *c != '\0'; ++c) h = (h ^ static_cast<unsigned char>(*c)) * 1099511628211ull;
    std::int64_t const k = static_cast<std::int64_t>(h >> 1) | 1;
    std::lock_guard<std::mutex> const hold(table().lock);
    table().names.try_emplace(k, name);  // no node made for a name already known: repeated calls allocate nothing
    return k;
  }
  [[nodiscard]] static std::string name(std::int64_t code) {
    if (code == 0) return {};
    std::lock_guard<std::mutex> const hold(table().lock);
    auto const it = table().names.find(code);
    return it == table().names.end() ? concat("layer call #", code) : std::string(it->second);
  }

 private:
  struct registry {
    std::mutex lock;
    std::map<std::int64_t, char const*> names;
  };
  static registry& table() {
    static registry r;
    return r;
  }
};

template <class Comm, class = void>
struct has_call_identity : std::false_type {};
template <class Comm>
struct has_call_identity<Comm, std::void_t<decltype(std::declval<Comm&>().set_call(call_identity{}))>> : std::true_type {};

//! Sets `comm`'s call identity (and that of its sub-groups on this rank) for the scope's lifetime,
//! then restores the one before. A no-op for a communicator without one (NCCL: it compares nothing).
template <class Comm>
class call_scope {
 public:
  call_scope(Comm& comm, char const* name, std::int64_t step) : comm_(comm) {
    if constexpr (has_call_identity<Comm>::value) {
      saved_ = comm.current_call();
      comm.set_call({name, step, call_names::code(name)});
    }
  }
  call_scope(call_scope const&) = delete;
  call_scope& operator=(call_scope const&) = delete;
  ~call_scope() {
    if constexpr (has_call_identity<Comm>::value) comm_.set_call(saved_);
  }

 private:
  Comm& comm_;
  call_identity saved_;
};

//! The identity a communicator holds: shared with its same-rank splits, or detached (a lane's copy).
class call_identity_holder {
 public:
  call_identity_holder() : shared_(std::make_shared<call_identity>()) {}
  [[nodiscard]] call_identity current() const { return *shared_; }
  void set(call_identity c) { *shared_ = c; }
  //! From now on a copy of its own, with the current value.
  void detach() { shared_ = std::make_shared<call_identity>(*shared_); }

 private:
  std::shared_ptr<call_identity> shared_;
};

}  // namespace detail
MOECOMM_NAMESPACE_END
