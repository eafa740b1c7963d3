// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `detail::layer_steps`, held by `detail::layer_mode` (the layers' base): a layer's count of
//! forwards begun, the step its calls' collectives are checked under (comm/detail/call_identity.hpp),
//! and its mode. In training mode (the default) every forward must get its backward before the next
//! forward: a forgotten backward would otherwise run on silently with stale gradients. In inference mode (`set_training(false)`)
//! forwards follow each other and a backward is an error.

#include <moecomm/comm/detail/call_identity.hpp>
#include <moecomm/comm/world_agreement.hpp>
#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <cstdint>
#include <vector>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

class layer_steps {
 public:
  //! At a forward's start (`op`, e.g. "expert_parallel_layer::forward"): the step it begins, counted
  //! even when it is refused, so that a rank that refuses a step keeps the step numbers of the ranks
  //! that did not (and its next forward pairs with theirs, not with their previous step).
  //! @throws error (invalid_usage) in training mode when the last forward has had no backward.
  std::int64_t begin_forward(char const* op) {
    ++step_;
    if (training_ && awaiting_backward_)
      fail(status::invalid_usage, op, "called for step ", step_, ", but step ", last_forward_,
           "'s forward has had no backward: in training mode every forward needs its backward (on every rank) "
           "before the next forward; call backward, or set_training(false) for forwards without one (inference)");
    return step_;
  }
  //! After a forward succeeded.
  void forward_done() {
    last_forward_ = step_;
    awaiting_backward_ = training_;
  }
  //! At a backward's start: the step of the forward it belongs to (the last that succeeded).
  //! @throws error (invalid_usage) in inference mode.
  std::int64_t begin_backward(char const* op) {
    if (!training_)
      fail(status::invalid_usage, op,
           "called in inference mode (set_training(false)), where forwards expect no backward; call "
           "set_training(true) before the forward whose backward you need");
    awaiting_backward_ = false;
    return last_forward_;
  }
  //! At a `reserve`: refused between a forward and its backward in training mode, since reserving
  //! re-plans for the largest step and drops the routing the backward needs.
  //! @throws error (invalid_usage) naming the forward's step.
  void check_reserve(char const* op) const {
    if (training_ && awaiting_backward_)
      fail(status::invalid_usage, op, "called between step ", last_forward_, "'s forward and its backward: reserving re-plans "
           "for the largest step and drops the routing the backward needs; reserve before a forward or after its backward");
  }
  //! Forwards begun so far.
  [[nodiscard]] std::int64_t step() const { return step_; }
  [[nodiscard]] bool training() const { return training_; }
  void set_training(bool on) {
    training_ = on;
    awaiting_backward_ = false;
  }

 private:
  std::int64_t step_ = 0, last_forward_ = 0;
  bool training_ = true;
  bool awaiting_backward_ = false;
};

//! The mode every layer offers, the step count behind it, and the layer's number on its world
//! communicator (comm/detail/call_identity.hpp): the layers derive from it.
class layer_mode {
 public:
  //! Training mode (the default): every forward needs its backward before the next forward, or the
  //! next forward throws `invalid_usage` naming both steps. Inference mode (`false`): forwards follow
  //! each other, and a backward is an error. Local: set it alike on every rank.
  void set_training(bool on) { steps_.set_training(on); }
  [[nodiscard]] bool training() const { return steps_.training(); }
  //! Forwards begun so far (the step of the last forward, when it succeeded).
  [[nodiscard]] std::int64_t step() const { return steps_.step(); }
  //! The layer's number on its world communicator: 1, 2, ... in the order layers are made on it
  //! (0 on a communicator that compares no calls). Its calls' collectives are checked under it.
  [[nodiscard]] std::int64_t layer_number() const { return number_; }

 protected:
  //! Numbers the layer `kind` ("hybridep_layer") made on `world`, and checks that every rank makes
  //! the same kind of layer under that number. Collective over `world`.
  //! @throws error (invalid_usage) naming both ranks' layers when they differ.
  template <class Comm>
  layer_mode(Comm& world, char const* kind) : number_(number_layer(world)) {
    std::vector<std::int64_t> all;
    agree_on_text(world, kind, "on the layer they make (layers are numbered in the order they are made on a communicator)",
                  concat("layer ", number_, ": ", kind), all);
  }
  //! The identity of this layer's call `call` of step `step`, for `call_scope`.
  template <class Comm>
  [[nodiscard]] call_scope<Comm> scope(Comm& world, layer_call call, std::int64_t step) const {
    return call_scope<Comm>(world, call, number_, step);
  }

  layer_steps steps_;  //!< forwards begun (the step the layer's calls are checked under) and the mode

 private:
  std::int64_t number_;
};

}  // namespace detail
MOECOMM_NAMESPACE_END
