// SPDX-License-Identifier: Apache-2.0
#pragma once
//! @file
//! How an example's main ends: the run's exit code, or, when the library throws or memory runs out,
//! one line on stderr and exit code 1 (a trace of an uncaught exception would tell a reader less).

#include <moecomm/error.hpp>

#include <cstdio>
#include <new>

namespace example_support {

//! `run()`'s exit code; on moecomm::error "`program`: what", on std::bad_alloc "`program`: out of
//! memory (try `smaller`)", and 1.
template <class Run>
int exit_code_of(char const* program, char const* smaller, Run&& run) {
  try {
    return run();
  } catch (moecomm::error const& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
  } catch (std::bad_alloc const&) {
    std::fprintf(stderr, "%s: out of memory (try %s)\n", program, smaller);
  }
  return 1;
}

}  // namespace example_support
