/* fp8.h compiles alone as C99 with -pedantic -Werror, and its basic promises hold from C: among
 * them the layout of every versioned struct (layout.h). */
#include <stdio.h>

#include "fp8.h"
#include "layout.h"

int main(void) {
  fp8_recipe_t *recipe = NULL;
  fp8_status_t status = FP8_OK;
  fp8_device_info_t info;
  (void)recipe;
  (void)status;
  (void)info;
  if (FP8_VERSION_NUMBER != FP8_VERSION_MAJOR * 10000 + FP8_VERSION_MINOR * 100 + FP8_VERSION_PATCH) return 1;
  if (sizeof(fp8_status_t) != 4 || sizeof(fp8_dtype_t) != 4) return 1;
  if (fp8_check_layouts() != 0) return 1;
  puts("fp8.h compiles as C99");
  return 0;
}
