/* A user's first program: quantize a small matrix on the CPU reference backend and read it back.
 * Built against an installed libfp8, once with pkg-config and once with find_package(fp8). */
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

  if (fp8_version_number() != FP8_VERSION_NUMBER) return 1;
  CHECK(fp8_context_create(&ctx, FP8_DEVICE_CPU));
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
  printf("libfp8 %s, recipe: %s\n", fp8_version_string(), text);
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
