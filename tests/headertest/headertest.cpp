// fp8.h compiles alone as C++ (-pedantic -Werror) and declares C linkage.
#include "fp8.h"

#include <cstdio>
#include <type_traits>

static_assert(std::is_same<decltype(&fp8_status_string), const char* (*)(fp8_status_t)>::value,
              "fp8_status_string keeps its C signature");

int main() {
  std::puts("fp8.h compiles as C++");
  return 0;
}
