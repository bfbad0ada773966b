/* One FP8 Linear layer step, y = x W^T, built from libfp8's operations the way a framework that
 * owns its graph would: delayed scaling states for x, W and dy, a cast + transpose + amax pass per
 * operand, and three FP8 GEMMs in the TN layout (forward E4M3 x E4M3, dgrad and wgrad with dy in
 * E5M2 under the HYBRID recipe). The results are compared with a float64 computation of the same
 * step; the program fails if an error exceeds what FP8 rounding allows. Runs on the GPU when there
 * is one that can do FP8, on the CPU reference backend otherwise.
 *
 *   cc linear_step.c $(pkg-config --cflags --libs fp8) -lm -o linear_step && ./linear_step
 */
#include <fp8.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(call)                                                                                  \
  do {                                                                                               \
    fp8_status_t s_ = (call);                                                                        \
    if (s_ != FP8_OK) {                                                                              \
      fprintf(stderr, "%s failed: %s: %s\n", #call, fp8_status_string(s_), fp8_last_error_message()); \
      exit(1);                                                                                       \
    }                                                                                                \
  } while (0)

enum { M = 64, K = 128, N = 96 }; /* tokens, in_features, out_features (FP8 GEMMs need multiples of 16) */

static fp8_context_t *ctx;

static fp8_tensor_t *tensor(fp8_dtype_t dt, int64_t rows, int64_t cols) {
  fp8_tensor_t *t = NULL;
  const int64_t shape[2] = {rows, cols};
  CHECK(fp8_tensor_create(&t, ctx, dt, 2, shape));
  return t;
}

static double uniform(unsigned *state) {
  *state = *state * 1664525u + 1013904223u;
  return (double)(*state >> 8) / (double)(1u << 24) * 2.0 - 1.0;
}

/* || got - want || / || want || */
static double relative_error(const float *got, const double *want, int n) {
  double num = 0, den = 0;
  int i;
  for (i = 0; i < n; ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return sqrt(num / den);
}

/* Quantizes `in` into `q` and its transpose `qt` with a scale from a first amax pass (the first
 * step of delayed scaling: measure, update, then cast). */
static void cast_with_fresh_scale(fp8_tensor_t *in, fp8_tensor_t *q, fp8_tensor_t *qt, fp8_scaling_t *s,
                                  const fp8_recipe_t *recipe, fp8_tensor_t *amax) {
  CHECK(fp8_amax(ctx, in, amax, s));
  CHECK(fp8_scaling_update(ctx, &s, 1, recipe));
  CHECK(fp8_quantize(ctx, in, q, qt, s));
}

int main(void) {
  static float x[M * K], w[N * K], dy[M * N], y[M * N], dx[M * K], dw[N * K];
  static double y_ref[M * N], dx_ref[M * K], dw_ref[N * K];
  fp8_recipe_t *recipe = NULL;
  fp8_scaling_t *s_x = NULL, *s_w = NULL, *s_dy = NULL;
  fp8_device_info_t info;
  int32_t devices = 0;
  unsigned seed = 7;
  int i, j, r;
  double err_y, err_dx, err_dw;

  fp8_device_info_init(&info);
  CHECK(fp8_device_count(&devices));
  if (devices > 0 && fp8_device_query(0, &info) == FP8_OK && info.fp8_gemm) {
    CHECK(fp8_context_create(&ctx, 0));
  } else {
    CHECK(fp8_context_create(&ctx, FP8_DEVICE_CPU));
    CHECK(fp8_device_query(FP8_DEVICE_CPU, &info));
  }
  CHECK(fp8_recipe_create(&recipe)); /* HYBRID: E4M3 forward, E5M2 gradients */
  CHECK(fp8_scaling_create(&s_x, ctx, recipe, FP8_ROLE_FORWARD));
  CHECK(fp8_scaling_create(&s_w, ctx, recipe, FP8_ROLE_FORWARD));
  CHECK(fp8_scaling_create(&s_dy, ctx, recipe, FP8_ROLE_BACKWARD));

  for (i = 0; i < M * K; ++i) x[i] = (float)(3.0 * uniform(&seed));
  for (i = 0; i < N * K; ++i) w[i] = (float)(0.05 * uniform(&seed));
  for (i = 0; i < M * N; ++i) dy[i] = (float)(1e-3 * uniform(&seed));

  {
    fp8_tensor_t *tx = tensor(FP8_DTYPE_F32, M, K), *tw = tensor(FP8_DTYPE_F32, N, K), *tdy = tensor(FP8_DTYPE_F32, M, N);
    fp8_tensor_t *qx = tensor(FP8_DTYPE_E4M3, M, K), *qxt = tensor(FP8_DTYPE_E4M3, K, M);
    fp8_tensor_t *qw = tensor(FP8_DTYPE_E4M3, N, K), *qwt = tensor(FP8_DTYPE_E4M3, K, N);
    fp8_tensor_t *qdy = tensor(FP8_DTYPE_E5M2, M, N), *qdyt = tensor(FP8_DTYPE_E5M2, N, M);
    fp8_tensor_t *ty = tensor(FP8_DTYPE_F32, M, N), *tdx = tensor(FP8_DTYPE_F32, M, K), *tdw = tensor(FP8_DTYPE_F32, N, K);
    fp8_tensor_t *amax = tensor(FP8_DTYPE_F32, 1, 1);
    fp8_gemm_options_t fprop;
    fp8_gemm_options_init(&fprop);
    fprop.fast_accumulation = 1; /* as TransformerEngine: fast for fprop, full for dgrad and wgrad */

    CHECK(fp8_tensor_copy_from_host(tx, x, sizeof x));
    CHECK(fp8_tensor_copy_from_host(tw, w, sizeof w));
    CHECK(fp8_tensor_copy_from_host(tdy, dy, sizeof dy));
    cast_with_fresh_scale(tx, qx, qxt, s_x, recipe, amax);
    cast_with_fresh_scale(tw, qw, qwt, s_w, recipe, amax);
    cast_with_fresh_scale(tdy, qdy, qdyt, s_dy, recipe, amax);

    CHECK(fp8_gemm(ctx, qx, qw, NULL, ty, NULL, &fprop)); /* y  = x  W^T : [M,K] x [N,K] */
    CHECK(fp8_gemm(ctx, qdy, qwt, NULL, tdx, NULL, NULL)); /* dx = dy W   : [M,N] x [K,N] */
    CHECK(fp8_gemm(ctx, qdyt, qxt, NULL, tdw, NULL, NULL)); /* dW = dy^T x : [N,M] x [K,M] */
    CHECK(fp8_tensor_copy_to_host(ty, y, sizeof y));
    CHECK(fp8_tensor_copy_to_host(tdx, dx, sizeof dx));
    CHECK(fp8_tensor_copy_to_host(tdw, dw, sizeof dw));

    fp8_tensor_destroy(tx); fp8_tensor_destroy(tw); fp8_tensor_destroy(tdy); fp8_tensor_destroy(qx);
    fp8_tensor_destroy(qxt); fp8_tensor_destroy(qw); fp8_tensor_destroy(qwt); fp8_tensor_destroy(qdy);
    fp8_tensor_destroy(qdyt); fp8_tensor_destroy(ty); fp8_tensor_destroy(tdx); fp8_tensor_destroy(tdw);
    fp8_tensor_destroy(amax);
  }

  /* The same step in float64 on the unquantised values. */
  for (r = 0; r < M; ++r)
    for (j = 0; j < N; ++j) {
      double acc = 0;
      for (i = 0; i < K; ++i) acc += (double)x[r * K + i] * w[j * K + i];
      y_ref[r * N + j] = acc;
    }
  for (r = 0; r < M; ++r)
    for (i = 0; i < K; ++i) {
      double acc = 0;
      for (j = 0; j < N; ++j) acc += (double)dy[r * N + j] * w[j * K + i];
      dx_ref[r * K + i] = acc;
    }
  for (j = 0; j < N; ++j)
    for (i = 0; i < K; ++i) {
      double acc = 0;
      for (r = 0; r < M; ++r) acc += (double)dy[r * N + j] * x[r * K + i];
      dw_ref[j * K + i] = acc;
    }
  err_y = relative_error(y, y_ref, M * N);
  err_dx = relative_error(dx, dx_ref, M * K);
  err_dw = relative_error(dw, dw_ref, N * K);
  printf("FP8 Linear step on %s (%dx%d -> %d, HYBRID recipe)\n", info.name, M, K, N);
  printf("relative error vs float64:  y %.4f   dx %.4f   dW %.4f\n", err_y, err_dx, err_dw);

  fp8_scaling_destroy(s_dy); fp8_scaling_destroy(s_w); fp8_scaling_destroy(s_x);
  fp8_recipe_destroy(recipe);
  fp8_context_destroy(ctx);
  /* E4M3 keeps 3 mantissa bits (relative rounding <= 2^-4), E5M2 2 bits (<= 2^-3); summed over many
   * products the normwise error is a fraction of that. */
  if (!(err_y < 0.05 && err_dx < 0.08 && err_dw < 0.08)) {
    fprintf(stderr, "error above what FP8 rounding allows\n");
    return 1;
  }
  return 0;
}
