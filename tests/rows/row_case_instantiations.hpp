// SPDX-License-Identifier: Apache-2.0
#pragma once
// The row operations' test bodies (permutation, layout, sort chunks, validation), instantiated for
// the configurations a back-end's test file names before including this header:
// MOECOMM_TEST_ALL_TYPES (every element type) and MOECOMM_TEST_ONE_TYPE (bodies whose element type
// does not matter). The host's and CUDA's test files run the same list.

#include "../dispatch/layout_cases.hpp"
#include "permute_cases.hpp"
#include "sort_chunks_cases.hpp"
#include "validation_cases.hpp"

#if !defined(MOECOMM_TEST_ALL_TYPES) || !defined(MOECOMM_TEST_ONE_TYPE)
#  error "define MOECOMM_TEST_ALL_TYPES and MOECOMM_TEST_ONE_TYPE before including row_case_instantiations.hpp"
#endif

namespace test {

TEST_CASE_TEMPLATE_INVOKE(permute_plan_sweep, MOECOMM_TEST_ONE_TYPE);
TEST_CASE_TEMPLATE_INVOKE(permute_plan_example, MOECOMM_TEST_ONE_TYPE);
TEST_CASE_TEMPLATE_INVOKE(permute_plan_padded, MOECOMM_TEST_ALL_TYPES);
TEST_CASE_TEMPLATE_INVOKE(derived_plans_sweep, MOECOMM_TEST_ONE_TYPE);
TEST_CASE_TEMPLATE_INVOKE(permute_family_sweep, MOECOMM_TEST_ALL_TYPES);
TEST_CASE_TEMPLATE_INVOKE(permute_smaller_second_call, MOECOMM_TEST_ALL_TYPES);
TEST_CASE_TEMPLATE_INVOKE(permute_repeatable, MOECOMM_TEST_ALL_TYPES);
TEST_CASE_TEMPLATE_INVOKE(layout_sweep, MOECOMM_TEST_ONE_TYPE);
TEST_CASE_TEMPLATE_INVOKE(layout_example, MOECOMM_TEST_ONE_TYPE);
TEST_CASE_TEMPLATE_INVOKE(sort_chunks_sweep, MOECOMM_TEST_ALL_TYPES);
TEST_CASE_TEMPLATE_INVOKE(sort_chunks_example, MOECOMM_TEST_ONE_TYPE);
TEST_CASE_TEMPLATE_INVOKE(validation_routing, MOECOMM_TEST_ONE_TYPE);
TEST_CASE_TEMPLATE_INVOKE(validation_buffers, MOECOMM_TEST_ALL_TYPES);
TEST_CASE_TEMPLATE_INVOKE(validation_sort_chunks, MOECOMM_TEST_ONE_TYPE);

}  // namespace test
