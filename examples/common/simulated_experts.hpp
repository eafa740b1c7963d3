// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The experts of an example on a simulated cluster: MLPs H -> ratio*H -> H that really compute in
//! fp32 at a small H, standing for the model's H_model -> ratio*H_model -> H_model, whose bytes and
//! FLOPs the simulated back-end charges (`simulation_scale`); and every expert's initial values,
//! made once before any rank runs so that every variant starts from the same ones.

#include "mlp_experts.hpp"
#include "simulated_options.hpp"

#include <moecomm/core/mlp_simulation_scale.hpp>

#include <cstdint>
#include <vector>

namespace example_support {

struct simulated_experts {
  std::int64_t inner = 0;                      //!< the real experts' inner width, ratio * H
  moecomm::mlp_shape model;                    //!< the experts they stand for
  moecomm::simulation_scale scale;             //!< model / real
  std::vector<std::vector<float>> parameters;  //!< [E][parameter count]: every expert's initial values
};

//! Experts 0..count-1, `mlp_initial_parameters(seed, hidden, inner, e)` each.
inline std::vector<std::vector<float>> initial_parameters_of(std::uint64_t seed, std::int64_t hidden, std::int64_t inner,
                                                             std::int32_t count) {
  std::vector<std::vector<float>> all;
  for (std::int32_t e = 0; e < count; ++e) all.push_back(mlp_initial_parameters(seed, hidden, inner, e));
  return all;
}

//! `count` experts of inner width `ratio` times the hidden size, the model's in `model_bytes` per element.
inline simulated_experts make_simulated_experts(simulated_options const& o, std::int32_t ratio, double model_bytes,
                                                std::int32_t count) {
  simulated_experts x;
  x.inner = ratio * o.hidden;
  x.model = {static_cast<double>(o.model_hidden), static_cast<double>(ratio * o.model_hidden), model_bytes};
  x.scale = moecomm::mlp_simulation_scale(x.model, {static_cast<double>(o.hidden), static_cast<double>(x.inner), sizeof(float)});
  x.parameters = initial_parameters_of(o.seed, o.hidden, x.inner, count);
  return x;
}

}  // namespace example_support
