/* Trains an MLP on Fashion-MNIST in bf16 and in FP8 at each optimizer level, with libfp8 alone, and
 * compares the runs.
 *
 *   784 -> fc1 -> LayerNorm -> GELU -> fc2 -> LayerNorm -> GELU -> fc3 -> 10 classes
 *
 * The data are the gzip IDX files of Debian's dataset-fashion-mnist package (read with zlib). The
 * loss (softmax cross-entropy) is computed here, on the host; everything else is libfp8: the model,
 * its whole-model forward and backward, the conversion to FP8 (TransformerEngine's delayed scaling,
 * HYBRID formats: E4M3 forward, E5M2 gradients), autocast regions, and AdamW. The FP8 runs differ
 * in how the optimizer keeps the Linear weights and their state (--levels): te (FP32 weights and
 * states, 16 bytes per parameter), or MS-AMP's O1 (F16 weights, FP8 gradients), O2 (plus FP8/F16
 * Adam moments) and O3 (plus FP8 weights with F16 masters). All runs start from the same weights
 * and see the same batches.
 *
 * On a GPU that can run FP8 (sm_89+) it trains the full set; elsewhere it runs on libfp8's CPU
 * reference backend with a smaller model, batch and epoch count (and says so).
 *
 *   train_fashion_mnist [--data DIR] [--epochs N] [--batch N] [--hidden N] [--lr X] [--seed N]
 *                       [--train-limit N] [--test-limit N] [--cpu] [--max-accuracy-gap PP]
 *                       [--levels te,O1,O2,O3] [--recipe TEXT]
 *                       [--ranks N | --rank R --world-size W --id-file PATH]
 *
 * --levels picks the FP8 runs (default: all four). --recipe adds recipe keys (fp8.h's text form) to
 * every FP8 run after its level's, e.g. --recipe scaling=current for current scaling. --max-accuracy-gap makes the program exit with
 * status 2 when an FP8 run's test accuracy is more than PP percentage points below bf16's (the GPU
 * suite uses it with 0.5). Missing data files make it exit with status 77 (which the test suite
 * reports as skipped).
 *
 * Data parallelism (fp8.h, "Data parallelism"): with N ranks every run (bf16 and each level) trains
 * data-parallel. Each rank builds the same model from the same seed, and of every shuffled batch of
 * --batch examples (which must split evenly) rank k takes the batch/N consecutive examples that start
 * at k * batch/N; libfp8 averages the gradients and agrees on the FP8 scales, so the ranks' weights
 * stay identical, which the program checks at the end of each run (a checksum of every parameter;
 * exit status 2 when they differ). Rank 0 alone prints the epochs and evaluates.
 *
 * --ranks N runs the N ranks inside this process, each on a thread of its own: on a machine with N
 * GPUs that can run FP8, rank k on GPU k, joined by NCCL; with fewer, all on GPU 0, joined through
 * host memory by libfp8's in-process transport (slow, but the same results: for trying multi-rank
 * code on one GPU); on the CPU backend (--cpu, or no such GPU) as CPU contexts, joined by the
 * in-process transport. The loss and train accuracy printed are over every rank's examples.
 *
 * One process per rank (CUDA only, on one host or many): --rank R --world-size W --id-file PATH, or
 * the environment variables FP8_RANK, FP8_WORLD_SIZE and FP8_COMM_ID_FILE where the flags are absent,
 * or torchrun's RANK and WORLD_SIZE. Each process takes GPU LOCAL_RANK where that is set, else GPU
 * R % (GPUs on its host). Rank 0 writes the group's id (fp8_comm_get_id, 128 bytes) to PATH (PATH.tmp,
 * flushed to disk, renamed), the others wait for the file (up to 120 s), and every rank joins the
 * group (fp8_comm_create, which waits for all W). Rank 0 removes PATH when it starts and once every
 * rank has joined, so that a launch does not read an earlier one's stale id (should it still, its
 * fp8_comm_create fails or hangs: remove PATH and launch again).
 * Rank 0 prints its own shard's loss and train accuracy; each rank prints its weights' checksum. A
 * rank that dies leaves the others waiting in NCCL until their communicator's timeout
 * (fp8_comm_set_timeout: ten minutes) fails them, or torchrun ends them first. Two ranks on one host:
 *
 *   FP8_COMM_ID_FILE=/tmp/fp8.id FP8_WORLD_SIZE=2 FP8_RANK=0 build/release/examples/train_fashion_mnist &
 *   FP8_COMM_ID_FILE=/tmp/fp8.id FP8_WORLD_SIZE=2 FP8_RANK=1 build/release/examples/train_fashion_mnist
 *
 * and eight with torchrun:
 *
 *   torchrun --nproc-per-node 8 --no-python build/release/examples/train_fashion_mnist --id-file /shared/fp8.id
 *
 * Several hosts: PATH on a filesystem every host sees, and the same command on each host with its
 * ranks: e.g. with --world-size 16, host A runs --rank 0..7 (LOCAL_RANK=0..7) and host B --rank 8..15
 * (LOCAL_RANK=0..7); or, on host K of two, torchrun --nnodes 2 --node-rank K --nproc-per-node 8
 * --master-addr A --no-python build/release/examples/train_fashion_mnist --id-file /shared/fp8.id.
 * Without a shared filesystem, copy the file rank 0 wrote to the same path on the other hosts at each
 * launch (to PATH.tmp, then mv, so that no rank reads half of it) and remove the copies afterwards:
 * a copy left there is a stale id for the next launch. NCCL picks the network (NCCL_SOCKET_IFNAME and
 * NCCL_IB_HCA steer it).
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, nanosleep, pthreads, fsync; NOLINT(bugprone-reserved-identifier) */
#include <errno.h>
#include <fp8.h>
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

/* With several ranks, the calling thread's rank (a pointer to it), for the error messages. */
static int g_ranks = 1;
static pthread_key_t g_rank_key;

