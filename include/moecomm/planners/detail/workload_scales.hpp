// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The scales of a cost model made for a layer whose row bytes, parameter bytes and FLOPs are
//! multiples of those its shape gives (a simulated back-end's `simulation_scale`: the layer hands
//! the model its real rows, the simulation prices the model-sized ones). `parm_cost_model::scaled`
//! and `hybridep_planner::scaled` multiply them alike.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>

#include <cmath>

MOECOMM_NAMESPACE_BEGIN
namespace detail {

struct workload_scales {
  double token_bytes = 1, parameter_bytes = 1, flops = 1;

  //! These scales multiplied by `token_bytes`, `parameter_bytes` and `flops`.
  //! @throws error (invalid_argument), from `owner` ("hybridep_planner"), naming the first factor
  //! that is not finite and positive.
  [[nodiscard]] workload_scales times(char const* owner, double token_bytes_factor, double parameter_bytes_factor,
                                      double flops_factor) const {
    require_factor(owner, "token_bytes scale", token_bytes_factor);
    require_factor(owner, "parameter_bytes scale", parameter_bytes_factor);
    require_factor(owner, "flops scale", flops_factor);
    return {token_bytes * token_bytes_factor, parameter_bytes * parameter_bytes_factor, flops * flops_factor};
  }

 private:
  static void require_factor(char const* owner, char const* name, double value) {
    require(std::isfinite(value) && value > 0, owner, name, " = ", value, " must be finite and positive");
  }
};

}  // namespace detail
MOECOMM_NAMESPACE_END
