// SPDX-License-Identifier: Apache-2.0
// Host instantiations of the permutation, layout, sort-chunks and validation test bodies: serial
// and two-thread host back-ends, tiled and portable (the GPU's per-lane loop) row kernels, every
// element type.

#include "../dispatch/layout_cases.hpp"
#include "permute_cases.hpp"
#include "sort_chunks_cases.hpp"
#include "validation_cases.hpp"

namespace test {

#if MOECOMM_HAS_CUDA_FP16()
#  define MOECOMM_TEST_ALL_TYPES host_config<float, 1>, host_config<__half, 1>, host_config<__nv_bfloat16, 1>, \
                                 host_config<__nv_bfloat16, 2>, host_config<float, 1, true>,                \
                                 host_config<__half, 1, true>, host_config<__nv_bfloat16, 2, true>
#else  // without CUDA's headers there are no 16-bit float types
#  define MOECOMM_TEST_ALL_TYPES host_config<float, 1>, host_config<float, 2>, host_config<float, 1, true>
#endif
#define MOECOMM_TEST_ONE_TYPE host_config<float, 1>, host_config<float, 2>

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
