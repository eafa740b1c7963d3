// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! `make_expert_parallel_layer`: a layer built from only the policies that differ from the
//! defaults, given as values in any order (as Kokkos takes execution-policy properties), with the
//! communicator deduced from the exchange groups:
//!
//! ```cpp
//! auto layer = moecomm::make_expert_parallel_layer<float>(be, groups, E, H, moecomm::hierarchical_2d{},
//!                                                         moecomm::fastermoe_shadowing<>{model});
//! ```
//!
//! Each policy belongs to one kind, recognised by the traits below (specialise them for a policy
//! of your own): capacity (default `dropless`), all-to-all algorithm (`flat`), weighting
//! (`weighted`), shadowing (`no_shadowing`), `routing_checks` (all on), HybridEP's expert
//! domains (`hybridep{S, ...}`: the layer becomes a `hybridep_layer`, patterns/hybridep.hpp) and
//! replicated experts (`finemoe{placement}`, `flexmoe{placement, {}, {planner}}` or any
//! `replicated<Split, Placement>`: a `replicated_expert_layer`, patterns/replicated_experts.hpp,
//! dropless). Those two run their own
//! exchange, so they take no all-to-all algorithm or shadowing policy. The full
//! positional forms stay; the type of a layer made here is `expert_parallel_layer_of<T, Backend,
//! Comm, Policies...>`.

#include <moecomm/config.hpp>
#include <moecomm/core/routing.hpp>
#include <moecomm/collectives/alltoall.hpp>
#include <moecomm/rows/capacity.hpp>
#include <moecomm/rows/unpermute.hpp>
#include <moecomm/patterns/expert_parallel.hpp>
#include <moecomm/patterns/expert_data_parallel.hpp>
#include <moecomm/patterns/finemoe.hpp>
#include <moecomm/patterns/flexmoe.hpp>
#include <moecomm/patterns/hybridep.hpp>
#include <moecomm/patterns/policy_kinds.hpp>
#include <moecomm/patterns/replicated_experts.hpp>

#include <cstdint>
#include <type_traits>
#include <utility>

MOECOMM_NAMESPACE_BEGIN

//! HybridEP's expert domains (`hybridep`).
template <class P>
struct is_expert_domain_policy : std::is_same<P, hybridep> {};

//! Replicated experts (`replicated<Split, Placement>`: `finemoe`, `flexmoe`).
template <class P>
struct is_replication_policy : std::false_type {};
template <class Split, class Placement>
struct is_replication_policy<replicated<Split, Placement>> : std::true_type {};

namespace detail {

//! How many of `Policies` are of the kind `Is`.
template <template <class...> class Is, class... Policies>
inline constexpr int count_of_kind = (0 + ... + (Is<Policies>::value ? 1 : 0));

//! The policy of kind `Is` among `Policies`, or `Default`.
template <template <class...> class Is, class Default, class... Policies>
struct policy_of {
  using type = Default;
};
template <template <class...> class Is, class Default, class First, class... Rest>
struct policy_of<Is, Default, First, Rest...> {
  using type = std::conditional_t<Is<First>::value, First, typename policy_of<Is, Default, Rest...>::type>;
};
template <template <class...> class Is, class Default, class... Policies>
using policy_of_t = typename policy_of<Is, Default, Policies...>::type;

//! The value of the policy of kind `Is` among `policies`, or `fallback`.
template <template <class...> class Is, class Default>
Default policy_value(Default const& fallback) {
  return fallback;
}
template <template <class...> class Is, class Default, class First, class... Rest>
auto policy_value(Default const& fallback, First const& first, Rest const&... rest) {
  if constexpr (Is<First>::value) return first;
  else return policy_value<Is>(fallback, rest...);
}

template <class Policy>
inline constexpr int kinds_of = is_capacity_policy<Policy>::value + is_alltoall_algorithm<Policy>::value +
                                is_weighting_policy<Policy>::value + is_shadowing_policy<Policy>::value +
                                is_routing_checks<Policy>::value + is_expert_domain_policy<Policy>::value +
                                is_replication_policy<Policy>::value;

//! One static_assert per mistake, naming it.
template <class... Policies>
constexpr bool check_layer_policies() {
  static_assert(((kinds_of<Policies> == 1) && ...),
                "moecomm::make_expert_parallel_layer: an argument after `hidden` is not a layer policy (a capacity "
                "policy, an all-to-all algorithm, weighted/unweighted, a shadowing policy, routing_checks, hybridep or "
                "replicated); "
                "specialise moecomm::is_capacity_policy (or the trait of its kind) for a policy of your own");
  static_assert(count_of_kind<is_capacity_policy, Policies...> <= 1,
                "moecomm::make_expert_parallel_layer: two capacity policies given; name each kind at most once");
  static_assert(count_of_kind<is_alltoall_algorithm, Policies...> <= 1,
                "moecomm::make_expert_parallel_layer: two all-to-all algorithms given; name each kind at most once");
  static_assert(count_of_kind<is_weighting_policy, Policies...> <= 1,
                "moecomm::make_expert_parallel_layer: two weighting policies given; name each kind at most once");
  static_assert(count_of_kind<is_shadowing_policy, Policies...> <= 1,
                "moecomm::make_expert_parallel_layer: two shadowing policies given; name each kind at most once");
  static_assert(count_of_kind<is_routing_checks, Policies...> <= 1,
                "moecomm::make_expert_parallel_layer: routing_checks given twice");
  static_assert(count_of_kind<is_expert_domain_policy, Policies...> <= 1,
                "moecomm::make_expert_parallel_layer: hybridep given twice");
  static_assert(count_of_kind<is_expert_domain_policy, Policies...> == 0 || count_of_kind<is_shadowing_policy, Policies...> == 0,
                "moecomm::make_expert_parallel_layer: hybridep moves experts itself: drop the shadowing policy");
  static_assert(count_of_kind<is_replication_policy, Policies...> <= 1,
                "moecomm::make_expert_parallel_layer: replicated given twice");
  static_assert(count_of_kind<is_replication_policy, Policies...> == 0 ||
                    (count_of_kind<is_shadowing_policy, Policies...> == 0 && count_of_kind<is_capacity_policy, Policies...> == 0 &&
                     count_of_kind<is_expert_domain_policy, Policies...> == 0),
                "moecomm::make_expert_parallel_layer: replicated experts run their own dropless exchange over the replica "
                "slots: drop the capacity policy, the shadowing policy and hybridep");
  return true;
}

}  // namespace detail

