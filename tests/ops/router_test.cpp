// SPDX-License-Identifier: Apache-2.0
// The router's test bodies (router_cases.hpp) on the serial and two-thread host back-ends.

#include "router_cases.hpp"

namespace test {

#define MOECOMM_ROUTER_CONFIGS host_config<float, 1>, host_config<float, 2>
TEST_CASE_TEMPLATE_INVOKE(router_sweep, MOECOMM_ROUTER_CONFIGS);
TEST_CASE_TEMPLATE_INVOKE(router_finite_differences, MOECOMM_ROUTER_CONFIGS);
TEST_CASE_TEMPLATE_INVOKE(router_example, MOECOMM_ROUTER_CONFIGS);
TEST_CASE_TEMPLATE_INVOKE(router_errors, MOECOMM_ROUTER_CONFIGS);
TEST_CASE_TEMPLATE_INVOKE(router_unchecked, MOECOMM_ROUTER_CONFIGS);
TEST_CASE_TEMPLATE_INVOKE(router_state_reuse, MOECOMM_ROUTER_CONFIGS);

}  // namespace test
