// SPDX-License-Identifier: Apache-2.0
// Host instantiations of the permutation, layout, sort-chunks and validation test bodies: serial
// and two-thread host back-ends, tiled and portable (the GPU's per-lane loop) row kernels, every
// element type. The list of bodies is row_case_instantiations.hpp, which the CUDA tests run too.

#include "permute_cases.hpp"

#if MOECOMM_HAS_CUDA_FP16()
#  define MOECOMM_TEST_ALL_TYPES host_config<float, 1>, host_config<__half, 1>, host_config<__nv_bfloat16, 1>, \
                                 host_config<__nv_bfloat16, 2>, host_config<float, 1, true>,                \
                                 host_config<__half, 1, true>, host_config<__nv_bfloat16, 2, true>
#else  // without CUDA's headers there are no 16-bit float types
#  define MOECOMM_TEST_ALL_TYPES host_config<float, 1>, host_config<float, 2>, host_config<float, 1, true>
#endif
#define MOECOMM_TEST_ONE_TYPE host_config<float, 1>, host_config<float, 2>

#include "row_case_instantiations.hpp"
