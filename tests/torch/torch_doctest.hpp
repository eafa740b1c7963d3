// SPDX-License-Identifier: Apache-2.0
#pragma once
// Torch's headers, then doctest's: Debian's libtorch logs through glog, whose CHECK macros would
// replace doctest's. Every torch test includes this first.

#if __has_include(<gloo/rendezvous/store.h>)  // the Gloo tests' (a CUDA test program may have no Gloo)
#  include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#include <torch/torch.h>

#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#undef CHECK_FALSE
#include <doctest/doctest.h>
