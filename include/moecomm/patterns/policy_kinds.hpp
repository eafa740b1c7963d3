// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The kinds of the expert-parallel layer's policies, as traits (specialise one for a policy of your
//! own): capacity, all-to-all algorithm, weighting, shadowing, routing checks. The positional form
//! `expert_parallel_layer<T, Backend, Comm, Capacity, Algorithm, Weighting, Shadowing>` checks each
//! argument's kind with them; `make_expert_parallel_layer` (patterns/layer_policies.hpp) sorts
//! policies given in any order by them.

#include <moecomm/config.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/collectives/alltoall.hpp>
#include <moecomm/rows/capacity.hpp>
#include <moecomm/rows/unpermute.hpp>

#include <type_traits>

MOECOMM_NAMESPACE_BEGIN

//! Capacity policies: `dropless`, `capacity<rule>`, `receiver_budget`.
template <class P>
struct is_capacity_policy : std::bool_constant<detail::is_dropless_v<P> || detail::is_receiver_budget_v<P>> {};
template <class Rule>
struct is_capacity_policy<capacity<Rule>> : std::true_type {};

//! All-to-all algorithms: `flat`, `hierarchical_2d`, `pairwise`, `smart_schedule`, `dedup_per_rank<...>`, `dedup_per_node`.
template <class P>
struct is_alltoall_algorithm : std::bool_constant<std::is_same_v<P, flat> || std::is_same_v<P, hierarchical_2d> ||
                                                  std::is_same_v<P, pairwise> || std::is_same_v<P, smart_schedule> ||
                                                  detail::is_dedup_v<P>> {};

//! Weighting policies: `weighted`, `unweighted`.
template <class P>
struct is_weighting_policy : std::bool_constant<std::is_same_v<P, weighted> || std::is_same_v<P, unweighted>> {};

//! Shadowing policies: any type with a `static constexpr bool shadows` (`no_shadowing`,
//! `fastermoe_shadowing<...>`).
template <class P, class = void>
struct is_shadowing_policy : std::false_type {};
template <class P>
struct is_shadowing_policy<P, std::void_t<decltype(P::shadows)>> : std::true_type {};

//! The routing value scans.
template <class P>
struct is_routing_checks : std::is_same<P, routing_checks> {};

namespace detail {

//! True when `P` (const or not: `decltype` of a const policy) is of the kind `Is`.
template <template <class...> class Is, class P>
inline constexpr bool is_kind = Is<std::remove_cv_t<P>>::value;

//! `P` when it is of the kind `Is`, else `Default`: a layer given a policy of the wrong kind in a
//! position builds with the default there, so that its static_assert is the only error.
template <template <class...> class Is, class P, class Default>
using policy_or_default_t = std::conditional_t<is_kind<Is, P>, P, Default>;

//! `policy` when it is of the kind the position takes, else that kind's default.
template <class Wanted, class Given>
Wanted policy_or_default(Given const& policy) {
  if constexpr (std::is_same_v<std::remove_cv_t<Wanted>, std::remove_cv_t<Given>>) return policy;
  else return Wanted{};
}

}  // namespace detail

MOECOMM_NAMESPACE_END
