/* A stand-in for libfp8.so in selftest.sh: a few of fp8.h's functions, over its structs and
 * typedefs, built from altered copies of the header to show what check_baseline.sh catches. */
#include <string.h>

#include "fp8.h"

const char *fp8_status_string(fp8_status_t status) { return status == FP8_OK ? "FP8_OK" : "FP8_ERR_UNKNOWN"; }
#ifndef SELFTEST_REMOVE_DTYPE_SIZE
size_t fp8_dtype_size(fp8_dtype_t dtype) { return dtype == FP8_DTYPE_F32 ? 4 : 1; }
#endif
void fp8_device_info_init(fp8_device_info_t *info) {
  memset(info, 0, sizeof *info);
  info->struct_size = sizeof *info;
}
fp8_status_t fp8_device_query(int32_t device, fp8_device_info_t *info) {
  info->device = device;
  return FP8_OK;
}
fp8_status_t fp8_comm_get_id(fp8_comm_id_t *id) {
  memset(id, 0, sizeof *id);
  return FP8_OK;
}
#ifdef SELFTEST_ADD_FUNCTION
int32_t fp8_selftest_added(int32_t x) { return x; }
#endif