//! The layer type `make_expert_parallel_layer<T>(be, groups, E, H, policies...)` returns.
namespace detail {
//! The `replicated<Split, Placement>` among `Policies` (`finemoe` when there is none).
template <class... Policies>
struct replication_of {
  using type = finemoe;
};
template <class First, class... Rest>
struct replication_of<First, Rest...> {
  using type = typename replication_of<Rest...>::type;
};
template <class Split, class Placement, class... Rest>
struct replication_of<replicated<Split, Placement>, Rest...> {
  using type = replicated<Split, Placement>;
};

template <class Replicated>
struct replicated_layer_of;
template <class Split, class Placement>
struct replicated_layer_of<replicated<Split, Placement>> {
  template <class T, class Backend, class Comm, class Weighting, class Algorithm>
  using type = replicated_expert_layer<T, Backend, Comm, Split, Weighting, Placement, Algorithm>;
};

//! `policy.placement`, checked against the layer's expert count.
template <class Split, class Placement>
replica_placement const& placement_for(std::int32_t num_experts, replicated<Split, Placement> const& policy) {
  require(policy.placement.num_experts() == num_experts, "make_expert_parallel_layer", "replicated.placement holds ",
          policy.placement.num_experts(), " experts, num_experts = ", num_experts);
  return policy.placement;
}
}  // namespace detail

template <class T, class Backend, class Comm, class... Policies>
using expert_parallel_layer_of = std::conditional_t<
    (detail::count_of_kind<is_replication_policy, Policies...> > 0),
    typename detail::replicated_layer_of<typename detail::replication_of<Policies...>::type>::template type<
        T, Backend, Comm, detail::policy_of_t<is_weighting_policy, weighted, Policies...>,
        detail::policy_of_t<is_alltoall_algorithm, flat, Policies...>>,
    std::conditional_t<
    (detail::count_of_kind<is_expert_domain_policy, Policies...> > 0),
    hybridep_layer<T, Backend, Comm, detail::policy_of_t<is_capacity_policy, dropless, Policies...>,
                   detail::policy_of_t<is_weighting_policy, weighted, Policies...>,
                   detail::policy_of_t<is_alltoall_algorithm, flat, Policies...>>,
    expert_parallel_layer<T, Backend, Comm, detail::policy_of_t<is_capacity_policy, dropless, Policies...>,
                          detail::policy_of_t<is_alltoall_algorithm, flat, Policies...>,
                          detail::policy_of_t<is_weighting_policy, weighted, Policies...>,
                          detail::policy_of_t<is_shadowing_policy, no_shadowing, Policies...>>>>;

//! An expert-parallel layer of element type `T` with the given policies, in any order, each kind
//! at most once; every kind not named takes its default. Collective (as the constructor).
template <class T, class Backend, class Comm, class... Policies>
[[nodiscard]] expert_parallel_layer_of<T, Backend, Comm, Policies...> make_expert_parallel_layer(
    Backend be, exchange_groups<Comm>& groups, std::int32_t num_experts, std::int64_t hidden, Policies const&... policies) {
  static_assert(detail::check_layer_policies<Policies...>());
  if constexpr (detail::count_of_kind<is_replication_policy, Policies...> > 0) {
    auto const& policy = detail::policy_value<is_replication_policy>(finemoe{replica_placement::contiguous(1, 1)}, policies...);
    return {std::move(be), groups, detail::placement_for(num_experts, policy), hidden, policy.split,
            detail::policy_value<is_routing_checks>(routing_checks{}, policies...), policy.rebalancing, policy.gradients,
            detail::policy_value<is_alltoall_algorithm>(flat{}, policies...)};
  } else if constexpr (detail::count_of_kind<is_expert_domain_policy, Policies...> > 0)
    return {std::move(be),
            groups,
            num_experts,
            hidden,
            detail::policy_value<is_expert_domain_policy>(hybridep{}, policies...),
            detail::policy_value<is_capacity_policy>(dropless{}, policies...),
            detail::policy_value<is_routing_checks>(routing_checks{}, policies...),
            detail::policy_value<is_alltoall_algorithm>(flat{}, policies...)};
  else
    return {std::move(be),
          groups,
          num_experts,
          hidden,
          detail::policy_value<is_capacity_policy>(dropless{}, policies...),
          detail::policy_value<is_alltoall_algorithm>(flat{}, policies...),
          detail::policy_value<is_routing_checks>(routing_checks{}, policies...),
          detail::policy_value<is_shadowing_policy>(no_shadowing{}, policies...)};
}

MOECOMM_NAMESPACE_END
