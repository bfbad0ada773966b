/* A first libfp8 program: quantize a small matrix to E4M3 with a per-tensor scale, read the codes
 * and the dequantised values back, and check them against the scalar encoder. Runs on the GPU when
 * there is one that can do FP8, on the CPU reference backend otherwise.
 *
 *   cc quantize.c $(pkg-config --cflags --libs fp8) -o quantize && ./quantize
 *
 * The test suite builds it against an installed tree with pkg-config and with find_package(fp8). */
#include <fp8.h>
#include <stdio.h>

#define CHECK(call)                                                                           \
  do {                                                                                        \
    fp8_status_t s_ = (call);                                                                 \
    if (s_ != FP8_OK) {                                                                       \
      fprintf(stderr, "%s failed: %s: %s\n", #call, fp8_status_string(s_), fp8_last_error_message()); \
      return 1;                                                                               \
    }                                                                                         \
  } while (0)

int main(void) {
  fp8_context_t *ctx = NULL;
  fp8_recipe_t *recipe = NULL;
  fp8_scaling_t *scaling = NULL;
  fp8_tensor_t *x = NULL, *q = NULL, *back = NULL;
  const int64_t shape[2] = {2, 4};
  const float data[8] = {0.5f, -1.25f, 3.0f, 100.0f, -7.5f, 0.001f, 2.0f, -0.75f};
  float out[8];
  unsigned char codes[8];
  char text[512];
  int i;

  int32_t devices = 0;
  fp8_device_info_t info;

  if (fp8_version_number() != FP8_VERSION_NUMBER) return 1;
  fp8_device_info_init(&info);
  CHECK(fp8_device_count(&devices));
  if (devices > 0 && fp8_device_query(0, &info) == FP8_OK && info.fp8_gemm) {
    CHECK(fp8_context_create(&ctx, 0));
  } else {
    CHECK(fp8_context_create(&ctx, FP8_DEVICE_CPU));
    CHECK(fp8_device_query(FP8_DEVICE_CPU, &info));
  }
  CHECK(fp8_recipe_create(&recipe));
  CHECK(fp8_recipe_parse(recipe, "fp8_format=E4M3, margin=0"));
  CHECK(fp8_recipe_to_string(recipe, text, sizeof text, NULL));
  CHECK(fp8_scaling_create(&scaling, ctx, recipe, FP8_ROLE_FORWARD));
  CHECK(fp8_scaling_set_scale(scaling, 4.0f));
  CHECK(fp8_tensor_create(&x, ctx, FP8_DTYPE_F32, 2, shape));
  CHECK(fp8_tensor_create(&q, ctx, FP8_DTYPE_E4M3, 2, shape));
  CHECK(fp8_tensor_create(&back, ctx, FP8_DTYPE_F32, 2, shape));
  CHECK(fp8_tensor_copy_from_host(x, data, sizeof data));
  CHECK(fp8_quantize(ctx, x, q, NULL, scaling));
  CHECK(fp8_dequantize(ctx, q, back));
  CHECK(fp8_tensor_copy_to_host(q, codes, sizeof codes));
  CHECK(fp8_tensor_copy_to_host(back, out, sizeof out));
  printf("libfp8 %s on %s\nrecipe: %s\n", fp8_version_string(), info.name, text);
  for (i = 0; i < 8; ++i) {
    printf("%g -> 0x%02x -> %g\n", data[i], codes[i], out[i]);
    if (codes[i] != fp8_encode(data[i] * 4.0f, FP8_DTYPE_E4M3)) return 1;
  }
  fp8_tensor_destroy(back);
  fp8_tensor_destroy(q);
  fp8_tensor_destroy(x);
  fp8_scaling_destroy(scaling);
  fp8_recipe_destroy(recipe);
  fp8_context_destroy(ctx);
  return 0;
}
