// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `detail::layer_steps`, held by `detail::layer_mode` (the layers' base): a layer's count of
//! forwards begun, the step its calls' collectives are checked under (comm/detail/call_identity.hpp),
//! and its mode. In training mode (the default) every forward must get its backward before the next
//! forward: a forgotten backward would otherwise run on silently with stale gradients. In inference mode (`set_training(false)`)
//! forwards follow each other and a backward is an error.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <cstdint>

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

//! The mode every layer offers, and the step count behind it: the layers derive from it.
class layer_mode {
 public:
  //! Training mode (the default): every forward needs its backward before the next forward, or the
  //! next forward throws `invalid_usage` naming both steps. Inference mode (`false`): forwards follow
  //! each other, and a backward is an error. Local: set it alike on every rank.
  void set_training(bool on) { steps_.set_training(on); }
  [[nodiscard]] bool training() const { return steps_.training(); }
  //! Forwards begun so far (the step of the last forward, when it succeeded).
  [[nodiscard]] std::int64_t step() const { return steps_.step(); }

 protected:
  layer_steps steps_;  //!< forwards begun (the step the layer's calls are checked under) and the mode
};

}  // namespace detail
MOECOMM_NAMESPACE_END
