// SPDX-License-Identifier: Apache-2.0
// expect: compiles
// Parametric experts as documented, in the plain and the shadowing layer, forward and backward.
#include "../layer_calls.hpp"

void step(interface_case::plain_layer& plain, interface_case::shadowing_layer& shadowing,
          interface_case::parametric_experts& e) {
  interface_case::forward(plain, e);
  interface_case::backward(plain, e);
  interface_case::forward(shadowing, e);
  interface_case::backward(shadowing, e);
}
