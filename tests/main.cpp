// SPDX-License-Identifier: Apache-2.0
// doctest's main for the host test binary.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
