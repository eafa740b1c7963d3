#include <doctest/doctest.h>
namespace test { TEST_CASE("placeholder layer") {} }
