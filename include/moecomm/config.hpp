// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Host/device macros, function-like feature tests and the versioned namespace.
//!
//! Feature tests are function-like (`#if MOECOMM_HAS_CUDA()`), so a misspelt name is a compile
//! error instead of a silently false `#ifdef`.

#include <moecomm/version.hpp>

// ---- compilation mode -------------------------------------------------------------------------
#if defined(__CUDACC__)
#  define MOECOMM_CUDA_COMPILATION() 1
#  define MOECOMM_HOST_DEVICE __host__ __device__
#else
#  define MOECOMM_CUDA_COMPILATION() 0
#  define MOECOMM_HOST_DEVICE
#endif

//! True while nvcc compiles device code (inside a `__device__` body); false on the host pass.
#if defined(__CUDA_ARCH__)
#  define MOECOMM_DEVICE_PASS() 1
#else
#  define MOECOMM_DEVICE_PASS() 0
#endif

//! `#pragma unroll n` for the device pass only (host loops are left to the host compiler).
#if MOECOMM_DEVICE_PASS()
#  define MOECOMM_DETAIL_PRAGMA(x) _Pragma(#x)
#  define MOECOMM_DEVICE_UNROLL(n) MOECOMM_DETAIL_PRAGMA(unroll n)
#else
#  define MOECOMM_DEVICE_UNROLL(n)
#endif

//! The CUDA back-end and NCCL communicator compiled by a host compiler against moecomm's CPU
//! emulation of CUDA and NCCL (`tests/emulation/`): the real device code path, run on host threads
//! with CUDA's and NCCL's contracts checked. The emulation's build target defines it.
#if defined(MOECOMM_EMULATE_CUDA) && !MOECOMM_CUDA_COMPILATION()
#  define MOECOMM_CUDA_EMULATION() 1
#else
#  define MOECOMM_CUDA_EMULATION() 0
#endif

// ---- features, as chosen by the build (CMake passes them on the interface target) -------------
//! The CUDA back-end and kernels: needs nvcc. A translation unit compiled by g++ never has it.
#if defined(MOECOMM_ENABLE_CUDA) && MOECOMM_CUDA_COMPILATION()
#  define MOECOMM_HAS_CUDA() 1
#else
#  define MOECOMM_HAS_CUDA() 0
#endif

//! NCCL communicators were enabled by the build.
#if defined(MOECOMM_ENABLE_NCCL)
#  define MOECOMM_HAS_NCCL() 1
#else
#  define MOECOMM_HAS_NCCL() 0
#endif

//! MPI communicators were enabled by the build.
#if defined(MOECOMM_ENABLE_MPI)
#  define MOECOMM_HAS_MPI() 1
#else
#  define MOECOMM_HAS_MPI() 0
#endif

//! The torch integration (c10d communicator, tensor views, autograd functions) was enabled by the build.
#if defined(MOECOMM_ENABLE_TORCH)
#  define MOECOMM_HAS_TORCH() 1
#else
#  define MOECOMM_HAS_TORCH() 0
#endif

//! c10d's Gloo groups can be made in C++: the torch component is on and Gloo's headers, which
//! c10d's ProcessGroupGloo.hpp includes, are visible (Debian: libgloo-dev). torch's pip wheels ship
//! none; there the Python package makes its Gloo groups in Python.
#if MOECOMM_HAS_TORCH() && defined(__has_include)
#  if __has_include(<gloo/rendezvous/store.h>)
#    define MOECOMM_DETAIL_HAS_GLOO 1
#  endif
#endif
#if defined(MOECOMM_DETAIL_HAS_GLOO)
#  define MOECOMM_HAS_GLOO() 1
#else
#  define MOECOMM_HAS_GLOO() 0
#endif

//! Simulated clusters (SimGrid) were enabled by the build.
#if defined(MOECOMM_ENABLE_SIMGRID)
#  define MOECOMM_HAS_SIMGRID() 1
#else
#  define MOECOMM_HAS_SIMGRID() 0
#endif

//! OpenMP threads for the host back-end (the compiler was given -fopenmp).
#if defined(_OPENMP)
#  define MOECOMM_HAS_OPENMP() 1
#else
#  define MOECOMM_HAS_OPENMP() 0
#endif

//! CUDA's 16-bit float types (`__half`, `__nv_bfloat16`). Their headers work with g++ too, so this
//! is true whenever the CUDA toolkit's include directory is visible.
#if defined(__has_include)
#  if __has_include(<cuda_fp16.h>) && __has_include(<cuda_bf16.h>)
#    define MOECOMM_DETAIL_HAS_CUDA_FP16 1
#  endif
#endif
#if defined(MOECOMM_DETAIL_HAS_CUDA_FP16)
#  define MOECOMM_HAS_CUDA_FP16() 1
#else
#  define MOECOMM_HAS_CUDA_FP16() 0
#endif

// ---- namespace ----------------------------------------------------------------------------------
// The inline namespace carries the version, so two libraries built against different moecomm
// versions never share a symbol.
#define MOECOMM_DETAIL_ABI_NAME2(major, minor, patch) v##major##_##minor##_##patch
#define MOECOMM_DETAIL_ABI_NAME(major, minor, patch) MOECOMM_DETAIL_ABI_NAME2(major, minor, patch)
#define MOECOMM_DETAIL_ABI MOECOMM_DETAIL_ABI_NAME(MOECOMM_VERSION_MAJOR, MOECOMM_VERSION_MINOR, MOECOMM_VERSION_PATCH)

#define MOECOMM_NAMESPACE_BEGIN \
  namespace moecomm {           \
  inline namespace MOECOMM_DETAIL_ABI {
#define MOECOMM_NAMESPACE_END \
  }                           \
  }
