// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! Everything in `moecomm.hpp` plus the CUDA back-end. Needs nvcc.

#include <moecomm/moecomm.hpp>

#include <moecomm/backend/cuda.cuh>
