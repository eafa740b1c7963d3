// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! The library version. CMake reads these three lines; keep their form.

#define MOECOMM_VERSION_MAJOR 0
#define MOECOMM_VERSION_MINOR 1
#define MOECOMM_VERSION_PATCH 0

//! The version as one number: major * 10000 + minor * 100 + patch.
#define MOECOMM_VERSION (MOECOMM_VERSION_MAJOR * 10000 + MOECOMM_VERSION_MINOR * 100 + MOECOMM_VERSION_PATCH)
