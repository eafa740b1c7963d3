// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The user's call a collective belongs to: "hybridep_layer::forward of layer 2, step 12". A layer's
//! public calls set it on their world communicator for their duration (`call_scope`); the
//! communicators that compare calls across ranks (in-process, simulated, MPI and c10d in their
//! checked mode) compare it too, so that ranks in different calls, layers or steps are stopped at
//! their first collective, with an error that names the user's calls instead of internal
//! collectives, and a retry after a caught error cannot pair with a peer's leftover calls of the
//! failed step. Layers are numbered by their construction on the communicator (1, 2, ...; its
//! same-rank splits count with it), which every rank does in the same order: two layers of one type
//! called in a different order on one rank differ in their number.
//!
//! The identity is held by the communicator, shared with the communicators split from it on the
//! same rank (a layer's sub-groups), not by a thread: simulated ranks share one thread. A lane's
//! copy (`split_for`) keeps the value it was split with, since its thread runs while the rank's
//! thread moves on to its next call.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

//! The layers' public calls that communicate. Numbers, not strings, so that a process can name a
//! peer's call it has not made itself (MPI and c10d compare them as numbers).
enum class layer_call : std::int64_t {
  none = 0,
  expert_parallel_forward,
  expert_parallel_backward,
  expert_parallel_begin_replica_transfer,
  hybridep_forward,
  hybridep_backward,
  hybridep_begin_expert_gather,
  hybridep_refresh_shared_expert,
  replicated_forward,
  replicated_backward,
  replicated_move_replicas,
  parm_forward,
  parm_backward,
};

//! "expert_parallel_layer::forward", or "layer call #N" for a number this build does not know.
[[nodiscard]] inline std::string name_of(std::int64_t call) {
  static char const* const names[] = {"(no layer call)",
                                      "expert_parallel_layer::forward",
                                      "expert_parallel_layer::backward",
                                      "expert_parallel_layer::begin_replica_transfer",
                                      "hybridep_layer::forward",
                                      "hybridep_layer::backward",
                                      "hybridep_layer::begin_expert_gather",
                                      "hybridep_layer::refresh_shared_expert",
                                      "replicated_expert_layer::forward",
                                      "replicated_expert_layer::backward",
                                      "replicated_expert_layer::move_replicas",
                                      "parm_layer::forward",
                                      "parm_layer::backward"};
  constexpr std::int64_t known = static_cast<std::int64_t>(sizeof(names) / sizeof(names[0]));
  return call >= 0 && call < known ? std::string(names[call]) : concat("layer call #", call);
}
[[nodiscard]] inline std::string name_of(layer_call call) { return name_of(static_cast<std::int64_t>(call)); }

//! A layer's call: which, the layer's number on its communicator, and the layer's step.
struct call_identity {
  layer_call call = layer_call::none;  //!< none: outside any layer call
  std::int64_t layer = 0;
  std::int64_t step = 0;
};

[[nodiscard]] inline bool same_call(call_identity const& a, call_identity const& b) {
  if (a.call == layer_call::none || b.call == layer_call::none) return a.call == b.call;
  return a.call == b.call && a.layer == b.layer && a.step == b.step;
}

//! " in hybridep_layer::forward of layer 2 (step 12)", or "" outside a layer call, from the numbers.
[[nodiscard]] inline std::string describe_call(std::int64_t call, std::int64_t layer, std::int64_t step) {
  return call == 0 ? std::string() : concat(" in ", name_of(call), " of layer ", layer, " (step ", step, ")");
}
[[nodiscard]] inline std::string describe_call(call_identity const& c) {
  return describe_call(static_cast<std::int64_t>(c.call), c.layer, c.step);
}
//! `describe_call`, or " outside any layer call".
[[nodiscard]] inline std::string where_called(std::int64_t call, std::int64_t layer, std::int64_t step) {
  return call == 0 ? std::string(" outside any layer call") : describe_call(call, layer, step);
}
[[nodiscard]] inline std::string where_called(call_identity const& c) {
  return where_called(static_cast<std::int64_t>(c.call), c.layer, c.step);
}

template <class Comm, class = void>
struct has_call_identity : std::false_type {};
template <class Comm>
struct has_call_identity<Comm, std::void_t<decltype(std::declval<Comm&>().set_call(call_identity{}))>> : std::true_type {};

//! The number of a layer made now on `comm` (collective order: every rank makes its layers in the
//! same order); 0 on a communicator that compares no calls (NCCL).
template <class Comm>
[[nodiscard]] std::int64_t number_layer(Comm& comm) {
  if constexpr (has_call_identity<Comm>::value) return comm.number_layer();
  else return 0;
}

//! Sets `comm`'s call identity (and that of its sub-groups on this rank) for the scope's lifetime,
//! then restores the one before. A no-op for a communicator without one (NCCL: it compares nothing).
template <class Comm>
class call_scope {
 public:
  call_scope(Comm& comm, layer_call call, std::int64_t layer, std::int64_t step) : comm_(comm) {
    if constexpr (has_call_identity<Comm>::value) {
      saved_ = comm.current_call();
      comm.set_call({call, layer, step});
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

//! The identity a communicator holds: shared with its same-rank splits, or detached (a lane's
//! copy); and the count of layers made on it and its same-rank splits.
class call_identity_holder {
 public:
  call_identity_holder() : shared_(std::make_shared<call_identity>()), layers_(std::make_shared<std::int64_t>(0)) {}
  [[nodiscard]] call_identity current() const { return *shared_; }
  void set(call_identity c) { *shared_ = c; }
  //! From now on a copy of its own, with the current value.
  void detach() { shared_ = std::make_shared<call_identity>(*shared_); }
  //! The next layer's number (1, 2, ...).
  [[nodiscard]] std::int64_t number_layer() { return ++*layers_; }

 private:
  std::shared_ptr<call_identity> shared_;
  std::shared_ptr<std::int64_t> layers_;
};

}  // namespace detail
MOECOMM_NAMESPACE_END
