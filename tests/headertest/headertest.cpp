// fp8.h compiles alone as C++ (-pedantic -Werror) and declares C linkage; the versioned structs
// have the layout C gives them (layout.h).
#include <cstdio>
#include <type_traits>

#include "fp8.h"
#include "layout.h"

static_assert(std::is_same<decltype(&fp8_status_string), const char* (*)(fp8_status_t)>::value,
              "fp8_status_string keeps its C signature");

int main() {
  if (fp8_check_layouts() != 0) return 1;
  std::puts("fp8.h compiles as C++");
  return 0;
}