/* Prints the failed call, its status and libfp8's message for this thread, the rank first when
 * there are several, and ends the process. With ranks on threads the first rank to fail ends it for
 * all (the others, failing in turn as a rank has left, wait on `first`), so its message is the one. */
static void fail(const char *call, fp8_status_t s) {
  static pthread_mutex_t first = PTHREAD_MUTEX_INITIALIZER;
  const int *rank = g_ranks > 1 ? pthread_getspecific(g_rank_key) : NULL;
  if (g_ranks == 1) {
    fprintf(stderr, "%s failed: %s: %s\n", call, fp8_status_string(s), fp8_last_error_message());
    exit(1);
  }
  pthread_mutex_lock(&first); /* never unlocked */
  if (rank) fprintf(stderr, "rank %d: ", *rank);
  fprintf(stderr, "%s failed: %s: %s\n", call, fp8_status_string(s), fp8_last_error_message());
  fflush(NULL);
  _exit(1); /* not exit(): the other ranks' threads are still inside libfp8 */
}

#define CHECK(call)                    \
  do {                                 \
    fp8_status_t s_ = (call);          \
    if (s_ != FP8_OK) fail(#call, s_); \
  } while (0)

enum { PIXELS = 784, CLASSES = 10 };

/* ---- data ------------------------------------------------------------------------------------ */

typedef struct {
  int64_t count;
  uint8_t *pixels; /* count x 784 */
  uint8_t *labels; /* count */
} dataset_t;

static uint32_t big_endian32(const unsigned char *b) {
  return (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | (uint32_t)b[3];
}

/* Reads a gzip IDX file whose magic is `magic` (2051 images, 2049 labels); returns the payload and
 * the item count, or exits with a message that says what to do. */
static uint8_t *read_idx(const char *dir, const char *name, uint32_t magic, int64_t *items) {
  char path[4096];
  unsigned char header[16];
  const int header_bytes = magic == 2051 ? 16 : 8;
  gzFile f;
  uint8_t *data;
  int64_t bytes;
  snprintf(path, sizeof path, "%s/%s", dir, name);
  f = gzopen(path, "rb");
  if (!f) {
    fprintf(stderr,
            "cannot open %s\nInstall the data (sudo apt-get install dataset-fashion-mnist) or pass --data DIR.\n",
            path);
    exit(77);
  }
  if (gzread(f, header, (unsigned)header_bytes) != header_bytes || big_endian32(header) != magic) {
    fprintf(stderr, "%s is not an IDX file with magic %u\n", path, magic);
    exit(1);
  }
  *items = big_endian32(header + 4);
  if (magic == 2051 && (big_endian32(header + 8) != 28 || big_endian32(header + 12) != 28)) {
    fprintf(stderr, "%s holds %ux%u images; expected 28x28\n", path, big_endian32(header + 8), big_endian32(header + 12));
    exit(1);
  }
  bytes = *items * (magic == 2051 ? PIXELS : 1);
  data = malloc((size_t)bytes);
  if (!data || gzread(f, data, (unsigned)bytes) != bytes) {
    fprintf(stderr, "%s: truncated (expected %lld bytes of data)\n", path, (long long)bytes);
    exit(1);
  }
  gzclose(f);
  return data;
}

static dataset_t load(const char *dir, const char *images, const char *labels, int64_t limit) {
  dataset_t d;
  int64_t n_labels = 0;
  d.pixels = read_idx(dir, images, 2051, &d.count);
  d.labels = read_idx(dir, labels, 2049, &n_labels);
  if (n_labels != d.count) {
    fprintf(stderr, "%s has %lld images but %s has %lld labels\n", images, (long long)d.count, labels,
            (long long)n_labels);
    exit(1);
  }
  if (limit > 0 && limit < d.count) d.count = limit;
  return d;
}

/* ---- small helpers --------------------------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static double rng_uniform(uint64_t *s) { return (double)(rng_next(s) >> 11) / 9007199254740992.0; }

static uint16_t bf16_from_float(float f) { /* round to nearest even */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static float float_from_bf16(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static double now_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static fp8_tensor_t *bf16_tensor(fp8_context_t *ctx, int64_t rows, int64_t cols) {
  fp8_tensor_t *t = NULL;
  const int64_t shape[2] = {rows, cols};
  CHECK(fp8_tensor_create(&t, ctx, FP8_DTYPE_BF16, 2, shape));
  return t;
}

/* Fashion-MNIST's pixel mean and standard deviation (of x / 255 over the training set). */
static void fill_batch(const dataset_t *d, const int64_t *index, int64_t n, uint16_t *x) {
  int64_t i, p;
  for (i = 0; i < n; ++i)
    for (p = 0; p < PIXELS; ++p)
      x[i * PIXELS + p] = bf16_from_float((float)((d->pixels[index[i] * PIXELS + p] / 255.0 - 0.2860) / 0.3530));
}

/* Softmax cross-entropy of bf16 logits: returns the summed loss, writes dlogits = (p - onehot) / n
 * in bf16 (the mean's gradient) when dlogits is given, and counts correct argmaxes. */
static double cross_entropy(const uint16_t *logits, const uint8_t *labels, const int64_t *index, int64_t n,
                            uint16_t *dlogits, int64_t *correct) {
  double loss = 0.0;
  int64_t i;
  int c;
  for (i = 0; i < n; ++i) {
    double z[CLASSES], max = -INFINITY, sum = 0.0;
    int best = 0;
    const int y = labels[index[i]];
    for (c = 0; c < CLASSES; ++c) {
      z[c] = float_from_bf16(logits[i * CLASSES + c]);
      if (z[c] > max) max = z[c], best = c;
    }
    for (c = 0; c < CLASSES; ++c) sum += exp(z[c] - max);
    loss += log(sum) - (z[y] - max);
    *correct += best == y;
    if (dlogits)
      for (c = 0; c < CLASSES; ++c)
        dlogits[i * CLASSES + c] = bf16_from_float((float)((exp(z[c] - max) / sum - (c == y)) / (double)n));
  }
  return loss;
}

/* ---- the model and one training run ---------------------------------------------------------- */

typedef struct {
  int epochs, batch, hidden;
  double lr;
  uint64_t seed;
  const char *recipe; /* --recipe: more keys for every FP8 run ("" for none) */
} settings_t;

typedef struct {
  double test_accuracy, final_loss, seconds_per_epoch, samples_per_second, bytes_per_parameter;
  uint64_t checksum; /* of the weights at the end (weights_checksum) */
  char report[8192];
} result_t;

/* The FP8 runs: a name for --levels and the table, and the recipe text that selects it. */
typedef struct {
  const char *name, *recipe;
} level_t;
static const level_t kLevels[] = {
    {"te", "backend=te"},
    {"O1", "backend=msamp, opt_level=O1"},
    {"O2", "backend=msamp, opt_level=O2"},
    {"O3", "backend=msamp, opt_level=O3"},
};
enum { LEVELS = sizeof kLevels / sizeof kLevels[0] };

/* The data-parallel group as this process sees it: all of it (--ranks N, each rank a thread; or one
 * rank alone), or one rank of a group of processes. */
typedef struct {
  int size;                /* ranks in the group */
  int threads;             /* 1: every rank is a thread of this process (size > 1) */
  pthread_barrier_t epoch; /* threads: the ranks meet at the end of each epoch ... */
  double *loss;            /* ... with their summed loss and correct count, [(epoch - 1) * size + rank] */
  int64_t *correct;
  /* The run the threads are on: its settings, data and level (NULL: bf16). */
  const settings_t *settings;
  const dataset_t *train_set, *test;
  const level_t *level;
} group_t;

/* One rank held by this process: its context, its end of the group (NULL for a group of one) and
 * what its last run gave. */
typedef struct {
  int rank;
  group_t *group;
  fp8_context_t *ctx;
  fp8_comm_t *comm;
  result_t result;
} rank_t;

static fp8_model_t *build_model(fp8_context_t *ctx, const settings_t *s) {
  fp8_model_t *m = NULL;
  const int64_t h = s->hidden;
  uint64_t rng = s->seed;
  int32_t i, count = 0;
  CHECK(fp8_model_create(&m, ctx));
  CHECK(fp8_model_add_linear(m, "fc1", PIXELS, h, 1, NULL));
  CHECK(fp8_model_add_layernorm(m, "ln1", h, 1e-5f, NULL));
  CHECK(fp8_model_add_activation(m, "gelu1", FP8_ACTIVATION_GELU, NULL));
  CHECK(fp8_model_add_linear(m, "fc2", h, h, 1, NULL));
  CHECK(fp8_model_add_layernorm(m, "ln2", h, 1e-5f, NULL));
  CHECK(fp8_model_add_activation(m, "gelu2", FP8_ACTIVATION_GELU, NULL));
  CHECK(fp8_model_add_linear(m, "fc3", h, CLASSES, 1, NULL));
  /* PyTorch's default Linear initialisation: U(-1/sqrt(in), 1/sqrt(in)) for weights and biases.
   * LayerNorms keep gamma = 1, beta = 0. */
  CHECK(fp8_model_parameter_count(m, &count));
  for (i = 0; i < count; ++i) {
    const char *name = NULL;
    fp8_tensor_t *value = NULL;
    int64_t n = 0, k, in;
    float *v;
    CHECK(fp8_model_parameter_at(m, i, &name, &value, NULL));
    if (strncmp(name, "fc", 2) != 0) continue;
    in = name[2] == '1' ? PIXELS : h;
    CHECK(fp8_tensor_numel(value, &n));
    v = malloc((size_t)n * sizeof *v);
    for (k = 0; k < n; ++k) v[k] = (float)((2.0 * rng_uniform(&rng) - 1.0) / sqrt((double)in));
    CHECK(fp8_tensor_copy_from_host(value, v, (size_t)n * sizeof *v));
    free(v);
  }
  return m;
}

static double evaluate(fp8_context_t *ctx, fp8_model_t *m, const dataset_t *test) {
  enum { EVAL_BATCH = 1000 };
  uint16_t *x = malloc((size_t)EVAL_BATCH * PIXELS * sizeof *x), logits[EVAL_BATCH * CLASSES];
  int64_t *index = malloc((size_t)test->count * sizeof *index), i, correct = 0;
  for (i = 0; i < test->count; ++i) index[i] = i;
  CHECK(fp8_model_set_training(m, 0));
  for (i = 0; i < test->count; i += EVAL_BATCH) {
    const int64_t n = test->count - i < EVAL_BATCH ? test->count - i : EVAL_BATCH;
    fp8_tensor_t *xt = bf16_tensor(ctx, n, PIXELS), *yt = bf16_tensor(ctx, n, CLASSES);
    fill_batch(test, index + i, n, x);
    CHECK(fp8_tensor_copy_from_host(xt, x, (size_t)n * PIXELS * sizeof *x));
    CHECK(fp8_model_forward(m, xt, yt)); /* FP8 is off in eval (use_autocast_during_eval = 0) */
    CHECK(fp8_tensor_copy_to_host(yt, logits, (size_t)n * CLASSES * sizeof *logits));
    cross_entropy(logits, test->labels, index + i, n, NULL, &correct);
    fp8_tensor_destroy(xt);
    fp8_tensor_destroy(yt);
  }
  CHECK(fp8_model_set_training(m, 1));
  free(x);
  free(index);
  return 100.0 * (double)correct / (double)test->count;
}

/* FNV-1a over the bytes of every parameter's value as stored (F32, F16 or E4M3): ranks that hold the
 * same weights give the same number. */
static uint64_t weights_checksum(fp8_model_t *m) {
  uint64_t h = 14695981039346656037ull;
  int32_t i, count = 0;
  CHECK(fp8_model_parameter_count(m, &count));
  for (i = 0; i < count; ++i) {
    fp8_tensor_t *value = NULL;
    fp8_dtype_t dtype = FP8_DTYPE_F32;
    int64_t n = 0;
    size_t bytes, k;
    unsigned char *v;
    CHECK(fp8_model_parameter_at(m, i, NULL, &value, NULL));
    CHECK(fp8_tensor_dtype(value, &dtype));
    CHECK(fp8_tensor_numel(value, &n));
    bytes = (size_t)n * fp8_dtype_size(dtype);
    v = malloc(bytes);
    CHECK(fp8_tensor_copy_to_host(value, v, bytes));
    for (k = 0; k < bytes; ++k) h = (h ^ v[k]) * 1099511628211ull;
    free(v);
  }
  return h;
}

/* One run on one rank: bf16 when level is NULL, else FP8 at that level. Rank 0 prints and evaluates. */
static result_t train(const rank_t *me, const settings_t *s, const dataset_t *train_set, const dataset_t *test,
                      const level_t *level) {
  fp8_context_t *ctx = me->ctx;
  group_t *g = me->group;
  const int fp8 = level != NULL, lead = me->rank == 0;
  const char *label = fp8 ? level->name : "bf16";
  /* This rank's share of every batch: b examples from me->rank * b. The last partial batch is dropped. */
  const int64_t b = s->batch / g->size, steps = train_set->count / s->batch;
  fp8_model_t *m = build_model(ctx, s);
  fp8_optimizer_t *opt = NULL;
  fp8_tensor_t *x = bf16_tensor(ctx, b, PIXELS), *y = bf16_tensor(ctx, b, CLASSES), *dy = bf16_tensor(ctx, b, CLASSES);
  uint16_t *xh = malloc((size_t)b * PIXELS * sizeof *xh), *yh = malloc((size_t)b * CLASSES * sizeof *yh),
           *dyh = malloc((size_t)b * CLASSES * sizeof *dyh);
  int64_t *order = malloc((size_t)train_set->count * sizeof *order), i;
  uint64_t shuffle_rng = s->seed ^ 0x5EEDull;
  double total_seconds = 0.0;
  result_t r;
  int epoch;
  memset(&r, 0, sizeof r);

  if (fp8) {
    /* TransformerEngine's recipe as Accelerate configures it, except that these layers are too
     * small for FP8 to pay off on an H100, where libfp8 would run them in bf16 by itself: the
     * small-layer fallback is turned off so that this run really trains in FP8. */
    fp8_recipe_t *recipe = NULL;
    CHECK(fp8_recipe_create(&recipe));
    CHECK(fp8_recipe_parse(recipe, "fp8_format=HYBRID, small_layer_fallback=0"));
    CHECK(fp8_recipe_parse(recipe, level->recipe));
    CHECK(fp8_recipe_parse(recipe, s->recipe));
    CHECK(fp8_convert_model(m, recipe, NULL)); /* Linear, LayerNorm and activation layers */
    fp8_recipe_destroy(recipe);
  }
  /* Data-parallel from here (collective: every rank, converted the same way, before its optimizer). */
  if (me->comm) {
    CHECK(fp8_model_set_comm(m, me->comm));
    /* One backward per step: each gradient bucket is exchanged as soon as the backward has written it. */
    CHECK(fp8_model_set_backward_sync(m, 1));
  }
  CHECK(fp8_optimizer_create(&opt, m, FP8_OPTIMIZER_ADAMW));
  CHECK(fp8_optimizer_set_float(opt, FP8_OPTIM_LR, s->lr));
  CHECK(fp8_optimizer_set_float(opt, FP8_OPTIM_MAX_GRAD_NORM, 1.0));
  for (i = 0; i < train_set->count; ++i) order[i] = i;

  for (epoch = 1; epoch <= s->epochs; ++epoch) {
    double loss = 0.0, start = now_seconds(), seconds, accuracy;
    int64_t correct = 0, seen = steps * b, step;
    for (i = train_set->count - 1; i > 0; --i) { /* Fisher-Yates, the same order for every run and rank */
      const int64_t j = (int64_t)(rng_next(&shuffle_rng) % (uint64_t)(i + 1)), t = order[i];
      order[i] = order[j];
      order[j] = t;
    }
    for (step = 0; step < steps; ++step) {
      const int64_t *index = order + step * s->batch + me->rank * b;
      fill_batch(train_set, index, b, xh);
      CHECK(fp8_tensor_copy_from_host(x, xh, (size_t)b * PIXELS * sizeof *xh));
      if (fp8) CHECK(fp8_autocast_begin(m)); /* contextual_fp8_autocast */
      CHECK(fp8_model_forward(m, x, y));
      if (fp8) CHECK(fp8_autocast_end(m)); /* one batched update of the forward scaling states */
      CHECK(fp8_tensor_copy_to_host(y, yh, (size_t)b * CLASSES * sizeof *yh));
      /* The mean over this rank's b examples; the step averages it over the ranks: the batch's mean. */
      loss += cross_entropy(yh, train_set->labels, index, b, dyh, &correct);
      CHECK(fp8_tensor_copy_from_host(dy, dyh, (size_t)b * CLASSES * sizeof *dyh));
      CHECK(fp8_model_backward(m, dy, NULL)); /* updates the gradient scaling states at its end */
      CHECK(fp8_optimizer_step(opt));         /* averages the gradients across the ranks first */
      CHECK(fp8_optimizer_zero_grad(opt));
    }
    CHECK(fp8_context_synchronize(ctx));
    if (g->threads) { /* rank 0 adds up every rank's examples */
      const int64_t at = (int64_t)(epoch - 1) * g->size;
      int k;
      g->loss[at + me->rank] = loss;
      g->correct[at + me->rank] = correct;
      pthread_barrier_wait(&g->epoch);
      for (loss = 0.0, correct = 0, k = 0; k < g->size; ++k) loss += g->loss[at + k], correct += g->correct[at + k];
      seen = steps * s->batch;
    }
    seconds = now_seconds() - start;
    total_seconds += seconds;
    if (!lead) continue;
    CHECK(fp8_model_report(m, r.report, sizeof r.report, NULL)); /* what training did, before eval */
    accuracy = evaluate(ctx, m, test);                           /* rank 0's model: every rank's weights */
    r.final_loss = loss / (double)seen;
    r.test_accuracy = accuracy;
    printf("%-4s  epoch %d/%d  loss %.4f  train acc %5.2f%%  test acc %5.2f%%  %6.2f s  %8.0f samples/s\n", label,
           epoch, s->epochs, r.final_loss, 100.0 * (double)correct / (double)seen, accuracy, seconds,
           (double)(steps * s->batch) / seconds);
    fflush(stdout);
  }
  r.seconds_per_epoch = total_seconds / s->epochs;
  r.samples_per_second = (double)(steps * s->batch) / r.seconds_per_epoch;
  {
    fp8_optimizer_stats_t st;
    fp8_optimizer_stats_init(&st);
    CHECK(fp8_optimizer_get_stats(opt, &st));
    if (st.skipped_steps && lead)
      printf("%s  %lld steps skipped for non-finite gradients\n", label, (long long)st.skipped_steps);
    r.bytes_per_parameter = (double)st.training_bytes / (double)st.parameters;
  }
  r.checksum = weights_checksum(m);
  if (g->size > 1 && !g->threads) {
    printf("%-4s  rank %d of %d: weights checksum %016llx\n", label, me->rank, g->size, (unsigned long long)r.checksum);
    fflush(stdout);
  }
  free(xh);
  free(yh);
  free(dyh);
  free(order);
  fp8_tensor_destroy(x);
  fp8_tensor_destroy(y);
  fp8_tensor_destroy(dy);
  fp8_optimizer_destroy(opt);
  fp8_model_destroy(m); /* the rank stays in the group: its communicator serves the next run */
  return r;
}

static void *rank_thread(void *arg) {
  rank_t *me = arg;
  const group_t *g = me->group;
  pthread_setspecific(g_rank_key, &me->rank);
  me->result = train(me, g->settings, g->train_set, g->test, g->level);
  return NULL;
}

/* One run on every rank this process holds (on their threads with --ranks N) and rank 0's result.
 * With ranks on threads, also says whether they ended with the same weights; sets *differ if not. */
static result_t run(group_t *g, rank_t *ranks, const settings_t *s, const dataset_t *train_set, const dataset_t *test,
                    const level_t *level, int *differ) {
  pthread_t *threads;
  int k, same = 1;
  if (!g->threads) return train(&ranks[0], s, train_set, test, level);
  g->settings = s;
  g->train_set = train_set;
  g->test = test;
  g->level = level;
  threads = malloc((size_t)g->size * sizeof *threads);
  for (k = 0; k < g->size; ++k)
    if (pthread_create(&threads[k], NULL, rank_thread, &ranks[k]) != 0) {
      fprintf(stderr, "cannot start the thread of rank %d\n", k);
      exit(1);
    }
  for (k = 0; k < g->size; ++k) pthread_join(threads[k], NULL);
  free(threads);
  for (k = 1; k < g->size; ++k) same &= ranks[k].result.checksum == ranks[0].result.checksum;
  printf("%-4s  weights identical on all %d ranks: %s\n", level ? level->name : "bf16", g->size, same ? "yes" : "no");
  fflush(stdout);
  if (!same) *differ = 1;
  return ranks[0].result;
}

/* ---- main ------------------------------------------------------------------------------------ */

/* One line of the side-by-side table: the field at `offset` of bf16 and of each chosen run. */
static void print_row(const char *label, const char *format, size_t offset, const result_t *bf16,
                      const result_t *runs, const int *chosen) {
  int i;
  printf("\n%-26s ", label);
  printf(format, *(const double *)((const char *)bf16 + offset));
  for (i = 0; i < LEVELS; ++i)
    if (chosen[i]) {
      printf(" ");
      printf(format, *(const double *)((const char *)&runs[i] + offset));
    }
}

static const char *option(int argc, char **argv, int *i, const char *name) {
  const size_t len = strlen(name);
  if (strncmp(argv[*i], name, len) != 0) return NULL;
  if (argv[*i][len] == '=') return argv[*i] + len + 1;
  if (argv[*i][len] != '\0') return NULL;
  if (*i + 1 >= argc) {
    fprintf(stderr, "%s needs a value\n", name);
    exit(1);
  }
  return argv[++*i];
}

/* How messages show a setting: "--rank 1" for an option, "FP8_RANK=1" for an environment variable. */
static const char *joint(const char *from) { return from[0] == '-' ? " " : "="; }

/* A whole number from `name` (an option or an environment variable), or exit with a message. */
static int whole_number(const char *name, const char *v) {
  char *end = NULL;
  const long n = strtol(v, &end, 10);
  if (end == v || *end != '\0' || n < 0 || n > 1L << 30) {
    fprintf(stderr, "%s%s%s: expected a whole number\n", name, joint(name), v);
    exit(1);
  }
  return (int)n;
}

/* An option's value if it was given, else that of the first of the environment variables env1, env2
 * (either may be NULL) that is set, else NULL; *from names where it came from, for messages. */
static const char *option_or_env(const char *value, const char *flag, const char *env1, const char *env2,
                                 const char **from) {
  const char *v1 = env1 ? getenv(env1) : NULL, *v2 = env2 ? getenv(env2) : NULL;
  *from = value ? flag : v1 ? env1 : v2 ? env2 : flag;
  return value ? value : v1 ? v1 : v2;
}

/* One process per rank: rank 0 makes the group's id and writes it to `path` so that no rank can read
 * part of it (to path.tmp, flushed to disk, renamed over path); the others wait for all 128 bytes. */
static void share_id(const char *path, int rank, fp8_comm_id_t *id) {
  const struct timespec pause = {0, 100000000L}; /* 100 ms */
  const double give_up = now_seconds() + 120.0;
  if (rank == 0) {
    char tmp[4096];
    FILE *f;
    int ok;
    CHECK(fp8_comm_get_id(id));
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp) {
      fprintf(stderr, "rank 0: --id-file %s: the path is too long\n", path);
      exit(1);
    }
    f = fopen(tmp, "wb");
    ok = f && fwrite(id->bytes, 1, FP8_COMM_ID_BYTES, f) == FP8_COMM_ID_BYTES && fflush(f) == 0 &&
         fsync(fileno(f)) == 0;
    if (f && fclose(f) != 0) ok = 0;
    if (!ok || rename(tmp, path) != 0) {
      fprintf(stderr, "rank 0: cannot write the group's id to %s (through %s): %s\n", path, tmp, strerror(errno));
      remove(tmp);
      exit(1);
    }
    return;
  }
  for (;;) {
    FILE *f = fopen(path, "rb");
    char found[64] = "no such file";
    if (f) {
      const size_t got = fread(id->bytes, 1, FP8_COMM_ID_BYTES, f);
      fclose(f);
      if (got == FP8_COMM_ID_BYTES) return; /* else a copy still under way: wait */
      snprintf(found, sizeof found, "it holds %zu of the %d bytes", got, FP8_COMM_ID_BYTES);
    } else if (errno != ENOENT) {
      fprintf(stderr, "rank %d: cannot read the group's id from %s: %s\n", rank, path, strerror(errno));
      exit(1);
    }
    if (now_seconds() > give_up) {
      fprintf(stderr,
              "rank %d: gave up after 120 s waiting for the group's id in %s (%s). Rank 0 writes it there: is rank "
              "0 running, with the same --id-file (FP8_COMM_ID_FILE), on a filesystem this host sees?\n",
              rank, path, found);
      exit(1);
    }
    nanosleep(&pause, NULL);
  }
}

int main(int argc, char **argv) {
  const char *data = getenv("FASHION_MNIST_DIR") ? getenv("FASHION_MNIST_DIR") : "/usr/share/datasets/fashion-mnist";
  const char *epochs = NULL, *batch = NULL, *hidden = NULL; /* NULL: the device's default */
  const char *rank_arg = NULL, *world_arg = NULL, *id_file = NULL, *rank_from, *world_from, *id_from;
  settings_t s;
  int64_t train_limit = 0, test_limit = 0;
  int force_cpu = 0, i, k, devices = 0, gpus = 0, gpu = 0;
  int ranks = 1;     /* --ranks: ranks on threads of this process */
  int processes = 0; /* 1: one process per rank, this one rank `rank` of `size` */
  int size = 1, rank = 0, here, lead;
  double max_gap = -1.0;
  fp8_device_info_t info;
  dataset_t train_set, test;
  result_t bf16, runs[LEVELS];
  int on_gpu, chosen[LEVELS] = {1, 1, 1, 1}, failed = 0, differ = 0;
  group_t g;
  rank_t *held;

  s.lr = 1e-3;
  s.seed = 1234;
  s.recipe = "";
  for (i = 1; i < argc; ++i) {
    const char *v;
    if (strcmp(argv[i], "--cpu") == 0) force_cpu = 1;
    else if ((v = option(argc, argv, &i, "--data"))) data = v;
    else if ((v = option(argc, argv, &i, "--epochs"))) epochs = v;
    else if ((v = option(argc, argv, &i, "--batch"))) batch = v;
    else if ((v = option(argc, argv, &i, "--hidden"))) hidden = v;
    else if ((v = option(argc, argv, &i, "--lr"))) s.lr = atof(v);
    else if ((v = option(argc, argv, &i, "--seed"))) s.seed = strtoull(v, NULL, 10);
    else if ((v = option(argc, argv, &i, "--train-limit"))) train_limit = atoll(v);
    else if ((v = option(argc, argv, &i, "--test-limit"))) test_limit = atoll(v);
    else if ((v = option(argc, argv, &i, "--max-accuracy-gap"))) max_gap = atof(v);
    else if ((v = option(argc, argv, &i, "--ranks"))) ranks = whole_number("--ranks", v);
    else if ((v = option(argc, argv, &i, "--rank"))) rank_arg = v;
    else if ((v = option(argc, argv, &i, "--world-size"))) world_arg = v;
    else if ((v = option(argc, argv, &i, "--id-file"))) id_file = v;
    else if ((v = option(argc, argv, &i, "--recipe"))) {
      fp8_recipe_t *check = NULL;
      CHECK(fp8_recipe_create(&check));
      if (fp8_recipe_parse(check, v) != FP8_OK) {
        fprintf(stderr, "--recipe: %s\n", fp8_last_error_message());
        return 1;
      }
      fp8_recipe_destroy(check);
      s.recipe = v;
    }
    else if ((v = option(argc, argv, &i, "--levels"))) {
      int any = 0;
      for (k = 0; k < LEVELS; ++k) {
        const char *at = strstr(v, kLevels[k].name);
        const size_t len = strlen(kLevels[k].name);
        chosen[k] = at && (at == v || at[-1] == ',') && (at[len] == '\0' || at[len] == ',');
        any |= chosen[k];
      }
      if (!any) {
        fprintf(stderr, "--levels %s names no level; expected a comma-separated list of te, O1, O2, O3\n", v);
        return 1;
      }
    } else {
      fprintf(stderr, "unknown argument '%s' (see the comment at the top of train_fashion_mnist.c)\n", argv[i]);
      return 1;
    }
  }

  /* The ranks: --ranks N here, or one process per rank (the options, else FP8_*, else torchrun's). */
  if (ranks < 1) {
    fprintf(stderr, "--ranks must be at least 1\n");
    return 1;
  }
  world_arg = option_or_env(world_arg, "--world-size", "FP8_WORLD_SIZE", "WORLD_SIZE", &world_from);
  if (!world_arg && (rank_arg || id_file)) {
    fprintf(stderr, "%s needs --world-size W (or FP8_WORLD_SIZE): one process per rank, W of them\n",
            rank_arg ? "--rank" : "--id-file");
    return 1;
  }
  rank_arg = option_or_env(rank_arg, "--rank", "FP8_RANK", "RANK", &rank_from);
  id_file = option_or_env(id_file, "--id-file", "FP8_COMM_ID_FILE", NULL, &id_from);
  size = world_arg ? whole_number(world_from, world_arg) : 1;
  if (size < 1) {
    fprintf(stderr, "%s%s%d: expected at least 1\n", world_from, joint(world_from), size);
    return 1;
  }
  if (size > 1) {
    processes = 1;
    if (!rank_arg) {
      fprintf(stderr, "%s%s%d needs this process's rank: --rank R or FP8_RANK (torchrun sets RANK)\n", world_from,
              joint(world_from), size);
      return 1;
    }
    rank = whole_number(rank_from, rank_arg);
    if (rank >= size) {
      fprintf(stderr, "%s%s%d is not a rank of %s%s%d (0 .. %d)\n", rank_from, joint(rank_from), rank, world_from,
              joint(world_from), size, size - 1);
      return 1;
    }
    if (!id_file) {
      fprintf(stderr, "%s%s%d needs --id-file PATH (or FP8_COMM_ID_FILE): where rank 0 leaves the group's id\n",
              world_from, joint(world_from), size);
      return 1;
    }
    if (ranks > 1) {
      fprintf(stderr, "--ranks %d runs every rank in this process; it does not combine with one process per rank "
              "(%s%s%d)\n", ranks, world_from, joint(world_from), size);
      return 1;
    }
  } else {
    size = ranks;
  }
  lead = rank == 0;
  if (size > 1) { /* error messages name the rank from here on */
    g_ranks = size;
    pthread_key_create(&g_rank_key, NULL);
    if (processes) pthread_setspecific(g_rank_key, &rank);
  }

  fp8_device_info_init(&info);
  CHECK(fp8_device_count(&devices));
  if (processes) { /* torchrun's LOCAL_RANK, else this rank's place among the host's GPUs */
    const char *local_rank = getenv("LOCAL_RANK");
    gpu = local_rank ? whole_number("LOCAL_RANK", local_rank) : devices ? rank % devices : 0;
  }
  on_gpu = !force_cpu && gpu < devices && fp8_device_query(gpu, &info) == FP8_OK && info.fp8_gemm;
  if (processes && !on_gpu) {
    fprintf(stderr, "rank %d: one process per rank needs a CUDA GPU that can run FP8 (fp8_comm_create joins CUDA "
            "contexts through NCCL), and ", rank);
    if (force_cpu) fprintf(stderr, "--cpu was given");
    else if (devices == 0) fprintf(stderr, "this host has no CUDA GPU");
    else if (gpu >= devices) fprintf(stderr, "GPU %d is not there (%d GPU(s) on this host)", gpu, devices);
    else fprintf(stderr, "GPU %d cannot (or cannot be queried)", gpu);
    fprintf(stderr, ". On the CPU backend, run the ranks as threads of one process: --cpu --ranks %d\n", size);
    return 1;
  }
  if (on_gpu && !processes) /* --ranks N: GPUs 0 .. N-1 if each can run FP8, else all on GPU 0 */
    for (gpus = 1; gpus < size && gpus < devices; ++gpus) {
      fp8_device_info_t other;
      fp8_device_info_init(&other);
      if (fp8_device_query(gpus, &other) != FP8_OK || !other.fp8_gemm) break;
    }
  /* Defaults: on the CPU reference backend a smaller model and fewer epochs (the full set still). */
  s.epochs = epochs ? atoi(epochs) : on_gpu ? 5 : 1;
  s.batch = batch ? atoi(batch) : on_gpu ? 256 : 128;
  s.hidden = hidden ? atoi(hidden) : on_gpu ? 1024 : 128;
  if (s.epochs < 1 || s.batch < 1 || s.hidden < 1 || !(s.lr > 0)) {
    fprintf(stderr, "--epochs, --batch, --hidden and --lr must be positive\n");
    return 1;
  }
  if (s.batch % size != 0) {
    fprintf(stderr, "--batch %d does not split evenly over %d ranks (each takes batch / ranks examples of every "
            "batch): pass a multiple of %d\n", s.batch, size, size);
    return 1;
  }
  if (processes && lead) remove(id_file); /* a stale id of an earlier launch, before any rank looks */

  train_set = load(data, "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", train_limit);
  test = load(data, "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", test_limit);
  if (train_set.count < s.batch) {
    fprintf(stderr, "--batch %d is larger than the %lld training images\n", s.batch, (long long)train_set.count);
    return 1;
  }

  /* The ranks this process holds, their contexts and their ends of the group. */
  memset(&g, 0, sizeof g);
  g.size = size;
  g.threads = !processes && size > 1;
  here = processes ? 1 : size;
  held = calloc((size_t)here, sizeof *held);
  for (k = 0; k < here; ++k) {
    held[k].rank = processes ? rank : k;
    held[k].group = &g;
    CHECK(fp8_context_create(&held[k].ctx, !on_gpu ? FP8_DEVICE_CPU : processes ? gpu : gpus >= size ? k : 0));
  }
  if (processes) {
    fp8_comm_id_t id;
    share_id(id_file, rank, &id);
    CHECK(fp8_comm_create(&held[0].comm, held[0].ctx, size, rank, &id)); /* waits for every rank */
    if (lead) remove(id_file); /* every rank has read it */
  } else if (size > 1) {
    fp8_context_t **ctxs = malloc((size_t)size * sizeof(fp8_context_t *));
    fp8_comm_t **comms = malloc((size_t)size * sizeof(fp8_comm_t *));
    for (k = 0; k < size; ++k) ctxs[k] = held[k].ctx;
    CHECK(fp8_comm_create_local(comms, ctxs, size)); /* NCCL on a GPU each, else the in-process transport */
    for (k = 0; k < size; ++k) held[k].comm = comms[k];
    free(ctxs);
    free(comms);
  }
  if (g.threads) {
    pthread_barrier_init(&g.epoch, NULL, (unsigned)size);
    g.loss = calloc((size_t)s.epochs * (size_t)size, sizeof *g.loss);
    g.correct = calloc((size_t)s.epochs * (size_t)size, sizeof *g.correct);
  }

  if (lead && on_gpu) {
    if (size == 1) printf("device: %s (GPU 0)\n", info.name);
    else if (processes) printf("device: %s (GPU %d for rank 0; a GPU per rank, each rank a process)\n", info.name, gpu);
    else if (gpus >= size) printf("device: %s (GPUs 0-%d, one per rank)\n", info.name, size - 1);
    else
      printf("device: %s (GPU 0)\nnote: %d ranks but %d GPU(s) that can run FP8: the ranks share GPU 0 and exchange "
             "through host memory (libfp8's in-process transport: slow, but the same results)\n",
             info.name, size, gpus);
  } else if (lead) {
    printf("device: libfp8's CPU reference backend (%s); smaller settings unless given: hidden %d, "
           "batch %d, %d epoch(s)\n",
           force_cpu ? "--cpu" : "no CUDA GPU that can run FP8 here", s.hidden, s.batch, s.epochs);
  }
  if (lead && s.recipe[0]) printf("recipe: %s (every FP8 run, after its level's keys)\n", s.recipe);
  if (lead) {
    printf("data: %s (%lld training, %lld test images)\n", data, (long long)train_set.count, (long long)test.count);
    if (size > 1)
      printf("data parallel: %d ranks (%s), each taking %d consecutive examples of every shuffled batch of %d; rank 0 "
             "evaluates%s\n",
             size,
             processes                ? "a process each, joined by NCCL"
             : on_gpu && gpus >= size ? "threads of this process, joined by NCCL"
                                      : "threads of this process, joined by libfp8's in-process transport",
             s.batch / size, s.batch, processes ? " and reports the loss and train accuracy of its own examples" : "");
    printf("model: 784 -> %d -> LayerNorm -> GELU -> %d -> LayerNorm -> GELU -> 10; AdamW lr %g, clip 1.0, "
           "batch %d, %d epoch(s), seed %llu\n\n",
           s.hidden, s.hidden, s.lr, s.batch, s.epochs, (unsigned long long)s.seed);
  }

  bf16 = run(&g, held, &s, &train_set, &test, NULL, &differ);
  for (i = 0; i < LEVELS; ++i)
    if (chosen[i]) runs[i] = run(&g, held, &s, &train_set, &test, &kLevels[i], &differ);

  if (lead) {
    printf("\n%-26s %10s", "", "bf16");
    for (i = 0; i < LEVELS; ++i)
      if (chosen[i]) printf(" %10s", kLevels[i].name);
    print_row("test accuracy (%)", "%10.2f", offsetof(result_t, test_accuracy), &bf16, runs, chosen);
    print_row("final training loss", "%10.4f", offsetof(result_t, final_loss), &bf16, runs, chosen);
    print_row("training bytes / parameter", "%10.1f", offsetof(result_t, bytes_per_parameter), &bf16, runs, chosen);
    print_row("seconds per epoch", "%10.3f", offsetof(result_t, seconds_per_epoch), &bf16, runs, chosen);
    print_row("samples per second", "%10.0f", offsetof(result_t, samples_per_second), &bf16, runs, chosen);
    printf("\n(bf16: FP32 weights and AdamW states; bytes count weights, masters, gradients and Adam's m and v, "
           "biases and norms included)\n");
    for (i = LEVELS - 1; i >= 0; --i)
      if (chosen[i]) {
        printf("\nFP8 model at %s, per layer, as its last training step ran (evaluation runs in bf16, as "
               "Accelerate's use_autocast_during_eval = 0 asks):\n%s", kLevels[i].name, runs[i].report);
        break;
      }
  }

  free(train_set.pixels);
  free(train_set.labels);
  free(test.pixels);
  free(test.labels);
  for (k = 0; k < here; ++k) {
    fp8_comm_destroy(held[k].comm); /* leaves the group: every model using it is gone */
    fp8_context_destroy(held[k].ctx);
  }
  free(held);
  if (g.threads) {
    pthread_barrier_destroy(&g.epoch);
    free(g.loss);
    free(g.correct);
  }
  for (i = 0; i < LEVELS; ++i)
    if (lead && chosen[i] && max_gap >= 0.0 && bf16.test_accuracy - runs[i].test_accuracy > max_gap) {
      printf("FAIL: FP8 at %s: test accuracy %.2f points below bf16 (allowed: %.2f)\n", kLevels[i].name,
             bf16.test_accuracy - runs[i].test_accuracy, max_gap);
      failed = 1;
    }
  if (differ) {
    printf("FAIL: the ranks ended a run with different weights (see above)\n");
    failed = 1;
  }
  return failed ? 2 : 0;
}
