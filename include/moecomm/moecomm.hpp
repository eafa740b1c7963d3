// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Everything a host compiler can build without another library: vocabulary, the host back-end, the
//! in-process communicator, the ops, every pattern and its planners. The other back-ends and
//! communicators (CUDA, NCCL, MPI, SimGrid, c10d) and the torch component have their own headers.

#include <moecomm/config.hpp>
#include <moecomm/error.hpp>
#include <moecomm/version.hpp>

#include <moecomm/core/array_view.hpp>
#include <moecomm/core/buffer.hpp>
#include <moecomm/core/dtype.hpp>
#include <moecomm/core/expert_domains.hpp>
#include <moecomm/core/matrix.hpp>
#include <moecomm/core/optional_output.hpp>
#include <moecomm/core/placement.hpp>
#include <moecomm/core/replica_placement.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/core/step_bounds.hpp>
#include <moecomm/core/topology.hpp>
#include <moecomm/core/workspace.hpp>

#include <moecomm/backend/host.hpp>

#include <moecomm/comm/communicator.hpp>
#include <moecomm/comm/inproc.hpp>
#include <moecomm/comm/parallel_groups.hpp>

#include <moecomm/ops/alltoall.hpp>
#include <moecomm/ops/capacity.hpp>
#include <moecomm/ops/dispatch_layout.hpp>
#include <moecomm/ops/dispatcher.hpp>
#include <moecomm/ops/expert_codec.hpp>
#include <moecomm/ops/gradient_reduce.hpp>
#include <moecomm/ops/ordered_allreduce.hpp>
#include <moecomm/ops/permute.hpp>
#include <moecomm/ops/permute_plan.hpp>
#include <moecomm/ops/replica/replica_set.hpp>
#include <moecomm/ops/replica_broadcast.hpp>
#include <moecomm/ops/replica_migration.hpp>
#include <moecomm/ops/router/router.hpp>
#include <moecomm/ops/sort_chunks.hpp>
#include <moecomm/ops/unpermute.hpp>
#include <moecomm/ops/validate_routing.hpp>

#include <moecomm/patterns/expert_parallel.hpp>
#include <moecomm/patterns/expert_data_parallel.hpp>
#include <moecomm/patterns/experts.hpp>
#include <moecomm/patterns/fastermoe.hpp>
#include <moecomm/patterns/finemoe.hpp>
#include <moecomm/patterns/flexmoe.hpp>
#include <moecomm/patterns/hybridep.hpp>
#include <moecomm/patterns/parm.hpp>
#include <moecomm/patterns/replicated_experts.hpp>
#include <moecomm/patterns/block_schedule.hpp>
#include <moecomm/patterns/layer_policies.hpp>
#include <moecomm/measure/calibration.hpp>
#include <moecomm/plan/cost_model.hpp>
#include <moecomm/plan/exchange_adviser.hpp>
#include <moecomm/plan/flexmoe_planner.hpp>
#include <moecomm/plan/iteration_model.hpp>
#include <moecomm/plan/link_model.hpp>
#include <moecomm/plan/pattern_adviser.hpp>
#include <moecomm/plan/hybridep_layout_model.hpp>
#include <moecomm/plan/hybridep_planner.hpp>
#include <moecomm/plan/parm_cost_model.hpp>
#include <moecomm/plan/proprophet_cost_model.hpp>
#include <moecomm/plan/proprophet_planner.hpp>
#include <moecomm/plan/replica_assignment.hpp>
#include <moecomm/plan/replica_schedule.hpp>
#include <moecomm/plan/shadow_selection.hpp>
