// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The `simulation_scale` under which a small MLP expert stands for a model's: each factor is the
//! model's size over the stand-in's, computed from both shapes, so the simulated layer moves and
//! computes exactly what the model would. Parameters scale as whole experts, not as H²: the biases
//! grow with H and I only, and a factor of (H_model / H)² would make them larger than the model's.

#include <moecomm/config.hpp>
#include <moecomm/core/simulation_hooks.hpp>
#include <moecomm/error.hpp>

MOECOMM_NAMESPACE_BEGIN

//! An MLP expert H -> I -> H: W1 [H][I], W2 [I][H] and, with `biases`, b1 [I] and b2 [H]; its
//! token rows and parameters have elements of `bytes_per_element`. Sizes are doubles: a model's
//! inner width may be a fraction of H times H.
struct mlp_shape {
  double hidden = 0;             //!< H: a token row's elements
  double inner = 0;              //!< I
  double bytes_per_element = 4;  //!< of token rows and parameters
  bool biases = true;

  [[nodiscard]] double parameters() const { return 2 * hidden * inner + (biases ? inner + hidden : 0); }
  [[nodiscard]] double parameter_bytes() const { return parameters() * bytes_per_element; }
  [[nodiscard]] double row_bytes() const { return hidden * bytes_per_element; }
  //! A row's forward: two GEMMs of 2·H·I FLOPs (the biases' adds are not counted, as the experts'
  //! declared `flops` do not count them).
  [[nodiscard]] double flops_per_row() const { return 4 * hidden * inner; }
};

//! The scale that makes experts of shape `stand_in` stand for experts of shape `model`: token-row
//! bytes, one expert's parameter bytes and a row's FLOPs, each the model's over the stand-in's.
//! @throws error (invalid_argument) naming the first size of either shape that is not positive.
[[nodiscard]] inline simulation_scale mlp_simulation_scale(mlp_shape const& model, mlp_shape const& stand_in) {
  auto const check = [](mlp_shape const& s, char const* which) {
    detail::require(s.hidden > 0 && s.inner > 0 && s.bytes_per_element > 0, "mlp_simulation_scale", which, " {hidden = ",
                    s.hidden, ", inner = ", s.inner, ", bytes_per_element = ", s.bytes_per_element, "} must be positive");
  };
  check(model, "model");
  check(stand_in, "stand_in");
  return {model.row_bytes() / stand_in.row_bytes(), model.parameter_bytes() / stand_in.parameter_bytes(),
          model.flops_per_row() / stand_in.flops_per_row()};
}

MOECOMM_NAMESPACE_END
