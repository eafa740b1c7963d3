// SPDX-License-Identifier: Apache-2.0
// The host's branch-free bf16 conversions equal CUDA's own host functions bit for bit: every one of
// the 2^16 bf16 values to float, and floats from every exponent with many mantissas (plus the
// rounding ties, infinities and NaNs) to bf16.

#include "../support/test_support.hpp"

#if MOECOMM_HAS_CUDA_FP16()
namespace test {

inline std::uint16_t bits_of(__nv_bfloat16 v) {
  std::uint16_t b;
  std::memcpy(&b, &v, 2);
  return b;
}

TEST_CASE("bf16 conversions match CUDA's host functions") {
  using traits = moecomm::dtype_traits<__nv_bfloat16>;
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    __nv_bfloat16 const v = from_bits<__nv_bfloat16>(b);
    float const mine = traits::to_float(v), cuda = __bfloat162float(v);
    REQUIRE(std::memcmp(&mine, &cuda, 4) == 0);
  }
  std::mt19937 rng(1);
  for (std::uint32_t high = 0; high < 0x10000u; ++high)  // sign, exponent and top mantissa bits
    for (std::uint32_t low : {0x0000u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu, static_cast<std::uint32_t>(rng() & 0xFFFFu)}) {
      float const f = from_bits<float>(high << 16 | low);
      CAPTURE(high << 16 | low);
      REQUIRE(bits_of(traits::from_float(f)) == bits_of(__float2bfloat16_rn(f)));
    }
}

}  // namespace test
#endif
