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

#include <moecomm/collectives/alltoall.hpp>
#include <moecomm/rows/capacity.hpp>
#include <moecomm/dispatch/dispatch_layout.hpp>
#include <moecomm/dispatch/dispatcher.hpp>
#include <moecomm/collectives/expert_codec.hpp>
#include <moecomm/collectives/gradient_reduce.hpp>
#include <moecomm/collectives/ordered_allreduce.hpp>
#include <moecomm/rows/permute.hpp>
#include <moecomm/rows/permute_plan.hpp>
#include <moecomm/collectives/replica_set.hpp>
#include <moecomm/collectives/replica_broadcast.hpp>
#include <moecomm/collectives/replica_migration.hpp>
#include <moecomm/rows/router/router.hpp>
#include <moecomm/rows/sort_chunks.hpp>
#include <moecomm/rows/unpermute.hpp>
#include <moecomm/rows/validate_routing.hpp>

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
#include <moecomm/models/calibration.hpp>
#include <moecomm/planners/fastermoe_cost_model.hpp>
#include <moecomm/models/exchange_adviser.hpp>
#include <moecomm/planners/flexmoe_planner.hpp>
#include <moecomm/models/iteration_model.hpp>
#include <moecomm/models/link_model.hpp>
#include <moecomm/models/pattern_adviser.hpp>
#include <moecomm/models/hybridep_layout_model.hpp>
#include <moecomm/planners/hybridep_planner.hpp>
#include <moecomm/models/parm_cost_model.hpp>
#include <moecomm/planners/proprophet_cost_model.hpp>
#include <moecomm/planners/proprophet_planner.hpp>
#include <moecomm/planners/replica_assignment.hpp>
#include <moecomm/planners/replica_schedule.hpp>
#include <moecomm/planners/shadow_selection.hpp>
