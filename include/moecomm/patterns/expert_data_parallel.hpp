// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Expert parallelism inside each domain (the topology's third level: a data centre, a group of
//! nodes), the experts data-parallel across the domains, as one policy of the layer. Every domain
//! holds every expert once (`replica_placement::per_domain`), each rank's tokens go to its own
//! domain's replica (`domain_split`), so no token leaves its domain, and every step each expert's
//! gradient is all-reduced over its replicas, one per domain, in ascending rank
//! (`replica_gradients::left_to_trainer` leaves that to the trainer's own expert-DP reduction).
//!
//! ```cpp
//! auto const placement = moecomm::replica_placement::per_domain(R, slots_per_rank, ranks_per_domain);
//! auto layer = moecomm::make_expert_parallel_layer<float>(be, groups, E, H, moecomm::expert_data_parallel{placement});
//! ```
//!
//! It is Megatron-LM's EP × expert-DP layout, and HybridEP's strongest baseline across data centres.
//! The layer is a `replicated_expert_layer<T, Backend, Comm, domain_split>`
//! (patterns/replicated_experts.hpp): outputs and gradients equal plain expert parallelism's bit for
//! bit. Its cost beside a hand-built composition (plain EP on each domain's communicator and one
//! all-reduce of every expert's gradient, as bench_hybridep's `ep_dc_dp`): it all-gathers the counts
//! over the world, across the slow links (6 % of the step there at 6 MB), and, with gradients
//! summed here, all-reduces one expert at a time.

#include <moecomm/patterns/replicated_experts.hpp>

MOECOMM_NAMESPACE_BEGIN

//! Static placement, each rank's tokens to its own domain's replica: `expert_data_parallel{placement}`.
using expert_data_parallel = replicated<domain_split, static_placement>;

MOECOMM_NAMESPACE_END
