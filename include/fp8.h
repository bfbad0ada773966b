/*
 * libfp8 — FP8 mixed-precision training on NVIDIA GPUs, behind a C ABI.
 *
 * This header is the whole public interface. It is C99 and C++ clean, needs no CUDA header, and
 * documents every contract; the numbers pinned here (status codes, dtypes, attribute ids and enum
 * values) never change meaning between releases of the same major version.
 *
 * Conventions (they hold for every function unless its comment says otherwise)
 * - Every call that can fail returns fp8_status_t; FP8_OK is 0. On failure, out-parameters and user
 *   buffers are left exactly as they were, and fp8_last_error_message() says what was wrong.
 * - Outputs come first. An object returned through `T **out` belongs to the caller, who releases it
 *   with the matching fp8_*_destroy; fp8_*_destroy(NULL) does nothing. Pointers returned by getters
 *   are borrowed and live as long as the object they came from.
 * - Objects are externally synchronised: one thread at a time may use a context and everything
 *   created from it. Different contexts may be used from different threads at once. The error
 *   message is per thread.
 * - A context owns one CUDA stream (the legacy default stream unless fp8_context_set_stream says
 *   otherwise). Calls marked "asynchronous" only queue work on that stream: they never wait for the
 *   GPU, allocate device memory only where their buffers must first grow to a new shape (see "CUDA
 *   graphs"), and can be captured in a CUDA graph. fp8_context_set_stream
 *   orders the new stream after the work already queued on the old one (except into or out of a
 *   stream under capture, which cannot depend on work outside it: order those yourself, as
 *   torch.cuda.graph does by synchronising before it begins). A fault inside such work is reported
 *   by a later call or by fp8_context_synchronize. Calls marked "synchronous" return after the work
 *   is done.
 * - CUDA graphs: a whole training step (fp8_model_forward or per-layer calls under autocast or
 *   autowrap, the backward, fp8_optimizer_step, fp8_optimizer_zero_grad) can be captured with
 *   cudaStreamBeginCapture on the context's stream (set with fp8_context_set_stream; the legacy
 *   stream cannot be captured) and replayed: every decision a replay needs is on the device (scales
 *   and amax histories, the step count, bias corrections, the skip of a non-finite step, the
 *   learning rate and every other hyper-parameter, which the step reads from device memory, so
 *   fp8_optimizer_set_float between replays takes effect at the next one). Rules: run the same step
 *   once before capturing it, so that libfp8's buffers have grown to its shapes (they are kept; an
 *   allocation during a capture is refused with FP8_ERR_INVALID_STATE saying so); make synchronous
 *   calls (fp8_optimizer_set_float, copies to and from the host, fp8_*_get_info) between replays,
 *   never inside a capture. Within a captured sequence a Linear makes its FP8 and bf16 weight copies
 *   at its first forward, or an earlier Linear's forward makes its FP8 copy with its own (see the
 *   weight copies under "Models and layers"; replays follow optimizer steps the capture cannot know
 *   of) and reuses them
 *   for later micro-batches; the scaling states updated at the end of each region are those that
 *   recorded an amax in the captured calls, the same in every replay. A graph uses the model's
 *   buffers as they were at capture: between its replays, run no other call of that model that
 *   computes (no eager forward or backward, which would reuse or grow those buffers; evaluate with
 *   another model, or capture the evaluation too); after the last replay eager calls are fine again,
 *   and remake the weight copies first. Adding layers is refused while an optimizer exists.
 * - On the CPU reference backend (device FP8_DEVICE_CPU) every call runs to completion before it
 *   returns, and "device memory" means ordinary host memory.
 * - Objects keep their context alive: fp8_context_destroy may come before the destruction of its
 *   tensors, scaling states, models and optimizers, which go on working; the context's resources
 *   go when the last of them goes. A context created afterwards is another context: its tensors
 *   and the older objects refuse each other (FP8_ERR_INVALID_ARGUMENT, "belongs to another
 *   context").
 * - Versioned structs (fp8_device_info_t, fp8_scaling_info_t, fp8_gemm_options_t,
 *   fp8_convert_options_t, fp8_layer_report_t, fp8_optimizer_stats_t) begin with uint32_t
 *   struct_size, which the caller sets to sizeof the struct as compiled (the matching *_init does);
 *   later releases only append fields. Every struct_size from the struct's first release on is
 *   accepted (each struct's comment names the last field of that release; a smaller size is
 *   refused with FP8_ERR_INVALID_ARGUMENT). A struct the library reads (options) is read up to
 *   min(struct_size, the library's sizeof), and the fields a shorter struct lacks take their
 *   defaults; a longer one is accepted only if every byte past the library's sizeof is 0 (else
 *   FP8_ERR_UNSUPPORTED naming the offset of the first nonzero byte) and struct_size is at most 4096
 *   (a larger one is taken for an uninitialised struct: FP8_ERR_INVALID_ARGUMENT). A struct the library fills
 *   (info, report, stats) is written up to the same bound, struct_size and the bytes past the bound
 *   left as they were.
 */
#ifndef FP8_H
#define FP8_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32) && defined(FP8_BUILDING)
#define FP8_API __declspec(dllexport)
#elif defined(_WIN32) && !defined(FP8_STATIC)
#define FP8_API __declspec(dllimport)
#elif defined(_WIN32)
#define FP8_API
#elif defined(__GNUC__)
#define FP8_API __attribute__((visibility("default")))
#else
#define FP8_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/** CUDA's stream type (cudaStream_t is `struct CUstream_st *`), declared here so that no CUDA
 *  header is needed. */
struct CUstream_st;

/* ------------------------------------------------------------------------------------------------
 * Version
 * --------------------------------------------------------------------------------------------- */

#define FP8_VERSION_MAJOR 0
#define FP8_VERSION_MINOR 2
#define FP8_VERSION_PATCH 0
/** MAJOR*10000 + MINOR*100 + PATCH, the same formula as fp8_version_number(). */
#define FP8_VERSION_NUMBER (FP8_VERSION_MAJOR * 10000 + FP8_VERSION_MINOR * 100 + FP8_VERSION_PATCH)

/** The version of the library actually loaded (compare with FP8_VERSION_NUMBER). Thread safe. */
FP8_API uint32_t fp8_version_number(void);

/** The same as a string, "MAJOR.MINOR.PATCH". Static storage; thread safe. */
FP8_API const char *fp8_version_string(void);

/* ------------------------------------------------------------------------------------------------
 * Status codes and errors
 * --------------------------------------------------------------------------------------------- */

/** Result of every fallible call. 32-bit; values are pinned and never renumbered. */
typedef int32_t fp8_status_t;
#define FP8_OK 0                    /**< success */
#define FP8_ERR_INVALID_ARGUMENT 1  /**< NULL where an object is required, value out of range, unknown key */
#define FP8_ERR_DTYPE 2             /**< a tensor has a dtype the call does not accept */
#define FP8_ERR_SHAPE 3             /**< a tensor's shape or size does not fit the call */
#define FP8_ERR_INVALID_STATE 4     /**< the call is not allowed in the object's current state */
#define FP8_ERR_OUT_OF_MEMORY 5     /**< host or device allocation failed */
#define FP8_ERR_CUDA 6              /**< the CUDA runtime reported an error (message has its name) */
#define FP8_ERR_CUBLAS 7            /**< cuBLASLt reported an error */
#define FP8_ERR_NCCL 8              /**< NCCL reported an error */
#define FP8_ERR_UNSUPPORTED 9       /**< valid request this build or device cannot do */
#define FP8_ERR_IO 10               /**< a file could not be opened, read or written */
#define FP8_ERR_CORRUPT 11          /**< data failed its integrity checks */
#define FP8_ERR_VERSION 12          /**< data of an incompatible format version (a newer file, a DLPack tensor of another major version) */
#define FP8_ERR_BUFFER_TOO_SMALL 13 /**< a caller's buffer is too small; the needed size is returned */
#define FP8_ERR_NO_DEVICE 14        /**< no CUDA device with that ordinal (or no driver) */
#define FP8_ERR_INTERNAL 15         /**< a bug in libfp8; please report the message */

/** Static name of a status ("FP8_ERR_SHAPE"); "FP8_ERR_UNKNOWN" for values not listed. Thread safe. */
FP8_API const char *fp8_status_string(fp8_status_t status);

/**
 * The message of the last failed call on this thread, naming the function, the argument and the
 * expected value ("fp8_quantize: out has shape [4, 8], expected [4, 9] like in"). Never NULL; ""
 * before any failure. Valid until the next failing call on this thread. A successful call does not
 * clear it.
 */
FP8_API const char *fp8_last_error_message(void);

/* ------------------------------------------------------------------------------------------------
 * Data types
 * --------------------------------------------------------------------------------------------- */

/** Element types. Values are pinned. */
typedef int32_t fp8_dtype_t;
#define FP8_DTYPE_F32 0  /**< IEEE binary32 */
#define FP8_DTYPE_F16 1  /**< IEEE binary16 */
#define FP8_DTYPE_BF16 2 /**< bfloat16 */
#define FP8_DTYPE_E4M3 3 /**< OCP E4M3FN: bias 7, no infinities, NaN = S.1111.111, max 448 */
#define FP8_DTYPE_E5M2 4 /**< OCP E5M2: bias 15, with infinities, max 57344 */

/** Bytes per element of a dtype; 0 for an unknown value. Thread safe. */
FP8_API size_t fp8_dtype_size(fp8_dtype_t dtype);
/** Static name ("bf16", "e4m3", ...); "unknown" for an unknown value. Thread safe. */
FP8_API const char *fp8_dtype_name(fp8_dtype_t dtype);

/* ------------------------------------------------------------------------------------------------
 * Scalar conversions (the numerics contract, for bindings and tests)
 *
 * Encoding rounds to nearest, ties to even, saturates out-of-range values and infinities to the
 * largest finite value of the same sign, and maps any NaN to 0x7F. These are the same bits as
 * CUDA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, kind) for every one of the 2^32 float inputs.
 * Decoding is exact; NaN codes decode to a quiet NaN with the code's sign, E5M2 infinities to
 * infinities. Pure functions; thread safe. `dtype` must be FP8_DTYPE_E4M3 or FP8_DTYPE_E5M2
 * (anything else returns 0 / NaN).
 * --------------------------------------------------------------------------------------------- */
FP8_API uint8_t fp8_encode(float x, fp8_dtype_t dtype);
FP8_API float fp8_decode(uint8_t code, fp8_dtype_t dtype);

/* ------------------------------------------------------------------------------------------------
 * Context: a device, a stream, and the resources of both
 * --------------------------------------------------------------------------------------------- */

typedef struct fp8_context fp8_context_t;
/** Device ordinal of the CPU reference backend. */
#define FP8_DEVICE_CPU (-1)

/**
 * Creates a context on `device`: FP8_DEVICE_CPU for the CPU reference backend, or a CUDA device
 * ordinal (0 .. count-1). The CUDA device must be compute capability 8.9 or newer (FP8 tensor
 * cores); an older one is refused with FP8_ERR_UNSUPPORTED, a missing one with FP8_ERR_NO_DEVICE.
 * [out] out: the new context. Not thread safe with respect to other uses of the same device's
 * current-device setting: it sets the calling thread's current CUDA device only for its own calls.
 */
FP8_API fp8_status_t fp8_context_create(fp8_context_t **out, int32_t device);

/** Releases the caller's reference; resources go when the last tensor/state of it is destroyed. */
FP8_API void fp8_context_destroy(fp8_context_t *ctx);

/** [out] device: the device ordinal the context was created with (FP8_DEVICE_CPU for the CPU). */
FP8_API fp8_status_t fp8_context_device(const fp8_context_t *ctx, int32_t *device);

/**
 * Sets the CUDA stream (a cudaStream_t; NULL = the legacy default stream) on which all later work of
 * this context is queued. The stream stays the caller's: it must outlive its use by the context.
 * On the CPU backend only NULL is accepted (FP8_ERR_INVALID_ARGUMENT otherwise).
 */
FP8_API fp8_status_t fp8_context_set_stream(fp8_context_t *ctx, struct CUstream_st *stream);
/** [out] stream: the stream set with fp8_context_set_stream (NULL by default). */
FP8_API fp8_status_t fp8_context_get_stream(const fp8_context_t *ctx, struct CUstream_st **stream);

/**
 * Waits until all work queued by this context has finished. Reports any asynchronous fault of that
 * work as FP8_ERR_CUDA. Synchronous.
 */
FP8_API fp8_status_t fp8_context_synchronize(fp8_context_t *ctx);

/** An application's device allocator (a framework's caching allocator): returns `bytes` bytes of the
 *  context's device memory (host memory on the CPU backend), 256-byte aligned, usable in stream
 *  order on `stream`, or NULL when it has none; the free function takes back a block it gave. */
typedef void *(*fp8_alloc_fn)(void *user, size_t bytes, int32_t device, struct CUstream_st *stream);
typedef void (*fp8_free_fn)(void *user, void *ptr, int32_t device, struct CUstream_st *stream);

/**
 * Makes the context take the device memory of everything created from it from now on (tensors,
 * models, optimizers, states) through `alloc`, and give it back through `free_fn`, called with
 * `user` (which must outlive those blocks). Both NULL: libfp8's own allocator again. A block goes
 * back to the allocator that gave it, so memory allocated before the call is unaffected. A NULL from
 * `alloc` makes the calling function fail with FP8_ERR_OUT_OF_MEMORY and change nothing. The
 * context's own workspace (made by fp8_context_create) stays libfp8's. Both functions may be called
 * from any thread that uses the context or destroys its objects. Not during graph capture.
 */
FP8_API fp8_status_t fp8_context_set_allocator(fp8_context_t *ctx, fp8_alloc_fn alloc, fp8_free_fn free_fn, void *user);

/** What a device can do. Versioned: set struct_size = sizeof(fp8_device_info_t) before the call
 *  (fp8_device_info_init does it); later releases only append fields. First release: through
 *  cublaslt_version. */
typedef struct fp8_device_info {
  uint32_t struct_size;            /**< [in] sizeof(fp8_device_info_t) as the caller compiled it */
  int32_t device;                  /**< ordinal, FP8_DEVICE_CPU for the CPU backend */
  char name[256];                  /**< device name, NUL-terminated */
  int32_t compute_capability;      /**< major*10 + minor, e.g. 90 for an H100; 0 for the CPU */
  int32_t multiprocessor_count;    /**< SMs; 0 for the CPU */
  uint64_t total_memory_bytes;     /**< global memory; 0 for the CPU */
  int32_t fp8_gemm;                /**< 1 if FP8 tensor-core GEMMs run here (sm_89 and newer) */
  int32_t fp8_block_scaling;       /**< 1 if FP8 GEMMs with per-row, 1x128 and 128x128 block scales
                                        run here: sm_90 with cuBLASLt >= 12.9 (cuBLASLt has these
                                        modes on Hopper only) */
  int32_t fp8_nccl_reduction;      /**< 1 if NCCL can reduce FP8 data natively here (NCCL >= 2.24, sm_90+) */
  int32_t nccl_version;            /**< NCCL loaded by libfp8, e.g. 22807 for 2.28.7 */
  int64_t cublaslt_version;        /**< cuBLASLt loaded by libfp8, e.g. 130100 */
} fp8_device_info_t;

/** Sets info->struct_size and zeroes the rest. */
FP8_API void fp8_device_info_init(fp8_device_info_t *info);

/** Fills `info` for `device` (FP8_DEVICE_CPU or a CUDA ordinal). [in,out] info: struct_size set to
 *  the size the caller compiled against (at least that of the first release of the struct); only
 *  fields inside that size are written. */
FP8_API fp8_status_t fp8_device_query(int32_t device, fp8_device_info_t *info);

/** [out] count: number of CUDA devices visible (0 with no driver or GPU; never an error for that). */
FP8_API fp8_status_t fp8_device_count(int32_t *count);

/* ------------------------------------------------------------------------------------------------
 * Recipe: how FP8 training is done (Accelerate's FP8RecipeKwargs, TransformerEngine's DelayedScaling
 * and MS-AMP's opt levels in one object)
 *
 * Attributes are integers. Each has a range and a default that fp8_recipe_attr_bounds returns.
 * fp8_convert_model copies the recipe it is given: changing a recipe afterwards never affects a
 * model already converted with it (convert again to apply the change).
 *
 * Text form (fp8_recipe_parse / fp8_recipe_to_string): comma-separated `key=value` pairs, spaces
 * ignored, keys and values case-insensitive; a key given twice takes its last value. Keys and values:
 *   backend=auto|te|msamp              opt_level=O1|O2|O3
 *   margin=<0..32>                     interval=<1..1000000>
 *   fp8_format=E4M3|HYBRID             amax_history_len=<1..16384>
 *   amax_compute_algo=max|most_recent
 *   override_linear_precision=<f>/<d>/<w>   each on|off|true|false|1|0, for fprop/dgrad/wgrad
 *     (also accepted one at a time: override_fprop=, override_dgrad=, override_wgrad=, which are
 *     the keys fp8_recipe_attr_bounds returns for those attributes)
 *   use_autocast_during_eval=on|off|true|false|1|0
 *   small_layer_fallback=on|off|true|false|1|0
 *   power_2_scales=auto|on|off|true|false|1|0|-1   (-1: auto, FP8_POWER_2_SCALES_AUTO)
 *   scaling=delayed|current|rowwise|block
 * --------------------------------------------------------------------------------------------- */

typedef struct fp8_recipe fp8_recipe_t;

/** Recipe attribute ids (pinned). */
typedef int32_t fp8_recipe_attr_t;
#define FP8_RECIPE_BACKEND 0           /**< FP8_BACKEND_*; default FP8_BACKEND_AUTO */
#define FP8_RECIPE_OPT_LEVEL 1         /**< FP8_OPT_O1..O3 (MS-AMP level); default FP8_OPT_O2 */
#define FP8_RECIPE_MARGIN 2            /**< scale = fp8_max * 2^-margin / amax; 0..32, default 0 */
#define FP8_RECIPE_INTERVAL 3          /**< recompute scales every N updates; 1..1000000, default 1 */
#define FP8_RECIPE_FP8_FORMAT 4        /**< FP8_FORMAT_*; default FP8_FORMAT_HYBRID */
#define FP8_RECIPE_AMAX_HISTORY_LEN 5  /**< slots of amax history; 1..16384, default 1024 */
#define FP8_RECIPE_AMAX_COMPUTE_ALGO 6 /**< FP8_AMAX_ALGO_*; default FP8_AMAX_ALGO_MOST_RECENT */
#define FP8_RECIPE_OVERRIDE_FPROP 7    /**< 1 = forward GEMM in bf16; 0..1, default 0 */
#define FP8_RECIPE_OVERRIDE_DGRAD 8    /**< 1 = input-gradient GEMM in bf16; 0..1, default 0 */
#define FP8_RECIPE_OVERRIDE_WGRAD 9    /**< 1 = weight-gradient GEMM in bf16; 0..1, default 0 */
#define FP8_RECIPE_USE_AUTOCAST_DURING_EVAL 10 /**< 1 = FP8 also in eval mode; 0..1, default 0 */
#define FP8_RECIPE_SMALL_LAYER_FALLBACK 11 /**< 1 = a Linear too small to gain from FP8 runs in high
                                                precision (the rule at fp8_layer_forward); 0 = FP8
                                                whenever the shape allows; 0..1, default 1 */
#define FP8_RECIPE_POWER_2_SCALES 12   /**< 1 = every scale rounded down to a power of two (step 3 of
                                                the delayed-scaling rule, and the other recipes'
                                                scales alike); -1 = auto (on for block scaling, off
                                                otherwise, as TransformerEngine and DeepSeek-V3 do);
                                                -1..1, default -1 */
#define FP8_RECIPE_SCALING 13          /**< FP8_SCALING_*: where a cast's scale comes from (see
                                                "Scaling state"); default FP8_SCALING_DELAYED */
#define FP8_RECIPE_ATTR_COUNT 14       /**< number of attributes (grows at the end only) */

/** The small-layer rule of FP8_RECIPE_SMALL_LAYER_FALLBACK (see "Linear"): a Linear whose
 *  in_features or out_features is below FP8_SMALL_LAYER_MIN_FEATURES, or a call of fewer than
 *  FP8_SMALL_LAYER_MIN_MACS multiply-adds per GEMM (tokens x in x out), runs in high precision. */
#define FP8_SMALL_LAYER_MIN_FEATURES 2048
#define FP8_SMALL_LAYER_MIN_MACS 4294967296ull

/** Values of FP8_RECIPE_BACKEND. AUTO prefers MS-AMP, as Accelerate documents. */
#define FP8_BACKEND_AUTO 0
#define FP8_BACKEND_TE 1
#define FP8_BACKEND_MSAMP 2
/** Values of FP8_RECIPE_OPT_LEVEL. */
#define FP8_OPT_O1 1
#define FP8_OPT_O2 2
#define FP8_OPT_O3 3
/** Values of FP8_RECIPE_FP8_FORMAT. HYBRID: E4M3 forward, E5M2 for gradients. */
#define FP8_FORMAT_E4M3 0
#define FP8_FORMAT_HYBRID 1
/** Values of FP8_RECIPE_AMAX_COMPUTE_ALGO. */
#define FP8_AMAX_ALGO_MAX 0
#define FP8_AMAX_ALGO_MOST_RECENT 1
/** Values of FP8_RECIPE_SCALING. DELAYED: TransformerEngine's DelayedScaling, Accelerate's recipe
 *  (a scale from the amax history of earlier steps). CURRENT: TransformerEngine's
 *  Float8CurrentScaling, torchao's "tensorwise" (a scale from the amax of the tensor being cast, in
 *  the same call). ROWWISE: torchao's "rowwise" (one scale per row of each GEMM operand along K, from
 *  that row's amax). BLOCK: TransformerEngine's Float8BlockScaling, DeepSeek-V3's recipe (one scale
 *  per 1x128 block along K of activations and gradients, per 128x128 block of weights). ROWWISE and
 *  BLOCK need an sm_90 GPU with cuBLASLt >= 12.9 (fp8_device_info_t.fp8_block_scaling) or the CPU
 *  backend; see "Linear in FP8" for how the Linear runs them. */
#define FP8_SCALING_DELAYED 0
#define FP8_SCALING_CURRENT 1
#define FP8_SCALING_ROWWISE 2
#define FP8_SCALING_BLOCK 3
/** Value of FP8_RECIPE_POWER_2_SCALES that leaves the choice to the scaling (on for BLOCK). */
#define FP8_POWER_2_SCALES_AUTO (-1)

/** Creates a recipe holding Accelerate's defaults (listed with each attribute above). */
FP8_API fp8_status_t fp8_recipe_create(fp8_recipe_t **out);
/** Creates an independent copy of `src`. */
FP8_API fp8_status_t fp8_recipe_clone(fp8_recipe_t **out, const fp8_recipe_t *src);
FP8_API void fp8_recipe_destroy(fp8_recipe_t *recipe);

/** Sets one attribute. A value outside the attribute's range is refused (FP8_ERR_INVALID_ARGUMENT)
 *  with a message naming the attribute and the allowed values; the recipe is then unchanged. */
FP8_API fp8_status_t fp8_recipe_set_int(fp8_recipe_t *recipe, fp8_recipe_attr_t attr, int64_t value);
/** [out] value: the attribute's current value. */
FP8_API fp8_status_t fp8_recipe_get_int(const fp8_recipe_t *recipe, fp8_recipe_attr_t attr, int64_t *value);

/** [out] min_value, max_value, default_value: the attribute's range and default (any may be NULL).
 *  [out] key: its text-form name ("margin"), static storage (may be NULL). */
FP8_API fp8_status_t fp8_recipe_attr_bounds(fp8_recipe_attr_t attr, int64_t *min_value,
                                            int64_t *max_value, int64_t *default_value,
                                            const char **key);

/**
 * Applies `text` (the text form above) to `recipe`. All or nothing: an unknown key, a malformed
 * pair or a value out of range leaves the recipe unchanged and returns FP8_ERR_INVALID_ARGUMENT with
 * a message naming the key and listing the allowed values. An empty string changes nothing.
 */
FP8_API fp8_status_t fp8_recipe_parse(fp8_recipe_t *recipe, const char *text);

/**
 * Writes the recipe's full text form, every attribute in the order of the ids (the three overrides
 * as one override_linear_precision=<f>/<d>/<w>), NUL-terminated,
 * into buf[0..cap). [out] needed (may be NULL): bytes needed including the NUL. If cap is too small
 * (buf may then be NULL with cap 0), returns FP8_ERR_BUFFER_TOO_SMALL and writes nothing to buf.
 * fp8_recipe_parse of the text gives back an equal recipe.
 */
FP8_API fp8_status_t fp8_recipe_to_string(const fp8_recipe_t *recipe, char *buf, size_t cap, size_t *needed);

/** Maps a tensor role to the FP8 dtype the recipe's format gives it: forward (activations, weights)
 *  is E4M3; backward (gradients) is E5M2 under HYBRID and E4M3 under E4M3. */
typedef int32_t fp8_role_t;
#define FP8_ROLE_FORWARD 0
#define FP8_ROLE_BACKWARD 1
FP8_API fp8_status_t fp8_recipe_dtype_for(const fp8_recipe_t *recipe, fp8_role_t role, fp8_dtype_t *dtype);

/* ------------------------------------------------------------------------------------------------
 * Tensors: N-D, row-major (the last dimension is contiguous), 0 <= ndim <= FP8_MAX_DIMS.
 *
 * A tensor lives on its context's device. FP8 tensors (E4M3/E5M2) also carry a scale_inv, one float
 * in device memory (1.0 at creation) by which their codes are multiplied when dequantised;
 * fp8_quantize sets it. A tensor with a 0 dimension is valid and empty.
 * --------------------------------------------------------------------------------------------- */

typedef struct fp8_tensor fp8_tensor_t;
#define FP8_MAX_DIMS 8

/**
 * Creates a tensor that owns newly allocated, uninitialised memory on the context's device.
 * [in] shape: ndim non-negative sizes (host memory; may be NULL when ndim is 0), each and their
 * product at most 2^62 bytes' worth of dtype (FP8_ERR_SHAPE otherwise). Synchronous.
 */
FP8_API fp8_status_t fp8_tensor_create(fp8_tensor_t **out, fp8_context_t *ctx, fp8_dtype_t dtype,
                                       int32_t ndim, const int64_t *shape);

/**
 * Creates a tensor over memory the caller owns and keeps alive while the tensor exists: device
 * memory of the context's device on a CUDA context (checked; FP8_ERR_INVALID_ARGUMENT otherwise),
 * host memory on the CPU backend. `data` must be aligned to the dtype's size (16-byte aligned data
 * takes the fastest paths); it may be NULL only when the tensor is empty.
 */
FP8_API fp8_status_t fp8_tensor_wrap(fp8_tensor_t **out, fp8_context_t *ctx, fp8_dtype_t dtype,
                                     int32_t ndim, const int64_t *shape, void *data);

/**
 * An FP8 tensor (E4M3 or E5M2; FP8_ERR_DTYPE otherwise) over the caller's `data`, as
 * fp8_tensor_wrap, whose scale_inv is the float at `scale_inv` (device memory of the context's
 * device, or host memory on the CPU backend, that the caller owns and keeps alive; its value is
 * used as it is). Allocates nothing and never synchronises, unlike fp8_tensor_wrap of an FP8 dtype
 * (which makes a scale_inv slot of 1.0): the way to hand FP8 data around on a hot path.
 */
FP8_API fp8_status_t fp8_tensor_wrap_scaled(fp8_tensor_t **out, fp8_context_t *ctx, fp8_dtype_t dtype,
                                            int32_t ndim, const int64_t *shape, void *data, float *scale_inv);

/* DLPack (dlpack/dlpack.h): the tensor exchange of PyTorch, JAX, CuPy, NumPy and others, in both of
 * its managed structs: DLManagedTensor (DLPack 0.6 or later, e.g. Debian's libdlpack-dev; the
 * Python capsules named "dltensor") and DLManagedTensorVersioned (DLPack 1.x, "dltensor_versioned",
 * which frameworks export when asked for max_version (1, 0) or later, and which carries DLPack
 * 1.1's FP8 type codes). fp8.h itself needs no DLPack header. */
struct DLManagedTensor;
struct DLManagedTensorVersioned;
/**
 * Borrows a framework's tensor (torch.utils.dlpack.to_dlpack(t), t.__dlpack__()): [out] out, a
 * tensor over managed's memory (byte_offset applied). Checked: the device (kDLCUDA with the
 * context's device id, or kDLCUDAManaged; kDLCPU or kDLCUDAHost for a CPU context:
 * FP8_ERR_INVALID_ARGUMENT naming both), the dtype (float32, float16 or bfloat16: FP8_ERR_DTYPE
 * naming it), ndim <= FP8_MAX_DIMS, the strides (NULL or those of a contiguous row-major tensor,
 * any stride on a size-1 dimension and any at all on an empty tensor, which torch exports with
 * strides such as [1, 1]; FP8_ERR_SHAPE naming them otherwise), and, as fp8_tensor_wrap checks
 * them, the sizes (none negative) and the data's alignment to the dtype's size. On success the tensor
 * owns `managed`: its deleter runs when the tensor is destroyed (or, if the tensor was lent on with
 * fp8_tensor_to_dlpack, when the last consumer is done). On failure `managed` stays the caller's.
 * Allocates no device memory and never synchronises.
 */
FP8_API fp8_status_t fp8_tensor_from_dlpack(fp8_tensor_t **out, fp8_context_t *ctx, struct DLManagedTensor *managed);
/**
 * Lends `tensor` as a DLPack tensor: [out] out, its data, shape and contiguous strides on its device
 * (kDLCUDA and the device id, or kDLCPU), dtype float32, float16 or bfloat16, and E4M3/E5M2 as
 * their uint8 codes (DLPack 0.x has no FP8 type; fp8_tensor_to_dlpack_versioned lends them with
 * DLPack 1.1's FP8 type codes; the scale_inv stays with
 * fp8_tensor_get_scale_inv). The consumer calls out->deleter when it is done (frameworks do).
 * Memory libfp8 owns (fp8_tensor_create, a model's parameters and gradients, a tensor from
 * fp8_tensor_from_dlpack(_versioned)) stays allocated until then, even after the tensor or its model is
 * destroyed; memory a tensor wraps stays the caller's to keep. A model's parameters lent this way
 * view its flat storage: when the storage moves (see "Flat storage"), the lent views keep the old
 * memory alive but no longer see the model's, so take them again. Work queued on the context's
 * stream may still be writing the memory: order the consumer after it. Allocates no device memory.
 */
FP8_API fp8_status_t fp8_tensor_to_dlpack(const fp8_tensor_t *tensor, struct DLManagedTensor **out);
/**
 * fp8_tensor_from_dlpack for DLPack 1.x's struct: the same checks, ownership and allocations, and
 * besides: managed->version.major must be 1 (else FP8_ERR_VERSION naming the version, with nothing
 * else of `managed` read; it stays the caller's to release, as on every failure), any minor version;
 * not read-only (DLPACK_FLAG_BITMASK_READ_ONLY in managed->flags: FP8_ERR_INVALID_ARGUMENT, since
 * libfp8 may write any tensor it is passed); and the dtype may also be float8_e4m3fn or float8_e5m2
 * (type codes 10 and 12, bits 8, lanes 1; torch.float8_e4m3fn and torch.float8_e5m2): an
 * FP8_DTYPE_E4M3 or E5M2 tensor made as fp8_tensor_wrap makes one, with a scale_inv of 1.0 (set it
 * with fp8_tensor_set_scale_inv; unlike the other dtypes this allocates that slot and synchronises).
 */
FP8_API fp8_status_t fp8_tensor_from_dlpack_versioned(fp8_tensor_t **out, fp8_context_t *ctx,
                                                      struct DLManagedTensorVersioned *managed);
/**
 * fp8_tensor_to_dlpack as DLPack 1.x's struct: version 1.1, flags 0, the same memory and lifetime,
 * and E4M3 / E5M2 as float8_e4m3fn / float8_e5m2 (type codes 10 and 12, bits 8; the scale_inv stays
 * with fp8_tensor_get_scale_inv). The consumer calls out->deleter when it is done.
 */
FP8_API fp8_status_t fp8_tensor_to_dlpack_versioned(const fp8_tensor_t *tensor, struct DLManagedTensorVersioned **out);

/** Releases a tensor from fp8_tensor_create, fp8_tensor_wrap(_scaled) (wrapped memory stays the
 *  caller's) or fp8_tensor_from_dlpack(_versioned) (the producer's deleter runs, unless the memory is
 *  lent on with fp8_tensor_to_dlpack(_versioned): then with the last consumer's). A tensor the library lends out (a model's parameter value or gradient, from fp8_model_parameter
 *  or fp8_model_parameter_at) belongs to its model: it is left as it is, and
 *  fp8_last_error_message() says that the model owns it (the function returns nothing). */
FP8_API void fp8_tensor_destroy(fp8_tensor_t *tensor);

/** [out] dtype. */
FP8_API fp8_status_t fp8_tensor_dtype(const fp8_tensor_t *tensor, fp8_dtype_t *dtype);
/** [out] ndim; [out] shape: if non-NULL, receives ndim sizes (caller's array of FP8_MAX_DIMS). */
FP8_API fp8_status_t fp8_tensor_shape(const fp8_tensor_t *tensor, int32_t *ndim, int64_t *shape);
/** [out] numel: number of elements (1 for ndim 0). */
FP8_API fp8_status_t fp8_tensor_numel(const fp8_tensor_t *tensor, int64_t *numel);
/** [out] data: the data pointer (device memory on a CUDA context), borrowed. */
FP8_API fp8_status_t fp8_tensor_data(const fp8_tensor_t *tensor, void **data);

/** Copies exactly numel*dtype_size bytes from host memory `src` into the tensor (`bytes` must equal
 *  that). Synchronous: `src` may be reused as soon as the call returns. */
FP8_API fp8_status_t fp8_tensor_copy_from_host(fp8_tensor_t *tensor, const void *src, size_t bytes);
/** Copies the tensor's bytes into host memory `dst` (`bytes` must equal numel*dtype_size) after all
 *  work queued on the context so far. Synchronous. */
FP8_API fp8_status_t fp8_tensor_copy_to_host(const fp8_tensor_t *tensor, void *dst, size_t bytes);

/** FP8 tensors only (FP8_ERR_DTYPE otherwise). [out] scale_inv: read after queued work. Synchronous. */
FP8_API fp8_status_t fp8_tensor_get_scale_inv(const fp8_tensor_t *tensor, float *scale_inv);
/** FP8 tensors only. Sets the dequantisation factor (must be finite and > 0). Synchronous. */
FP8_API fp8_status_t fp8_tensor_set_scale_inv(fp8_tensor_t *tensor, float scale_inv);

/* ------------------------------------------------------------------------------------------------
 * Delayed scaling state of one tensor (TransformerEngine's DelayedScaling, per tensor)
 *
 * It holds, in device memory: scale (1.0 at creation), scale_inv = 1/scale, an amax history of
 * amax_history_len slots (zeros at creation), the number of updates so far and a count of
 * non-finite amaxes seen. On the host it keeps the FP8 dtype it scales for. Because the whole rule
 * runs on the device, a CUDA graph that captured an update replays it correctly, interval included.
 *
 * During a step, fp8_quantize and fp8_amax max-accumulate the amax of their input into history slot
 * 0. fp8_scaling_update then, for each state:
 *  1. takes slot 0 as the step's amax; if it is NaN or infinite the non-finite count grows and the
 *     slot is treated as 0 (a non-finite amax never enters the history);
 *  2. a = max over the history (algo max) or slot 0 (most_recent);
 *  3. on updates number 0, interval, 2*interval, ... (counting from 0): if a is finite and > 0,
 *     scale = min((fp8_max * 2^-margin) / a, FLT_MAX), with the recipe's power_2_scales rounded
 *     down to a power of two (2^floor(log2 scale): the mantissa bits cleared; a subnormal quotient
 *     keeps its highest set bit), and scale_inv = 1/scale (exact for a power of two); otherwise
 *     (a == 0) the scale is kept;
 *  4. rolls the history: slot k+1 takes slot k's value, the oldest drops out, slot 0 becomes 0.
 * fp8_max is 448 for E4M3 and 57344 for E5M2. All arithmetic is IEEE binary32, bit-identical on
 * the CPU and the GPU.
 *
 * Current scaling (a state made from a recipe with scaling=current): every cast through the state
 * (fp8_quantize, a Linear's casts of x, W and dy) first takes a = amax(in), then
 *   scale = 1 if a is 0, NaN or infinite (a NaN or infinite a also grows the non-finite count);
 *   else scale = (fp8_max * 2^-margin) / a, FLT_MAX if that overflows, 2^-127 if it is smaller,
 *   rounded down to a power of two as above under power_2_scales,
 * with the recipe's margin and power_2_scales taken when the state was made; scale_inv = 1/scale.
 * It stores a in history slot 0 (replacing what was there), scale and scale_inv in the state, and
 * counts the cast as an update; then it casts with that scale. No element saturates (up to the
 * rounding of x * scale). This is TransformerEngine's compute_scale_from_amax with amax_epsilon 0,
 * except that a NaN in the input makes a NaN (TE's amax drops NaNs). On the GPU it reads the input
 * twice (the amax, then the cast). Such a state has no delayed update: fp8_scaling_update refuses it,
 * and the outputs that are cast inside another kernel (a GEMM's, a norm's or an activation's FP8
 * output) need a delayed state: they refuse a current one with FP8_ERR_UNSUPPORTED.
 * --------------------------------------------------------------------------------------------- */

typedef struct fp8_scaling fp8_scaling_t;

/** Creates a state for a tensor of `role` under `recipe`: its dtype is fp8_recipe_dtype_for(recipe,
 *  role), its history length the recipe's amax_history_len, and under scaling=current it keeps the
 *  recipe's margin and power_2_scales (the recipe itself is not retained). Under scaling=rowwise or
 *  block the state is a delayed per-tensor one (those recipes give the Linear's GEMM operands grids
 *  of their own; a state scales one tensor), whose updates round to powers of two under the recipe's
 *  power_2_scales (auto: on for block). Synchronous. */
FP8_API fp8_status_t fp8_scaling_create(fp8_scaling_t **out, fp8_context_t *ctx,
                                        const fp8_recipe_t *recipe, fp8_role_t role);
FP8_API void fp8_scaling_destroy(fp8_scaling_t *scaling);

/** [out] dtype: the FP8 dtype this state scales for. */
FP8_API fp8_status_t fp8_scaling_dtype(const fp8_scaling_t *scaling, fp8_dtype_t *dtype);

/** A snapshot of a state, read after all queued work. Versioned: set struct_size first
 *  (fp8_scaling_info_init); first release: through nonfinite_count. Synchronous. */
typedef struct fp8_scaling_info {
  uint32_t struct_size;       /**< [in] sizeof(fp8_scaling_info_t) */
  float scale;                /**< multiply by this before the FP8 cast */
  float scale_inv;            /**< 1/scale: multiply FP8 values by this to dequantise */
  float amax;                 /**< history slot 0: the amax accumulated since the last update */
  int32_t amax_history_len;   /**< slots in the history */
  int32_t reserved;           /**< 0; keeps the 64-bit fields 8-byte aligned on every ABI */
  int64_t update_count;       /**< fp8_scaling_update calls that included this state */
  int64_t nonfinite_count;    /**< updates whose amax was NaN or infinite */
} fp8_scaling_info_t;
FP8_API void fp8_scaling_info_init(fp8_scaling_info_t *info);
FP8_API fp8_status_t fp8_scaling_get_info(const fp8_scaling_t *scaling, fp8_scaling_info_t *info);

/** Copies the amax history into history[0..len) (len must equal amax_history_len). Synchronous. */
FP8_API fp8_status_t fp8_scaling_get_history(const fp8_scaling_t *scaling, float *history, int32_t len);

/** Sets scale (finite, > 0) and scale_inv = 1/scale, e.g. for a static scale. Synchronous. */
FP8_API fp8_status_t fp8_scaling_set_scale(fp8_scaling_t *scaling, float scale);

/**
 * Updates `count` states with `recipe`'s margin, interval and amax_compute_algo, as described above.
 * Every state must belong to `ctx`, have the recipe's amax_history_len and scale with delayed
 * scaling (a current-scaling state is refused: FP8_ERR_INVALID_ARGUMENT naming it). Asynchronous: scales stay
 * on the device; the GPU runs all states in one kernel launch (per 1024 states).
 * [in] states: host array of `count` state handles (count >= 0).
 */
FP8_API fp8_status_t fp8_scaling_update(fp8_context_t *ctx, fp8_scaling_t *const *states, int32_t count,
                                        const fp8_recipe_t *recipe);

/* ------------------------------------------------------------------------------------------------
 * Casts
 * --------------------------------------------------------------------------------------------- */

/**
 * Quantises `in` (F32, F16 or BF16) into `out` (the scaling state's FP8 dtype, same shape):
 * out = to_fp8(float(in) * scale), with `scale` read from the state in device memory, and
 * max-accumulates amax(in) = max|in| (NaN if any element is NaN, else inf if any is infinite) into
 * the state's history slot 0. Sets out's scale_inv to the state's scale_inv. A current-scaling state
 * makes the scale from amax(in) first, in the same call (see "Current scaling" above).
 * [out] out_transposed (may be NULL): also receives the codes transposed, viewing `in` as a matrix
 *   [rows, cols] with cols = last dimension and rows = the product of the others; its shape must be
 *   [cols, rows] (2-D). Written in the same pass; its scale_inv is set too.
 * Asynchronous. `out` and `out_transposed` must not overlap `in` or each other.
 */
FP8_API fp8_status_t fp8_quantize(fp8_context_t *ctx, const fp8_tensor_t *in, fp8_tensor_t *out,
                                  fp8_tensor_t *out_transposed, fp8_scaling_t *scaling);

/**
 * Dequantises FP8 `in` into `out` (F32, F16 or BF16, same number of elements and same shape):
 * out = convert(decode(in) * in.scale_inv), rounding to nearest even; a NaN gives the output type's
 * canonical quiet NaN (0x7FFFFFFF for f32, 0x7FFF for f16 and bf16). Asynchronous.
 */
FP8_API fp8_status_t fp8_dequantize(fp8_context_t *ctx, const fp8_tensor_t *in, fp8_tensor_t *out);

/**
 * Computes amax(in) = max|in| of an F32/F16/BF16 tensor (NaN if any NaN, else inf if any inf; 0 for
 * an empty tensor). [out] amax: an F32 tensor of one element (any shape with numel 1), overwritten.
 * [in,out] scaling (may be NULL): the amax is also max-accumulated into its history slot 0.
 * Asynchronous.
 */
FP8_API fp8_status_t fp8_amax(fp8_context_t *ctx, const fp8_tensor_t *in, fp8_tensor_t *amax,
                              fp8_scaling_t *scaling);

/* ------------------------------------------------------------------------------------------------
 * GEMM (cuBLASLt on the GPU; a float64-accumulating loop on the CPU reference backend)
 *
 *   D[m][n] = alpha * sa * sb * sum_k A[m][k] * B[n][k]  (+ bias[n])  (+ D[m][n] if accumulate)
 *
 * A is [.., k] (viewed as m rows of k), B is [n, k]: both K-major, the "TN" layout FP8 tensor cores
 * require, so y = x * W^T is fp8_gemm(x, W). sa and sb are the scale_inv of FP8 operands (read from
 * device memory, no host synchronisation) and 1 for BF16 operands. Combinations:
 *  - FP8: A and B E4M3 or E5M2 (not both E5M2); D BF16, F32 or E4M3, or E5M2 when an operand is
 *    E5M2 (cuBLASLt has no E4M3 x E4M3 -> E5M2); bias BF16.
 *    FP8 GEMMs need k and n to be multiples of 16 and 16-byte aligned data; other shapes are
 *    refused with FP8_ERR_SHAPE naming the dimension (pad, or use the BF16 GEMM).
 *  - High precision: A and B of one dtype, F32, F16 or BF16; D of that dtype or F32; bias of D's
 *    dtype. F32 x F32 is full FP32 (no TF32).
 * An FP8 D is written as encode(value * d_scaling.scale); amax(value) (before that scale) is
 * max-accumulated into d_scaling's history slot 0 and D's scale_inv is set to d_scaling's
 * scale_inv. accumulate is refused for an FP8 D. Results agree with the CPU reference within
 * accumulation-order rounding (and one FP8 step for an FP8 D). An empty product (m or n = 0)
 * writes nothing, not even D's scale_inv.
 * --------------------------------------------------------------------------------------------- */

/** GEMM options. Versioned: fp8_gemm_options_init sets struct_size and the defaults. First
 *  release: through fast_accumulation. */
typedef struct fp8_gemm_options {
  uint32_t struct_size;      /**< [in] sizeof(fp8_gemm_options_t) */
  float alpha;               /**< multiplies the product; default 1 */
  int32_t accumulate;        /**< 1: add the product to D (gradient accumulation); default 0 */
  int32_t fast_accumulation; /**< 1: FP8 tensor-core fast accumulation (faster, less precise; TE
                                  uses it for the forward GEMM); default 0 */
} fp8_gemm_options_t;  /* the two flags: 0 or 1 (FP8_ERR_INVALID_ARGUMENT otherwise) */

/** Sets struct_size and the defaults listed above. */
FP8_API void fp8_gemm_options_init(fp8_gemm_options_t *options);

/**
 * D = A * B^T as described above. [in] bias (may be NULL): 1-D of n elements. [in,out] d: [m, n]
 * (2-D). [in,out] d_scaling: required for an FP8 D (of D's dtype), must be NULL otherwise.
 * [in] options: NULL for the defaults. Asynchronous; uses the context's workspace, so calls on one
 * context must not overlap (they do not: they share its stream). cuBLASLt's choice of algorithm is
 * cached per shape, type combination and pointer alignment, for the context's lifetime (a workload
 * whose m varies without bound grows the cache).
 */
FP8_API fp8_status_t fp8_gemm(fp8_context_t *ctx, const fp8_tensor_t *a, const fp8_tensor_t *b,
                              const fp8_tensor_t *bias, fp8_tensor_t *d, fp8_scaling_t *d_scaling,
                              const fp8_gemm_options_t *options);

/* ------------------------------------------------------------------------------------------------
 * Scale grids: casts and GEMMs with a scale per row or per block (the rowwise and block recipes'
 * operands, for callers that drive the GEMMs themselves). Since 0.2.
 *
 * An FP8 operand viewed as a matrix [rows, cols] (cols = its last dimension, the K of the GEMM that
 * reads it) has a grid of dequantisation scales, one per cell of the mode:
 *   FP8_SCALE_MODE_ROW            one row;
 *   FP8_SCALE_MODE_BLOCK_1X128    128 consecutive elements of a row (the last may be shorter);
 *   FP8_SCALE_MODE_BLOCK_128X128  a 128 x 128 block (shorter at the bottom and right edges).
 * The grid is an F32 tensor whose shape fp8_scale_grid_shape gives, laid out as fp8_gemm_scaled
 * (cuBLASLt) reads it, with c = ceil(cols / 128):
 *   ROW            [rows, 1]: the scale of row r at r;
 *   BLOCK_1X128    [c, rows]: the scale of row r's block j at j * rows + r (one block of K, every row);
 *   BLOCK_128X128  [ceil(rows / 128), c rounded up to a multiple of 4]: block (i, j) at i * ld + j
 *                  (the padding columns are never read or written).
 * fp8_quantize_scaled's tensor `out` keeps its own scale_inv unchanged (the grid holds the scales).
 * --------------------------------------------------------------------------------------------- */

typedef int32_t fp8_scale_mode_t;
#define FP8_SCALE_MODE_ROW 1
#define FP8_SCALE_MODE_BLOCK_1X128 2
#define FP8_SCALE_MODE_BLOCK_128X128 3

/** [out] shape: the 2 sizes of the F32 grid of an FP8 operand of [rows, cols] in `mode`, as above.
 *  rows, cols >= 0, each and rows * cols at most 2^62 (an FP8 tensor's limit); FP8_ERR_SHAPE
 *  otherwise. */
FP8_API fp8_status_t fp8_scale_grid_shape(fp8_scale_mode_t mode, int64_t rows, int64_t cols, int64_t *shape);

/**
 * Quantises `in` (F32, F16 or BF16, viewed as [rows, cols]) into `out` (E4M3 or E5M2, in's shape)
 * with a scale per cell of `mode`: each the current-scaling rule (see "Current scaling") applied to
 * the amax of the cell's elements, with `recipe`'s margin and power_2_scales (auto: on for the
 * block modes, off for ROW); out_scales (F32, fp8_scale_grid_shape(mode, rows, cols)) receives
 * 1/scale per cell. [out] out_transposed (may be NULL): the [cols, rows] copy for a GEMM that reads
 * the operand transposed, quantised along its own rows from `in` (not transposed codes, except for
 * BLOCK_128X128, where the two are the same), with out_t_scales of fp8_scale_grid_shape(mode, cols,
 * rows) (NULL exactly when out_transposed is). A cell whose amax is NaN or infinite gets scale 1.
 * Bit-identical on the CPU and the GPU. The per-row mode reads `in` once on the GPU where there is
 * no transposed copy and rows fit a block (cols a multiple of 8, at most 16384; `in` and `out`
 * 16-byte aligned), else twice (the column amaxes span every row); its first call on a context of a
 * given rows + cols allocates the context's workspace for the amaxes (synchronous, not during
 * graph capture). Asynchronous. Outputs must not overlap `in` or each
 * other.
 */
FP8_API fp8_status_t fp8_quantize_scaled(fp8_context_t *ctx, const fp8_tensor_t *in, fp8_scale_mode_t mode,
                                         const fp8_recipe_t *recipe, fp8_tensor_t *out, fp8_tensor_t *out_scales,
                                         fp8_tensor_t *out_transposed, fp8_tensor_t *out_t_scales);

/**
 * D = alpha * A * B^T (+ bias) (+ D if options->accumulate) with grids of scales: a [m, k] FP8 with
 * a_scales in a_mode, b [n, k] FP8 with b_scales in b_mode (2-D, as fp8_quantize_scaled makes
 * them), d [m, n] F32 or BF16 (not FP8: its scale would need all of D first), bias (may be NULL)
 * BF16 [n]; every tensor's data 16-byte aligned (as fp8_tensor_create makes it). The mode pairs: ROW x ROW, BLOCK_1X128 x BLOCK_1X128, BLOCK_1X128 x BLOCK_128X128 and
 * BLOCK_128X128 x BLOCK_1X128 (cuBLASLt has no 128x128 x 128x128 GEMM); E5M2 x E5M2 is refused.
 * options->fast_accumulation with ROW scales only (cuBLASLt accumulates block-scaled GEMMs in full
 * precision). On the GPU it needs fp8_device_info_t.fp8_block_scaling (sm_90, cuBLASLt >= 12.9;
 * FP8_ERR_UNSUPPORTED naming the device otherwise), m and n multiples of 8 and k of 16
 * (FP8_ERR_SHAPE); the CPU backend takes any shape. Asynchronous.
 */
FP8_API fp8_status_t fp8_gemm_scaled(fp8_context_t *ctx, const fp8_tensor_t *a, fp8_scale_mode_t a_mode,
                                     const fp8_tensor_t *a_scales, const fp8_tensor_t *b, fp8_scale_mode_t b_mode,
                                     const fp8_tensor_t *b_scales, const fp8_tensor_t *bias, fp8_tensor_t *d,
                                     const fp8_gemm_options_t *options);

/* ------------------------------------------------------------------------------------------------
 * Activations (forward and backward), with an optional FP8 output for the GEMM that follows
 *
 * An FP8 output (y, or dx) is encode(value * scaling.scale), with amax(value) max-accumulated into
 * the scaling state's history slot 0 and the tensor's scale_inv set to the state's scale_inv: the
 * hand-off to the next Linear without a bf16 round trip. The scaling argument is required for an
 * FP8 output (of the output's dtype) and must be NULL otherwise. The CPU reference and the GPU use
 * the same formulas in float and agree to an ulp or two of tanhf/expf (not bit for bit).
 * --------------------------------------------------------------------------------------------- */

typedef int32_t fp8_activation_t;
#define FP8_ACTIVATION_RELU 0   /**< max(x, 0); NaN stays NaN */
#define FP8_ACTIVATION_GELU 1   /**< 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))), TransformerEngine's */
#define FP8_ACTIVATION_SWIGLU 2 /**< x = [gate | up] along the last dimension: silu(gate) * up */

/**
 * y = act(x). [in] x: F32, F16 or BF16, [.., d]. [out] y: [.., d] (SwiGLU: d must be even, y is
 * [.., d/2]), F32/F16/BF16 or FP8 with y_scaling. Asynchronous.
 */
FP8_API fp8_status_t fp8_activation_forward(fp8_context_t *ctx, fp8_activation_t activation, const fp8_tensor_t *x,
                                            fp8_tensor_t *y, fp8_scaling_t *y_scaling);

/**
 * dx = dy * act'(x). [in] x: the forward's input; [in] dy: the forward output's shape, x's dtype;
 * [out] dx: x's shape, F32/F16/BF16 or FP8 with dx_scaling (E5M2 under HYBRID). Asynchronous.
 */
FP8_API fp8_status_t fp8_activation_backward(fp8_context_t *ctx, fp8_activation_t activation, const fp8_tensor_t *x,
                                             const fp8_tensor_t *dy, fp8_tensor_t *dx, fp8_scaling_t *dx_scaling);

/* ------------------------------------------------------------------------------------------------
 * LayerNorm and RMSNorm over the last dimension, forward and backward
 *
 * For each row of x [.., d]: LayerNorm y = (x - mean) * rstd * gamma + beta with rstd =
 * 1/sqrt(var + eps) (biased variance); RMSNorm y = x * rstd * gamma with rstd = 1/sqrt(mean(x^2) +
 * eps). gamma and beta are F32 [d] (beta may be NULL: no shift; RMSNorm takes none). y may be FP8
 * (with y_scaling, as for the activations), which is the input the following Linear needs. The
 * statistics are computed in float on the GPU and in double on the CPU reference; results agree
 * within float rounding. The backward's dgamma and dbeta are summed over rows in a fixed order
 * (deterministic), using a scratch buffer the context owns.
 * --------------------------------------------------------------------------------------------- */

typedef int32_t fp8_norm_t;
#define FP8_NORM_LAYERNORM 0
#define FP8_NORM_RMSNORM 1

/**
 * [in] x: F32/F16/BF16 [.., d]. [in] gamma, beta: F32 [d] (beta NULL for RMSNorm or no shift).
 * [out] y: x's shape, F32/F16/BF16 or FP8 with y_scaling. [out] mean (LayerNorm) and rstd: F32,
 * one element per row (any shape with that many elements), saved for the backward; either may be
 * NULL when no backward follows (mean must be NULL for RMSNorm). eps > 0. Output buffers must not
 * overlap the inputs or each other. Asynchronous.
 */
FP8_API fp8_status_t fp8_norm_forward(fp8_context_t *ctx, fp8_norm_t kind, const fp8_tensor_t *x,
                                      const fp8_tensor_t *gamma, const fp8_tensor_t *beta, float eps,
                                      fp8_tensor_t *y, fp8_scaling_t *y_scaling, fp8_tensor_t *mean,
                                      fp8_tensor_t *rstd);

/**
 * [in] x, gamma: as in the forward; [in] mean (LayerNorm; NULL for RMSNorm), rstd: as the forward
 * wrote them; [in] dy: x's shape, F32/F16/BF16. [out] dx: x's shape, F32/F16/BF16. [out] dgamma:
 * F32 [d], overwritten; [out] dbeta: F32 [d] or NULL (LayerNorm with a shift), overwritten.
 * d is at most 2^20 here (the partial column sums live in the context's scratch). Outputs must not
 * overlap the inputs or each other. Asynchronous.
 */
FP8_API fp8_status_t fp8_norm_backward(fp8_context_t *ctx, fp8_norm_t kind, const fp8_tensor_t *x,
                                       const fp8_tensor_t *gamma, const fp8_tensor_t *mean,
                                       const fp8_tensor_t *rstd, const fp8_tensor_t *dy, fp8_tensor_t *dx,
                                       fp8_tensor_t *dgamma, fp8_tensor_t *dbeta);

/* ------------------------------------------------------------------------------------------------
 * Models and layers (what Accelerate's convert_model / has_transformer_engine_layers / fp8_autocast do)
 *
 * A model holds named layers: Linear (y = x W^T + b), LayerNorm, RMSNorm and activations. Each layer
 * owns FP32 parameters with FP32 gradients, reachable as tensors ("fc1.weight", "fc1.bias",
 * "ln.gamma", "ln.beta"). Weights start at zero (biases 0, gamma 1, beta 0): initialise them with
 * fp8_tensor_copy_from_host. Frameworks that own their graph call fp8_layer_forward/backward per layer.
 *
 * FP8 runs where three things hold: the layer was converted (fp8_convert_model), the call is between
 * fp8_autocast_begin and fp8_autocast_end (or the model's autowrap is on), and the model is training (or the recipe's
 * use_autocast_during_eval is on). Anywhere else a layer computes in its activations' precision.
 *
 * Linear in FP8 (per call, the "plan" shown by fp8_layer_get_report):
 *  - forward: x -> E4M3 with the input state (and, when training, its transposed copy for the weight
 *    gradient, in the same pass); the weight's FP8 copy and transpose are made with the weight state
 *    on the first forward after the weights change and reused by every micro-batch; y = x8 W8^T + b
 *    with fast accumulation.
 *  - backward: dy -> the recipe's backward format (E5M2 under HYBRID) with the gradient state, its
 *    transposed copy and the bias gradient in one pass; dx = dy8 W8 and dW += dy8^T x8 with full
 *    accumulation. override_fprop/dgrad/wgrad move a GEMM to high precision each on its own.
 *  - A Linear whose in_features or out_features is not a multiple of 16 is left unconverted by
 *    fp8_convert_model (its report says why; the other layers convert).
 *  - Automatic fallback (never an error): the whole layer runs in high precision when x (an FP8
 *    hand-off) or y is not 16-byte aligned, or,
 *    with the recipe's small_layer_fallback on, when tokens x in x out < 2^32 multiply-adds or
 *    in_features or out_features < 2048 (FP8_SMALL_LAYER_MIN_MACS, FP8_SMALL_LAYER_MIN_FEATURES;
 *    there an H100 runs a training step as fast or faster in
 *    bf16: bench/RESULTS.md, "Linear fallback rule"); only the weight gradient does
 *    when the token count is not a multiple of 16. Each fallback is counted with its reason in the
 *    layer's report.
 * Dtypes: y, dy and dx share one activation dtype, F32 or BF16; x is that dtype or an E4M3 tensor
 * written by a converted norm or activation layer (the FP8 hand-off: its own scale_inv is used).
 * The gradients of a Linear (dW, db) are FP32 and accumulate across backward calls until
 * fp8_model_zero_grad. At O1..O3 dW is an FP8 gradient: the weight-gradient GEMM writes the call's
 * dW in BF16 (F32 where it runs in high precision on F32 activations) and one pass adds it as
 * fp8_model_accumulate_grad does (since 0.2; FP32 before).
 *
 * Norms and activations compute in float from their input's dtype; once converted they may write y in
 * FP8 (pass an E4M3 y) with an output state of their own, which is the input the next Linear needs.
 *
 * Under scaling=current (the recipe's FP8_RECIPE_SCALING) every state of the model scales with
 * current scaling: a Linear casts x, its weight copy and dy each with the scale of that very tensor
 * (two reads of it on the GPU; the dy cast's transposed copy and bias gradient still come in the
 * same pass as the cast). There is no FP8 hand-off: fp8_model_forward passes the norm's or the
 * activation's output to the Linear in the activation dtype, and such a layer refuses an FP8 y
 * (FP8_ERR_UNSUPPORTED). No delayed update runs; the states show each cast's amax and scale
 * (fp8_scaling_get_info: slot 0 is the latest cast's amax, update_count counts the casts).
 *
 * Under scaling=rowwise or block the Linear's casts make grids of scales instead, each scale the
 * current-scaling rule (above) applied to the amax of the elements it covers, with the recipe's
 * margin and power_2_scales (auto: on for block):
 *  - rowwise: x and dy one scale per row along K, W one per output row; the transposed copies
 *    (x^T and dy^T for the weight gradient, W^T for dgrad) one per row of their own, i.e. per
 *    column of the source (torchao's rowwise);
 *  - block: x, dy and their transposed copies one per 1x128 block along their K, W and W^T one per
 *    128x128 block (TransformerEngine's Float8BlockScaling, DeepSeek-V3's recipe); partial blocks at
 *    the edges use the amax of the elements they have, so no dimension needs to be a multiple of 128.
 *  The transposed copies are quantised from the high-precision source along their own K (at O3 from
 *  the E4M3 weight dequantised). The forward GEMM accumulates fast under rowwise only (cuBLASLt
 *  refuses fast accumulation with block scales); the bias gradient is a pass of its own; there is no
 *  FP8 hand-off; the whole layer runs in high precision when the token count is not a multiple of 8
 *  (cuBLASLt's limit for these scales), with the reason in its report. A cell whose amax is NaN or
 *  infinite gets scale 1 and is counted in the state's nonfinite_count; the states' scales are not
 *  used. fp8_convert_model refuses these recipes with FP8_ERR_UNSUPPORTED where the device cannot
 *  run their GEMMs (fp8_device_info_t.fp8_block_scaling: sm_90 with cuBLASLt >= 12.9); the CPU
 *  backend runs them.
 *
 * Forward state: what a backward needs of its forward (the plan, x's transposed FP8 copy or a
 * reference to x, a norm's mean and rstd) is an fp8_saved_t. fp8_layer_forward_saved hands it to the
 * caller, so any number of forwards of one layer can be in flight and be differentiated in any order
 * (a layer used twice in a graph, pipeline schedules, recompute, PyTorch's autograd);
 * fp8_layer_forward/backward keep one per layer for the caller, and fp8_model_forward/backward one
 * per layer for the whole run. The x of a training-mode forward must stay alive and unchanged until
 * its backward (as in any autograd), unless fp8_saved_needs_input says its backward does not read it.
 * One backward per forward. A Linear's dx must be 16-byte aligned when its dgrad runs in FP8 (tensors
 * from fp8_tensor_create always are). Writing any parameter of a Linear (the bias too) makes it remake
 * its weight copies. Under delayed scaling the first FP8 call after weights change makes the copies
 * of every Linear that used one at this weights version or the one before, in one pass (on the GPU
 * one launch per weight dtype): the same copies, scales and recorded amaxes as each layer's own
 * first call would give, since the weight states are only updated at the end of a region. (A layer
 * that then does not run in FP8 in that region has recorded its weight's amax all the same, once:
 * after a second weights change without an FP8 call it is no longer cast.) Scaling states are updated in batched launches at the end of an autocast
 * region and of fp8_model_backward (see fp8_autocast_begin). A model is externally synchronised; calls are asynchronous
 * on the context's stream unless stated.
 * --------------------------------------------------------------------------------------------- */

typedef struct fp8_model fp8_model_t;

typedef int32_t fp8_layer_kind_t;
#define FP8_LAYER_LINEAR 0
#define FP8_LAYER_LAYERNORM 1
#define FP8_LAYER_RMSNORM 2
#define FP8_LAYER_ACTIVATION 3

/** Creates an empty model on `ctx`'s device (it keeps the context's device alive). */
FP8_API fp8_status_t fp8_model_create(fp8_model_t **out, fp8_context_t *ctx);
FP8_API void fp8_model_destroy(fp8_model_t *model);

/** Adds a Linear of weight [out_features, in_features] (and bias [out_features] if with_bias).
 *  Names are unique within a model, 1..127 bytes; dots separate the parts of torch-style module
 *  paths ("blocks.0.mlp.fc1"; no empty part). A parameter's name is the layer's, a dot, and
 *  "weight" or "bias". [out] layer_id (may be NULL): 0, 1, ...
 *  in order of addition. Synchronous (allocates and initialises the parameters). */
FP8_API fp8_status_t fp8_model_add_linear(fp8_model_t *model, const char *name, int64_t in_features,
                                          int64_t out_features, int32_t with_bias, int32_t *layer_id);
/** Adds a LayerNorm over the last dimension `dim` (gamma and beta: parameters "weight" and "bias",
 *  torch's names; earlier releases' "gamma" and "beta" still find them), eps > 0. dim is 1..2^20, the
 *  largest d fp8_norm_backward takes (the layer's backward runs it); a larger one is refused with
 *  FP8_ERR_INVALID_ARGUMENT. */
FP8_API fp8_status_t fp8_model_add_layernorm(fp8_model_t *model, const char *name, int64_t dim, float eps,
                                             int32_t *layer_id);
/** Adds an RMSNorm over the last dimension `dim` (gamma: parameter "weight"), eps > 0, dim 1..2^20 as for LayerNorm. */
FP8_API fp8_status_t fp8_model_add_rmsnorm(fp8_model_t *model, const char *name, int64_t dim, float eps,
                                           int32_t *layer_id);
/** Adds an activation layer (FP8_ACTIVATION_*; no parameters). */
FP8_API fp8_status_t fp8_model_add_activation(fp8_model_t *model, const char *name, fp8_activation_t activation,
                                              int32_t *layer_id);

/** [out] count: number of layers. */
FP8_API fp8_status_t fp8_model_layer_count(const fp8_model_t *model, int32_t *count);
/** [out] layer_id of the layer named `name`; FP8_ERR_INVALID_ARGUMENT naming it if there is none. */
FP8_API fp8_status_t fp8_model_find_layer(const fp8_model_t *model, const char *name, int32_t *layer_id);
/** [out] name: borrowed, valid while the model lives. */
FP8_API fp8_status_t fp8_model_layer_name(const fp8_model_t *model, int32_t layer_id, const char **name);

/** The parameter "<layer>.<param>" ("fc1.weight", "fc1.bias", "ln.gamma", "ln.beta"). [out] value,
 *  grad (either may be NULL): borrowed tensors, valid as long as the model (views into its flat
 *  storage, below). The model owns them: fp8_tensor_destroy leaves them alone (and says so). They
 *  are FP32, except a Linear weight once the model is converted at an MS-AMP level (see "Flat
 *  storage" and "Optimizer"): value F16 (O1/O2) or E4M3 (O3, a copy of the model's F16 master),
 *  grad E5M2 (HYBRID) or E4M3 with its scale_inv. fp8_model_write_parameter writes any of them
 *  from F32 host values. Writing a value with fp8_tensor_copy_from_host (its own dtype) is seen by
 *  the layer; after writing one any other way (your own optimizer kernel), call
 *  fp8_model_weights_changed. An FP8 gradient (which keeps its amax with it) and O3's E4M3 weight
 *  refuse fp8_tensor_copy_from_host and fp8_tensor_set_scale_inv (FP8_ERR_INVALID_STATE): add to a
 *  gradient with fp8_model_accumulate_grad, write an O3 weight with fp8_model_write_parameter. */
FP8_API fp8_status_t fp8_model_parameter(fp8_model_t *model, const char *name, fp8_tensor_t **value,
                                         fp8_tensor_t **grad);
/** Parameters in a fixed order (layers in order, then weight, bias / gamma, beta): [out] name
 *  (borrowed), value, grad (each may be NULL). index in 0..fp8_model_parameter_count-1. */
FP8_API fp8_status_t fp8_model_parameter_count(const fp8_model_t *model, int32_t *count);
FP8_API fp8_status_t fp8_model_parameter_at(fp8_model_t *model, int32_t index, const char **name,
                                            fp8_tensor_t **value, fp8_tensor_t **grad);
/**
 * Flat storage. A model's parameters live in one device allocation per (role, dtype), in the
 * parameter order above, each parameter a slice starting at a 256-byte boundary: values (F32; F16
 * Linear weights at O1/O2; E4M3 ones at O3), gradients (F32; FP8 Linear weight gradients at
 * O1..O3, E5M2 under HYBRID and E4M3 under E4M3) and O3's F16 masters. So a communication bucket
 * is a contiguous range of slices and a shard an element range. The storage level is the model's:
 * fp8_convert_model sets it from its recipe (backend te: FP32; msamp or auto: opt_level) and an
 * optimizer adopts it as it is, moving nothing. The handles fp8_model_parameter returns live as
 * long as the model. Their data pointers move only when a layer is added (before conversion; the
 * storage keeps room to append), at the first fp8_convert_model (which lays the storage out
 * exactly), at a conversion that changes the level or the FP8 gradient format (refused,
 * FP8_ERR_INVALID_STATE, while an optimizer of the model exists), and at fp8_model_set_comm (see
 * "Data parallelism": the parameters are grouped into buckets whose FP8 ranges are padded to equal
 * pieces, and at O3 the masters arena holds this rank's pieces). From the optimizer's creation on
 * they never move.
 */
typedef int32_t fp8_storage_role_t;
#define FP8_STORAGE_VALUES 0
#define FP8_STORAGE_GRADS 1
#define FP8_STORAGE_MASTERS 2
/** [out] level: 0 (FP32 Linear weights) or FP8_OPT_O1..O3, the level the model's storage is at. */
FP8_API fp8_status_t fp8_model_storage_level(const fp8_model_t *model, int32_t *level);
/** [out] data, bytes: the flat allocation of `role` holding `dtype` (device memory, borrowed) and the
 *  bytes its slices span, each slice rounded up to 256 bytes (and, data-parallel, each bucket's FP8
 *  range padded to N equal pieces); NULL and 0 when the model stores nothing
 *  of that kind. A parameter's slice starts at (char *)fp8_tensor_data(parameter) - data. The FP32
 *  gradient buffer is what a framework's own collective would all-reduce. */
FP8_API fp8_status_t fp8_model_flat_storage(fp8_model_t *model, fp8_storage_role_t role, fp8_dtype_t dtype, void **data,
                                            size_t *bytes);

/**
 * Writes host values (`dtype` F32, F16 or BF16; `bytes` = the parameter's element count times the
 * dtype's size) into parameter `index` in whatever form the model stores it: as they are into an
 * FP32 parameter, rounded to nearest even into an F16 weight (O1/O2), into the F16 master and its
 * E4M3 copy (scaled by the master's amax) at O3; an optimizer of the model takes the new amax at its
 * next step, and the layer remakes its weight copies. The way to set weights after conversion.
 * Synchronous.
 */
FP8_API fp8_status_t fp8_model_write_parameter(fp8_model_t *model, int32_t index, fp8_dtype_t dtype, const void *src,
                                               size_t bytes);

/** Tells the model its weights changed outside libfp8: the FP8 (and bf16) weight copies are remade
 *  at the next forward. */
FP8_API fp8_status_t fp8_model_weights_changed(fp8_model_t *model);
/** grad[index] += g, whatever the gradient's storage: an FP32 gradient adds g; an FP8 one (O1..O3)
 *  requantises the sum in one pass, as the Linear's backward does (for gradients computed outside
 *  libfp8, or a custom layer's): scale = fp8_max / (amax of the stored sum + amax(g)), each code
 *  encode((stored + g) * scale), and onto a gradient whose amax is 0 (zeroed) encode(g * scale).
 *  [in] g: an F32 or BF16 tensor of the parameter's element count, of the model's context (since
 *  0.2; F32 before). Asynchronous. */
FP8_API fp8_status_t fp8_model_accumulate_grad(fp8_model_t *model, int32_t index, const fp8_tensor_t *g);
/** Sets every gradient to zero. Asynchronous. */
FP8_API fp8_status_t fp8_model_zero_grad(fp8_model_t *model);
/** training = 1 (the default) or 0 (eval: no FP8 unless use_autocast_during_eval; a forward keeps
 *  nothing for a backward). */
FP8_API fp8_status_t fp8_model_set_training(fp8_model_t *model, int32_t training);

/** Which layer kinds fp8_convert_model converts, and in which direction. Versioned
 *  (fp8_convert_options_init); first release: through activation. */
typedef struct fp8_convert_options {
  uint32_t struct_size; /**< [in] sizeof(fp8_convert_options_t) */
  int32_t to_fp8;       /**< 1 (default): to FP8 under the recipe; 0: back to high precision */
  int32_t linear;       /**< 1 (default): convert Linear layers */
  int32_t norm;         /**< 1 (default): convert LayerNorm and RMSNorm layers (FP8 output) */
  int32_t activation;   /**< 1 (default): convert activation layers (FP8 output) */
} fp8_convert_options_t;
FP8_API void fp8_convert_options_init(fp8_convert_options_t *options);

/**
 * Converts the chosen layers to FP8 under `recipe` (copied; later changes to it have no effect),
 * with fresh scaling states; the others are turned back to high precision. A layer FP8 cannot run
 * (a Linear with features not multiples of 16) stays in high precision with the reason in its
 * report (fp8_layer_get_report, fp8_model_report); the others convert. With to_fp8 = 0 every
 * layer returns to high precision (recipe may be NULL). Parameters and gradients are kept either
 * way. Not allowed inside autocast. Synchronous.
 */
FP8_API fp8_status_t fp8_convert_model(fp8_model_t *model, const fp8_recipe_t *recipe,
                                       const fp8_convert_options_t *options);
/** [out] has: 1 if any layer is converted to FP8. */
FP8_API fp8_status_t fp8_model_has_fp8_layers(const fp8_model_t *model, int32_t *has);

/**
 * Autocast regions. fp8_autocast_begin starts one (FP8_ERR_INVALID_STATE if one is open: regions do
 * not nest, or if the model was never converted); fp8_autocast_end ends it (FP8_ERR_INVALID_STATE
 * without a begin) and updates, in one batched launch, every scaling state that recorded an amax
 * since its last update: the forward states of this region, and the gradient states of per-layer
 * backward calls made since (fp8_model_backward updates its own at its end). A state that recorded
 * nothing is left alone, so a layer that did not run keeps its history. Asynchronous.
 */
FP8_API fp8_status_t fp8_autocast_begin(fp8_model_t *model);
FP8_API fp8_status_t fp8_autocast_end(fp8_model_t *model);
/**
 * Autowrap (Accelerate's apply_fp8_autowrap): with on = 1, every fp8_model_forward,
 * fp8_layer_forward and fp8_layer_backward made outside an explicit region runs as a region of its
 * own, so a converted model trains in FP8 with no begin/end calls (the states it recorded are
 * updated at the end of the call). Explicit regions still work and take precedence. Default 0.
 */
FP8_API fp8_status_t fp8_model_set_autowrap(fp8_model_t *model, int32_t on);

/**
 * y = layer(x). [in] x, [out] y: tensors of the model's context; shapes [.., in] -> [.., out]
 * (Linear), [.., d] -> [.., d] (norms, activations; SwiGLU [.., 2h] -> [.., h]). See above for
 * dtypes and the FP8 rules. Errors name the layer and say what it expected. Asynchronous.
 */
FP8_API fp8_status_t fp8_layer_forward(fp8_model_t *model, int32_t layer_id, const fp8_tensor_t *x, fp8_tensor_t *y);
/**
 * Backward of the layer's latest training-mode fp8_layer_forward: [in] dy (y's shape and activation
 * dtype), [out] dx (x's shape; NULL for a Linear whose input needs no gradient), overwritten.
 * Parameter gradients accumulate. FP8_ERR_INVALID_STATE without such a forward. The convenience pair
 * keeps one forward per layer: a second training-mode fp8_layer_forward of a layer before this
 * backward is refused (FP8_ERR_INVALID_STATE; nothing runs) rather than silently replacing the first.
 * A change of training mode or a conversion drops the kept forward. Asynchronous.
 */
FP8_API fp8_status_t fp8_layer_backward(fp8_model_t *model, int32_t layer_id, const fp8_tensor_t *dy,
                                        fp8_tensor_t *dx);

/** What one forward of a layer keeps for its backward. Owned by the caller; independent of every
 *  other forward (of this layer or any other). */
typedef struct fp8_saved fp8_saved_t;

/**
 * y = layer(x), like fp8_layer_forward, and [out] saved: a new state for fp8_layer_backward_saved
 * (also in eval mode, where the backward refuses it). It holds device buffers on loan from the
 * model's pool (x's transposed FP8 copy for an FP8 weight gradient, a norm's statistics) and a
 * reference to x, which must stay alive and unchanged until its backward. The pool keeps what it
 * lent, so a steady loop allocates nothing. Asynchronous.
 */
FP8_API fp8_status_t fp8_layer_forward_saved(fp8_model_t *model, int32_t layer_id, const fp8_tensor_t *x,
                                             fp8_tensor_t *y, fp8_saved_t **saved);

/** Flags of fp8_layer_backward_saved and fp8_stack_backward_saved, for every layer kind.
 *  FP8_BACKWARD_ACCUMULATE_DX: dx += the input gradient (residual connections) instead of dx = it,
 *  as dx = round(float(dx) + value). FP8_BACKWARD_ADD_DY (since 0.2): dx = round(float(dy) + value),
 *  the gradient of y = x + f(x) whose residual is x itself (fp8_stack_forward_residual with
 *  residual = x) in the same pass, without a copy; dx takes dy's shape and dtype, and dy must be
 *  16-byte aligned. Not both. */
#define FP8_BACKWARD_ACCUMULATE_DX 1u
#define FP8_BACKWARD_ADD_DY 2u

/**
 * Backward of exactly the forward that made `saved`: [in] dy, [out] dx as in fp8_layer_backward
 * (dx NULL only for a Linear), [in] flags: 0, FP8_BACKWARD_ACCUMULATE_DX or FP8_BACKWARD_ADD_DY.
 * Parameter gradients accumulate. Refused, before anything runs, when `saved` comes from another
 * model or layer (FP8_ERR_INVALID_ARGUMENT), was already differentiated, comes from an eval-mode
 * forward, from before a conversion of the layer, or when the layer's weights changed since its
 * forward (an optimizer step or a write came between) (FP8_ERR_INVALID_STATE). On success `saved`
 * is consumed: its buffers go back to the pool and only fp8_saved_destroy remains to be called.
 * Asynchronous.
 */
FP8_API fp8_status_t fp8_layer_backward_saved(fp8_model_t *model, int32_t layer_id, fp8_saved_t *saved,
                                              const fp8_tensor_t *dy, fp8_tensor_t *dx, uint32_t flags);

/**
 * Whether the backward of `saved` will read the x of its forward: [out] needs_input 1 or 0. A norm's
 * and an activation's backward always do; a Linear's only when its weight gradient runs in high
 * precision from the caller's x (a Linear whose weight gradient runs in FP8 keeps x's transposed FP8
 * copy instead). Where it says 0, the caller may release or overwrite x as soon as the forward
 * returns (a framework need not keep the activation alive: an FP8 Linear's saved input then costs 1
 * byte per element instead of 2 or 4). 0 too for an eval-mode or consumed state. Since 0.2.
 */
FP8_API fp8_status_t fp8_saved_needs_input(const fp8_saved_t *saved, int32_t *needs_input);

/**
 * Layers [first_layer, first_layer + layer_count) as one sequential stack, each layer's y the next
 * one's x, as fp8_model_forward runs the whole model (the same checks, the same E4M3 hand-offs
 * between a converted norm or activation and a Linear that runs its forward GEMM in FP8, and the
 * same folds: a converted ReLU or GELU before a Linear that runs its forward and weight gradient in
 * FP8 while training under delayed scaling writes no output at all; that Linear's x cast applies
 * it, with the activation's output state, giving the codes, scales and amaxes of the hand-off), and
 * [out] saved: a state of the whole stack for fp8_stack_backward_saved (fp8_layer_backward_saved
 * refuses it). A framework calls it for a run of layers it treats as one operation (PyTorch's
 * nn.Sequential): the activations between them never leave libfp8. The state holds, on loan from
 * the model's pool, the activations between the layers that their backwards read (the others go
 * back to the pool when the forward returns) and each layer's own state; x must stay alive and
 * unchanged until the backward when fp8_saved_needs_input says so (the first layer's rule).
 * x: F32 or BF16, [.., in_features of the first layer]; y: the last layer's output shape, F32 or
 * BF16, the dtype of every activation between the layers; x has y's dtype unless the first layer
 * is a norm (which reads any and writes y's: an FP32 residual into a BF16 stack); x and y must not
 * overlap. Asynchronous. Since 0.2.
 */
FP8_API fp8_status_t fp8_stack_forward_saved(fp8_model_t *model, int32_t first_layer, int32_t layer_count,
                                             const fp8_tensor_t *x, fp8_tensor_t *y, fp8_saved_t **saved);

/**
 * y = residual + the stack's output, as fp8_stack_forward_saved runs layers [first_layer,
 * first_layer + layer_count), with the residual added by the last layer's GEMM (D = y, C =
 * residual, beta = 1): no pass of its own. The last layer must be a Linear (FP8_ERR_UNSUPPORTED
 * otherwise). residual and y: the stack's output shape, one dtype (F32 or BF16: a transformer's
 * residual stream); residual may be y itself or x (a pre-norm block's y = x + f(norm(x))), and
 * must otherwise not overlap y. act_dtype (F32 or BF16): the activations between the layers and
 * x's dtype (F32 or BF16 either way when the first layer is a norm); a BF16 residual takes BF16
 * activations (FP8_ERR_DTYPE otherwise). That last Linear writes y in the residual's dtype from x of
 * act_dtype (its bias BF16 when the GEMM runs in FP8, else of y's dtype), and its backward casts a
 * dy of y's dtype and gives its dx in act_dtype. A residual not 16-byte aligned sends that Linear
 * to high precision, as a misaligned y does. Its backward is fp8_stack_backward_saved with dy
 * of y's dtype: the gradient of the residual is dy itself, which FP8_BACKWARD_ADD_DY adds into dx
 * in the first layer's pass when the residual was x. Asynchronous. Since 0.2.
 */
FP8_API fp8_status_t fp8_stack_forward_residual(fp8_model_t *model, int32_t first_layer, int32_t layer_count,
                                                const fp8_tensor_t *x, const fp8_tensor_t *residual, fp8_tensor_t *y,
                                                fp8_dtype_t act_dtype, fp8_saved_t **saved);

/**
 * Backward of the fp8_stack_forward_saved that made `saved`: [in] dy (y's shape and dtype), [out]
 * dx (x's shape and dtype; NULL when x needs no gradient; overlapping neither dy nor, where
 * fp8_saved_needs_input says the first layer reads it, x), [in] flags
 * 0, FP8_BACKWARD_ACCUMULATE_DX or FP8_BACKWARD_ADD_DY. Parameter gradients accumulate. A ReLU or GELU activation layer
 * after a Linear whose dy cast runs in FP8 with its transposed copy (delayed scaling, an FP8 weight
 * gradient, and an FP8 dgrad if that Linear's dx is needed) is differentiated inside that cast: the
 * values cast, max-reduced into the gradient state and summed into the bias gradient are
 * act'(x) * dy in float, with no round trip of the activation's gradient through the activation
 * dtype (fp8_model_backward does the same). Refused before anything runs as
 * fp8_layer_backward_saved refuses a layer's state (another model's, consumed, eval mode, a layer
 * converted or weights changed since), and for a state of fp8_layer_forward_saved. On success the
 * state is consumed. Asynchronous. Since 0.2.
 */
FP8_API fp8_status_t fp8_stack_backward_saved(fp8_model_t *model, fp8_saved_t *saved, const fp8_tensor_t *dy,
                                              fp8_tensor_t *dx, uint32_t flags);

/**
 * fp8_stack_backward_saved with dx = round(float(base) + the stack's input gradient), the sum made in
 * the first layer's own pass: x's gradient from elsewhere added without a pass of its own. A pre-norm
 * block y = x + g(f(x)) with g outside libfp8 (attention) runs f as one stack and the last Linear
 * as fp8_stack_forward_residual with residual = x; the gradient of that residual (its dy) is the
 * base of f's backward. [in] base: dx's shape and dtype, 16-byte aligned, either dx itself (then
 * this is FP8_BACKWARD_ACCUMULATE_DX, with the alignment still required) or not overlapping dx;
 * [out] dx: required. Refused, before anything runs, as fp8_stack_backward_saved refuses, and for
 * a base unlike that. Asynchronous. Since 0.2.
 */
FP8_API fp8_status_t fp8_stack_backward_saved_add(fp8_model_t *model, fp8_saved_t *saved, const fp8_tensor_t *dy,
                                                  const fp8_tensor_t *base, fp8_tensor_t *dx);

/** Releases a forward state (consumed or not); NULL does nothing. It may outlive its model. */
FP8_API void fp8_saved_destroy(fp8_saved_t *saved);

/**
 * The model as one sequential stack: the layers in the order they were added, each layer's y the
 * next one's x. [in] x: [.., in_features of the first layer], F32 or BF16 (the run's activation
 * dtype); [out] y: the last layer's output shape ([.., out]) and x's dtype. Every layer's shape is
 * checked against its neighbours before anything runs (the error names both layers). The model
 * keeps the intermediate activations itself, in memory it reuses while the shapes stay the same.
 * Under FP8, a converted norm or activation whose next layer is a Linear that will run its forward
 * GEMM in FP8 hands its output over in E4M3 (no round trip through the activation dtype), and a
 * ReLU or GELU is folded into the Linear after it where it can be (see fp8_stack_forward_saved).
 * In training mode the activations are kept for fp8_model_backward; x must stay alive and unchanged
 * until then (the first layer's backward reads it). The model keeps one such forward, the latest: a
 * refused call (bad arguments, shapes, dtypes) leaves the one kept before, a call that starts drops
 * it, and only a call that succeeds keeps its own. x and y must not overlap. Asynchronous.
 * The outputs of this and every other forward and backward call (y, dx) must not overlap the
 * model's own parameters or gradients (fp8_model_parameter's tensors): FP8_ERR_INVALID_ARGUMENT.
 */
FP8_API fp8_status_t fp8_model_forward(fp8_model_t *model, const fp8_tensor_t *x, fp8_tensor_t *y);
/**
 * Backward of the latest fp8_model_forward, which must have run in training mode (FP8_ERR_INVALID_STATE
 * otherwise, and after a change of mode or a conversion since). Per-layer calls in between do not
 * disturb it. [in] dy: y's shape and dtype; [out] dx: x's shape
 * and dtype, or NULL when the input needs no gradient; it must not overlap x. Every check runs before
 * any layer does, so a refusal changes nothing. Parameter gradients accumulate. A ReLU or GELU
 * layer after a Linear is differentiated inside that Linear's dy cast where it can be (see
 * fp8_stack_backward_saved). At its end the gradient scaling states it fed are updated in one
 * batched launch. Asynchronous.
 */
FP8_API fp8_status_t fp8_model_backward(fp8_model_t *model, const fp8_tensor_t *dy, fp8_tensor_t *dx);

/** Scaling-state slots of a layer, for fp8_layer_get_scaling. */
#define FP8_SCALING_INPUT 0       /**< Linear: x */
#define FP8_SCALING_WEIGHT 1      /**< Linear: W */
#define FP8_SCALING_GRAD_OUTPUT 2 /**< Linear: dy */
#define FP8_SCALING_OUTPUT 3      /**< norm / activation: the FP8 y */
/** [out] scaling: borrowed, NULL if the layer has no state in that slot (or is not converted);
 *  valid until the next fp8_convert_model. */
FP8_API fp8_status_t fp8_layer_get_scaling(fp8_model_t *model, int32_t layer_id, int32_t slot,
                                           fp8_scaling_t **scaling);

/** What a layer did, for users and tests. Versioned: fp8_layer_report_init first; first release:
 *  through reason. */
typedef struct fp8_layer_report {
  uint32_t struct_size;   /**< [in] sizeof(fp8_layer_report_t) */
  fp8_layer_kind_t kind;  /**< FP8_LAYER_* */
  int32_t converted;      /**< 1 after fp8_convert_model made it an FP8 layer */
  int32_t fprop;          /**< precision of the latest forward's GEMM or output: 1 FP8, 0 high, -1 none yet */
  int32_t dgrad;          /**< the same for the input gradient (Linear: as planned by the forward) */
  int32_t wgrad;          /**< the same for the weight gradient (Linear) */
  int64_t fp8_calls;      /**< forwards under FP8 that ran at least one GEMM (or the output) in FP8 */
  int64_t fallback_calls; /**< forwards under FP8 that fell back in whole or in part */
  char reason[200];       /**< why the latest forward under FP8 fell back, or why conversion left the
                               layer in high precision ("not converted: ..."); "" otherwise */
  /* Second release. */
  int32_t scaling;        /**< FP8_SCALING_* of the layer's FP8 casts (the conversion recipe's); -1
                               when the layer is not converted */
  int32_t reserved;       /**< 0 */
} fp8_layer_report_t;
FP8_API void fp8_layer_report_init(fp8_layer_report_t *report);
FP8_API fp8_status_t fp8_layer_get_report(const fp8_model_t *model, int32_t layer_id, fp8_layer_report_t *report);

/** A table of every layer (name, kind, shape, converted, precisions, calls, fallback reason) as
 *  text. Writes at most `cap` bytes including the terminating NUL; [out] needed (may be NULL): the
 *  full length + 1. FP8_ERR_BUFFER_TOO_SMALL (buf untouched) when cap < needed. */
FP8_API fp8_status_t fp8_model_report(const fp8_model_t *model, char *buf, size_t cap, size_t *needed);

/* ---------------------------------------------------------------------------------------------
 * Optimizer
 *
 * Updates every parameter of a model from its gradient. One step is a few launches on the
 * context's stream and never waits for the GPU: the gradient norm, the clipping factor, the
 * non-finite check, the step count, the bias corrections and every per-tensor scale stay in device
 * memory.
 *
 * Levels. The model's storage level (fp8_convert_model's recipe: see "Flat storage") decides how
 * the Linear weights and their gradients are stored, and the optimizer keeps its states to match
 * (biases and norm parameters are FP32 with FP32 states at every level, as in MS-AMP):
 *
 *   level  chosen by                          weight         master  gradient  Adam m    Adam v       bytes/param
 *   te     unconverted model, backend=te      FP32           -       FP32      FP32      FP32         16
 *   O1     backend=msamp (or auto), O1        F16            -       FP8       FP32      FP32         11
 *   O2     backend=msamp (or auto), O2        F16            -       FP8       E4M3      F16, scaled   6
 *   O3     backend=msamp (or auto), O3        E4M3           F16     FP8       E4M3      F16, scaled   7
 *
 * backend=auto (the default) prefers MS-AMP, as Accelerate documents. SGD has no moments to keep
 * in FP8: on O2 storage (the same as O1's) it runs O1; backend=msamp at O2, and O3 storage, are
 * refused for SGD (FP8_ERR_UNSUPPORTED). The conversion rounded the values to F16 (O3: the F16
 * master, and its E4M3 copy) and carried an accumulated gradient over into FP8; the optimizer
 * moves and converts nothing, so parameter handles and data pointers stay as they are. At O1..O3 it
 * must be the model's only optimizer (others are refused, FP8_ERR_INVALID_STATE, both ways); a
 * later one adopts the stored weights and masters and starts its states afresh. Its numerics:
 *  - FP8 gradients (E5M2 under HYBRID, E4M3 under E4M3) have one scale per tensor. Each backward
 *    (micro-batch) adds its dW by requantising the sum in one pass with scale = fp8_max /
 *    (amax(stored) + amax(dW)), a bound known before the pass; an inf or NaN in dW makes the
 *    whole gradient decode as NaN until zero_grad, so the step is skipped.
 *  - m (E4M3) and v (F16) have one scale per tensor, chosen before the update pass from a bound on
 *    the new values (b1 amax(m) + (1-b1) amax(g'), b2 amax(v) + (1-b2) amax(g')^2), so one pass
 *    reads and writes every state and nothing saturates; v's scale lifts small values out of F16's
 *    subnormal range.
 *  - The update is the formula below on the decoded values, in float, then rounded back to each
 *    state's type. At O3 the F16 master is updated and the E4M3 weight written in the same pass
 *    with the scale of the master's amax at the previous step (delayed, as TransformerEngine
 *    scales weights): a weight that grew past it saturates there for one step; the master never does.
 *  - The CPU reference and the GPU give the same bits at every level. fp8_optimizer_get_stats
 *    reports the level and the bytes each level keeps (training_bytes).
 * The state is laid out for sharding: each kind of state is one flat array with a 16-element
 * aligned slice per tensor, so a rank can own a range of it.
 *
 * The update ("te": the parameters are the FP32 masters):
 *
 *   SGD:   g' = g + wd p;  b = momentum b + g' (b = g' when momentum is 0);  p -= lr b
 *   Adam:  g' = g + wd p;  m = b1 m + (1-b1) g';  v = b2 v + (1-b2) g'^2
 *          p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
 *   AdamW: Adam with wd applied to the weights instead: p *= 1 - lr wd, then the update with g' = g.
 * (PyTorch's torch.optim.SGD without dampening or Nesterov, Adam and AdamW without amsgrad.) t is the
 * number of steps applied so far, this one included. Weight decay applies to every parameter.
 *
 * Before the update, g is multiplied by min(1, max_grad_norm / (||g|| + 1e-6)) when max_grad_norm > 0,
 * where ||g|| is the L2 norm over all the model's gradients together (torch's clip_grad_norm_).
 * If any gradient holds an inf or NaN the step is skipped on the device: parameters, states and t
 * are left exactly as they were, and the skip is counted (fp8_optimizer_get_stats). Delayed scaling
 * never lets a non-finite amax into a history, so the scales stay as they were too.
 * After each step the layers remake their FP8 (and bf16) weight copies at their next forward.
 * The CPU reference and the GPU give bit-identical parameters and states (the norm is summed in
 * double in one fixed order on both).
 * --------------------------------------------------------------------------------------------- */

typedef struct fp8_optimizer fp8_optimizer_t;

typedef int32_t fp8_optimizer_kind_t;
#define FP8_OPTIMIZER_SGD 0
#define FP8_OPTIMIZER_ADAM 1
#define FP8_OPTIMIZER_ADAMW 2

/** Hyper-parameters: doubles, settable before any step (the next step uses the new value; a step
 *  reads them from device memory, so this holds for the replays of a captured step too). The step
 *  computes in float: a value that overflows float, or rounds there to 0 or out of its range, is
 *  refused (FP8_ERR_INVALID_ARGUMENT) like one out of range. */
typedef int32_t fp8_optimizer_attr_t;
#define FP8_OPTIM_LR 0            /**< learning rate, >= 0; default 1e-3 */
#define FP8_OPTIM_BETA1 1         /**< Adam(W): [0, 1); default 0.9 */
#define FP8_OPTIM_BETA2 2         /**< Adam(W): [0, 1); default 0.999 */
#define FP8_OPTIM_EPS 3           /**< Adam(W): > 0; default 1e-8 */
#define FP8_OPTIM_WEIGHT_DECAY 4  /**< >= 0; default 0 (SGD, Adam), 0.01 (AdamW) */
#define FP8_OPTIM_MOMENTUM 5      /**< SGD: [0, 1); default 0 */
#define FP8_OPTIM_MAX_GRAD_NORM 6 /**< clip to this global L2 norm, > 0; 0 (default) = no clipping */
#define FP8_OPTIM_ATTR_COUNT 7

/**
 * Creates an optimizer for every parameter `model` has now (layers added later are refused at the
 * next step). Allocates its states (zeroed) on the model's device. The optimizer keeps the model's
 * device alive but not the model: destroy it before the model. One that outlives its model keeps
 * its own state (fp8_optimizer_set_float, get_float and get_stats still work) and refuses the
 * model's work (fp8_optimizer_step, step_joint, zero_grad, checkpoint save and load) with
 * FP8_ERR_INVALID_STATE. Synchronous.
 */
FP8_API fp8_status_t fp8_optimizer_create(fp8_optimizer_t **out, fp8_model_t *model, fp8_optimizer_kind_t kind);
FP8_API void fp8_optimizer_destroy(fp8_optimizer_t *optimizer);
/** Sets or reads a hyper-parameter. A value out of range, or setting one the kind does not use
 *  (momentum for Adam, betas and eps for SGD), is refused with FP8_ERR_INVALID_ARGUMENT. Setting is
 *  synchronous (it writes the device copy the step reads): between replays of a captured step,
 *  not inside a capture. */
FP8_API fp8_status_t fp8_optimizer_set_float(fp8_optimizer_t *optimizer, fp8_optimizer_attr_t attr, double value);
FP8_API fp8_status_t fp8_optimizer_get_float(const fp8_optimizer_t *optimizer, fp8_optimizer_attr_t attr,
                                             double *value);
/** One update of every parameter from its gradient (see above). Not allowed inside autocast.
 *  Gradients are left as they are: call fp8_optimizer_zero_grad before the next accumulation.
 *  Asynchronous. */
FP8_API fp8_status_t fp8_optimizer_step(fp8_optimizer_t *optimizer);
/**
 * fp8_optimizer_step for a model trained beside parameters it does not hold (a framework's
 * embeddings and output layer, say) under one gradient clip over all of them, as torch's
 * clip_grad_norm_ over a whole module: [in] other_sumsq, an F32 tensor of one element on the
 * model's context holding the sum of the squares of those other gradients, added to the model's own
 * before the step takes its clip factor and its non-finite check (and in last_grad_norm; a
 * negative value counts as NaN); [out] clip_coef (may be NULL), an F32 tensor of one element on
 * the model's context, receives min(1, max_grad_norm / (||g|| + 1e-6)) of that joint norm (1 when
 * max_grad_norm is 0), for the caller to scale its own gradients with before its own update. Where
 * the joint norm is not finite the model's step is skipped and clip_coef is what clip_grad_norm_
 * would give: 0 for an infinite norm, NaN for a NaN one (1 without clipping). Both are read and
 * written on the context's stream, in order with the step: no synchronisation, and capturable.
 * Under data parallelism every rank passes the same value (the other gradients already averaged).
 * clip_coef must not overlap the model's parameters or gradients (FP8_ERR_INVALID_ARGUMENT).
 * Otherwise as fp8_optimizer_step. Since 0.2.
 */
FP8_API fp8_status_t fp8_optimizer_step_joint(fp8_optimizer_t *optimizer, const fp8_tensor_t *other_sumsq,
                                              fp8_tensor_t *clip_coef);
/** Sets every gradient of the model to zero (fp8_model_zero_grad). Asynchronous. */
FP8_API fp8_status_t fp8_optimizer_zero_grad(fp8_optimizer_t *optimizer);

/** What the optimizer did. Versioned: fp8_optimizer_stats_init first; first release: through
 *  state_bytes (opt_level and training_bytes came later). */
typedef struct fp8_optimizer_stats {
  uint32_t struct_size;     /**< [in] sizeof(fp8_optimizer_stats_t) */
  int64_t steps;            /**< steps applied (t) */
  int64_t skipped_steps;    /**< steps skipped for a non-finite gradient */
  int32_t last_skipped;     /**< 1 if the latest step was skipped */
  float last_grad_norm;     /**< ||g|| of the latest step, before clipping (inf/NaN when skipped) */
  int64_t parameters;       /**< number of scalar parameters updated */
  int64_t state_bytes;      /**< device bytes of optimizer state (momentum / Adam m and v) */
  int32_t opt_level;        /**< 0: te (FP32 states); FP8_OPT_O1..O3: the MS-AMP level in use */
  int64_t training_bytes;   /**< device bytes of weights, master weights, gradients, m and v, as stored
                                 (training_bytes / parameters: 16 at te, ~11 at O1, ~6 at O2, ~7 at O3) */
} fp8_optimizer_stats_t;
FP8_API void fp8_optimizer_stats_init(fp8_optimizer_stats_t *stats);
/** Synchronous: waits for the steps queued so far. */
FP8_API fp8_status_t fp8_optimizer_get_stats(const fp8_optimizer_t *optimizer, fp8_optimizer_stats_t *stats);

/* ---------------------------------------------------------------------------------------------
 * Data parallelism
 *
 * A communicator (fp8_comm_t) joins one context per rank into a group; fp8_model_set_comm makes a
 * model data-parallel over it. Every rank holds the same model and trains it on its own data; the
 * ranks agree on every scale and average every gradient, so after each step the weights are
 * bit-identical on every rank. Communicators come from:
 *  - fp8_comm_create: one process per GPU, on one host or many. One rank calls fp8_comm_get_id and
 *    the launcher hands the id to every rank (a file, MPI, torchrun's store); each rank then calls
 *    fp8_comm_create with its rank, which waits until all nranks have joined (ncclCommInitRank).
 *  - fp8_comm_create_local: every rank inside this process, made at once, each rank's calls then
 *    coming from its own thread. CUDA contexts each on a GPU of its own are joined by NCCL
 *    (ncclCommInitAll). CPU contexts, and CUDA contexts sharing a GPU (which NCCL refuses), are
 *    joined by libfp8's in-process transport, the latter through host memory (slow: for testing
 *    multi-rank code on one GPU). It runs the same data-parallel code without a GPU (tests,
 *    debugging on a laptop) and also reports ranks that call different collectives.
 *  - fp8_comm_wrap_nccl: an NCCL communicator the application already has, borrowed (libfp8 never
 *    destroys it); it must be on the context's device.
 *
 * Collective calls: on a model with a communicator, fp8_model_set_comm, fp8_optimizer_create,
 * fp8_optimizer_step, fp8_model_sync_grads, fp8_checkpoint_save, fp8_checkpoint_load,
 * fp8_model_export_safetensors, every scaling update (the end of each training forward and backward,
 * or of an autocast region) and whatever calls them, must be called by every rank, in the same
 * order. Under NCCL the step and the scaling updates are queued on the context's stream like any
 * other work and do not wait for the GPU; set_comm, optimizer_create, checkpoints and exports are
 * synchronous, and so is the first exchange after a change of the storage layout.
 *
 * What a data-parallel model does:
 *  - Scaling: each update max-reduces every delayed-scaling state's amax of the step across the ranks
 *    in one collective on the device, so every rank computes the same scales (TransformerEngine's
 *    reduce_amax); no host synchronisation.
 *  - Gradients are averaged once per optimizer step, bucket by bucket. A bucket is a run of
 *    consecutive parameters (in the model's order), closed by the parameter that brings its
 *    gradients to fp8_model_set_bucket_bytes (FP8_DEFAULT_BUCKET_BYTES: 32 MiB of gradients as
 *    stored) or beyond. By default the step averages every bucket before it updates, so the micro-batches of an
 *    accumulation do not communicate and there is nothing to mark. With
 *    fp8_model_set_backward_sync(model, 1), each backward is taken as the step's last (DDP's default):
 *    a bucket's exchange starts as soon as the backward has written every parameter of it (in
 *    fp8_model_backward, fp8_layer_backward(_saved) or fp8_model_accumulate_grad), on a communication
 *    stream of the context, while the backward goes on; the step starts the buckets no backward
 *    finished (parameters it never wrote) and makes the context's stream wait for them all (so do
 *    the end of fp8_model_backward, fp8_model_sync_grads, zero_grad, fp8_context_synchronize,
 *    fp8_context_set_stream and libfp8's copies to and from the host: work of the application that
 *    reads gradients, or runs collectives of its own communicators, belongs after one of them; a
 *    CUDA graph capture that forks the communication stream must end after one). The calls that
 *    set backward sync are not compared across the ranks: make them alike on every rank. For an accumulation, turn it off for all micro-batches but the last
 *    (DDP's no_sync). The backward's own scaling update (at its end, or at autocast_end) waits for
 *    the exchanges already started, so per-layer calls overlap best inside one region (not one
 *    autowrap region per call).
 *    fp8_model_sync_grads averages whatever is left now (for an optimizer of the application's own,
 *    or to read the averages). Whether a bucket is exchanged is decided by these calls, never by
 *    one rank's data: once it is, until the next step or zero_grad, libfp8 refuses to write its
 *    gradients again (FP8_ERR_INVALID_STATE, naming the parameter), and writes libfp8 cannot see
 *    (fp8_tensor_copy_from_host into a gradient, kernels on the flat storage) belong before it.
 *    At O3 the exchange started by a backward averages only this rank's pieces of the FP8
 *    gradients (what its step needs): read them after fp8_model_sync_grads.
 *  - FP32 gradients (every gradient at te; biases and norms at O1..O3) are summed by an FP32
 *    all-reduce and divided by the number of ranks. (A group of one rank leaves every gradient as
 *    it is: it is its own mean.)
 *  - FP8 gradients (the Linear weights' at O1..O3) travel as their own FP8 codes, 1 byte per
 *    element each way: each bucket's FP8 gradient storage is padded to N equal pieces and rank k
 *    owns piece k; it receives every rank's codes of its piece with each sender's per-tensor
 *    scale_inv and amax, decodes them and sums them in FP32 in rank order (rank 0 first), divides
 *    by the number of ranks, and requantises with scale = fp8_max / bound, where bound is the mean
 *    of the senders' amaxes (summed in float64, rounded to FP32): a bound on |mean| every rank knows
 *    before any mean is computed, so nothing is agreed in between. The pieces are then
 *    all-gathered; the tensor's amax becomes the bound. So the result has one FP8 rounding, at the
 *    end: never a sum of FP8 partial sums (MS-AMP's and NCCL's own FP8 reductions round every
 *    partial sum to FP8). Every rank ends with the same codes and scales. A piece travels in slices
 *    of at most 64 MiB (the environment variable FP8_EXCHANGE_SLICE_BYTES, read when the storage
 *    layout changes, sets another size: a whole number of bytes from 256 to 2^62; the ranks use
 *    the largest of theirs; a rank whose value is not one fails its exchange with
 *    FP8_ERR_INVALID_ARGUMENT, and the other ranks with FP8_ERR_INVALID_STATE naming it): one
 *    slice's sums run on a second stream while the next slice's codes travel. The exchange's
 *    buffers take at most 2 N min(piece, slice) bytes for the codes received, and 16 N + 4 bytes
 *    per parameter for the scales.
 *    The peer exchange: where every rank can reach every other rank's memory (ranks on GPUs of one
 *    host joined by NVLink, each process seeing every rank's GPU, in one process through
 *    cudaDeviceEnablePeerAccess or in several through CUDA IPC; the CPU ranks of
 *    fp8_comm_create_local), nothing travels through the communicator's buffers: each rank reads
 *    its piece of every rank's FP8 codes and scales where they are (over NVLink), and writes the
 *    encoded means into every rank's storage, between two barriers of the ranks' GPUs. The numbers
 *    are the same, bit for bit, no buffers are taken for received codes, and the slices follow
 *    one another on the communication stream. The environment variable FP8_PEER_EXCHANGE, read when the storage layout
 *    changes, chooses: auto (unset: the peer exchange wherever it is possible), on (where it is
 *    not, the exchange fails on every rank with FP8_ERR_UNSUPPORTED naming the two ranks and why)
 *    or off (the collectives always); the ranks use the strictest of theirs (off, then on, then
 *    auto); any other value fails like a bad FP8_EXCHANGE_SLICE_BYTES. While a model is
 *    data-parallel this way, its gradient storage is mapped into the other ranks' processes:
 *    memory from an application's allocator (fp8_context_set_allocator) that CUDA IPC cannot share
 *    makes auto choose the collectives. A barrier that the communicator's timeout or
 *    fp8_comm_abort ends leaves the rank's later peer exchanges doing nothing (the call reports
 *    FP8_ERR_NCCL). Destroying a model waits for its queued exchanges; destroy a group's models on
 *    every rank (the mappings are closed collectively when the storage layout changes, and per
 *    rank at destruction).
 *  - fp8_model_set_comm and fp8_optimizer_create start every rank from rank 0's model: its
 *    parameters (values, O3's masters and scales), gradients and scaling states are broadcast.
 *    fp8_model_set_comm lays the storage out again (in buckets, padded as above), so data
 *    pointers from fp8_model_flat_storage or fp8_tensor_data taken before it must be taken again.
 *  - Optimizer state at te, O1 and O2 is replicated: every rank steps every parameter from the same
 *    averaged gradient, as MS-AMP's O1/O2 data-parallel path does.
 *  - O3 is sharded (ZeRO): the E4M3 weights are laid out like their FP8 gradients, and each rank
 *    keeps the F16 masters and Adam's m and v of its pieces of the Linear weights only, receives only
 *    its pieces of the averaged FP8 gradients, steps them, and the E4M3 weights are all-gathered
 *    after the step (1 byte per weight). The ranks agree on
 *    the gradient norm (clipping, the non-finite skip) and on the per-tensor scales with two small
 *    all-reduces. Training state: 2 + 5/N bytes per Linear weight at N ranks (fp8_optimizer_get_stats'
 *    training_bytes counts this rank's). A sharded model keeps its group: fp8_model_set_comm,
 *    a conversion to another level and adding layers are refused on it (save a checkpoint and load
 *    it into a model built anew); checkpoints and safetensors exports gather the shares.
 *
 * Misuse: fp8_model_set_comm and fp8_optimizer_create first agree on each rank's own checks (a rank
 * that refuses makes every rank refuse), then compare the models (layers, names, shapes,
 * conversion, recipe, storage level, training and autowrap modes, bucket bytes) and the optimizer kind across the
 * ranks and refuse on every rank with FP8_ERR_INVALID_STATE, naming the first difference. Calls on
 * the training path (a step, a forward) are not worth a round trip to agree on: one refused on one
 * rank alone (inside autocast on that rank only) leaves the others waiting in their next
 * collective, which the in-process transport reports as a mismatch and NCCL does not. A rank that
 * leaves the group (its communicator and every model using it destroyed, or fp8_comm_abort) makes
 * the others' collectives fail with FP8_ERR_NCCL under the in-process transport. Under NCCL the
 * collectives of a rank whose peer is gone wait on the GPU: the first synchronous call that waits
 * for them longer than the communicator's timeout (fp8_comm_set_timeout; ten minutes unless set)
 * aborts the communicator and fails with FP8_ERR_NCCL, and an application's own watchdog may call
 * fp8_comm_abort sooner. Errors NCCL reports asynchronously (ncclCommGetAsyncError) come back as
 * FP8_ERR_NCCL with NCCL's message at the next collective call, during a synchronous wait, or at
 * fp8_context_synchronize.
 * --------------------------------------------------------------------------------------------- */

typedef struct fp8_comm fp8_comm_t;

#define FP8_COMM_ID_BYTES 128
/** The id that joins the ranks of a group (an ncclUniqueId); plain bytes to pass around. */
typedef struct fp8_comm_id {
  unsigned char bytes[FP8_COMM_ID_BYTES];
} fp8_comm_id_t;

/** [out] id: a new id for one group (ncclGetUniqueId); call on one rank, hand it to all. */
FP8_API fp8_status_t fp8_comm_get_id(fp8_comm_id_t *id);
/** Joins the group of `id` as `rank` (0 <= rank < nranks, nranks >= 1) on ctx's device; blocks until
 *  every rank has joined. CUDA contexts only (CPU ranks are joined by fp8_comm_create_local). */
FP8_API fp8_status_t fp8_comm_create(fp8_comm_t **out, fp8_context_t *ctx, int32_t nranks, int32_t rank,
                                     const fp8_comm_id_t *id);
/** Makes `nranks` communicators of one group at once: comms[k] is rank k on ctxs[k] (all CUDA or all
 *  CPU contexts, each a different one; see above for the transport). All or nothing: on failure
 *  every comms[k] is NULL. */
FP8_API fp8_status_t fp8_comm_create_local(fp8_comm_t **comms, fp8_context_t *const *ctxs, int32_t nranks);
struct ncclComm;
/** Borrows the application's NCCL communicator `nccl` (it stays the application's: destroy it after
 *  the fp8_comm_t and every model using it). It must be a communicator of ctx's device. */
FP8_API fp8_status_t fp8_comm_wrap_nccl(fp8_comm_t **out, fp8_context_t *ctx, struct ncclComm *nccl);
/** [out] rank, size: this communicator's rank and the group's number of ranks. */
FP8_API fp8_status_t fp8_comm_rank(const fp8_comm_t *comm, int32_t *rank);
FP8_API fp8_status_t fp8_comm_size(const fp8_comm_t *comm, int32_t *size);
/** Releases the handle; the group is left when the models using it are destroyed too (or detached
 *  with fp8_model_set_comm(model, NULL)). NULL does nothing. */
FP8_API void fp8_comm_destroy(fp8_comm_t *comm);
/** Thread safe, from any thread: every collective of this rank in flight or called later fails with
 *  FP8_ERR_NCCL instead of waiting (ncclCommAbort; under the in-process transport, every rank's). The
 *  communicator stays failed: destroy it. A borrowed NCCL communicator is aborted too, which frees
 *  it: the application must not destroy it afterwards. Under NCCL, call it while no other thread
 *  is inside a libfp8 call on this rank's models (NCCL's blocking communicators allow no more). */
FP8_API fp8_status_t fp8_comm_abort(fp8_comm_t *comm);
#define FP8_DEFAULT_COMM_TIMEOUT_S 600.0
/** How long a wait for the group may last, in seconds, before libfp8 gives up on it: 0 waits
 *  forever; default FP8_DEFAULT_COMM_TIMEOUT_S (ten minutes, as PyTorch's NCCL process groups).
 *  Under NCCL the waits are libfp8's synchronous calls on the communicator's context
 *  (fp8_context_synchronize, host copies, the synchronous collectives): one whose GPU work has not
 *  finished after `seconds` aborts the communicator (as fp8_comm_abort; the kernel of a collective
 *  whose peer is gone then returns) and fails with FP8_ERR_NCCL, naming the timeout. Asynchronous
 *  errors NCCL reports meanwhile end such a wait too. Under the in-process transport, a collective
 *  that waits longer for the other ranks aborts the group. Local, any thread; each rank sets its
 *  own. [in] seconds: finite, >= 0. */
FP8_API fp8_status_t fp8_comm_set_timeout(fp8_comm_t *comm, double seconds);
/** [out] seconds: the communicator's timeout (fp8_comm_set_timeout). */
FP8_API fp8_status_t fp8_comm_get_timeout(const fp8_comm_t *comm, double *seconds);

/** Makes `model` data-parallel over `comm` (collective; see above), or single-rank again with NULL
 *  (local). comm must be made from the model's context: a rank passing another context's is refused
 *  with FP8_ERR_INVALID_ARGUMENT, and through that communicator's group the other ranks refuse too
 *  (FP8_ERR_INVALID_STATE naming the rank), as for the checks below. Refused (FP8_ERR_INVALID_STATE)
 *  while an optimizer of the model exists or inside an autocast region: set the communicator first. */
FP8_API fp8_status_t fp8_model_set_comm(fp8_model_t *model, fp8_comm_t *comm);
/** Averages the model's gradients across its communicator now (collective; see above): the buckets
 *  not averaged since the last step or zero_grad; does nothing without a communicator.
 *  Asynchronous. */
FP8_API fp8_status_t fp8_model_sync_grads(fp8_model_t *model);
/** on = 1: each backward is the last before the step, and each bucket's exchange starts as soon as
 *  the backward has written it, beside the backward (see above); 0 (the default): the step
 *  exchanges. Local, but every rank must make the same calls. FP8_ERR_INVALID_STATE without a
 *  communicator. */
FP8_API fp8_status_t fp8_model_set_backward_sync(fp8_model_t *model, int32_t on);
#define FP8_DEFAULT_BUCKET_BYTES 33554432
#define FP8_MIN_BUCKET_BYTES 256
/** The gradient bytes (as stored: 4 per FP32 element, 1 per FP8 one) at which a bucket closes,
 *  >= FP8_MIN_BUCKET_BYTES; default FP8_DEFAULT_BUCKET_BYTES. Before fp8_model_set_comm
 *  (FP8_ERR_INVALID_STATE after it); the ranks must agree (fp8_model_set_comm compares it). */
FP8_API fp8_status_t fp8_model_set_bucket_bytes(fp8_model_t *model, size_t bytes);

/* ---------------------------------------------------------------------------------------------
 * Checkpoints and safetensors
 *
 * fp8_checkpoint_save writes everything needed to resume training exactly: the recipe, every
 * parameter in its stored type (FP32, F16, E4M3 with its scale), the gradients if asked, every
 * scaling state (scale, scale_inv, amax history, counters, whether an amax awaits its update), and
 * the optimizer's kind, level, hyper-parameters, step counters, m and v, F16 masters (O3) and their
 * per-tensor scales. Train N steps, save, load into a fresh process (the model built and converted
 * the same way, an optimizer of the same kind), train M more: the bits are those of N + M steps.
 * Saved between micro-batches with FP8_CHECKPOINT_GRADIENTS, it also keeps the scale of each
 * Linear's FP8 weight copy, so the remaining micro-batches and the step give the same bits too.
 *
 * The file is a versioned container: a magic number, a format version, named sections each
 * deflate-compressed (zlib) with a CRC-32, and a CRC-32 over the whole file. It is written to a
 * temporary file in the same directory, flushed, and renamed over `path`, so a crash never leaves
 * a half-written checkpoint under that name (the previous one stays).
 *
 * Loading reads and checks the whole file before it changes anything: a truncated, corrupt or
 * foreign file gives FP8_ERR_CORRUPT, one from a newer format FP8_ERR_VERSION, a model or optimizer
 * that does not match (other layers, names, sizes, conversion, optimizer kind) FP8_ERR_INVALID_STATE
 * naming the difference, a file that cannot be read FP8_ERR_IO; in each case the model and the
 * optimizer are left exactly as they were. Loading into a model converted at another level converts:
 * towards te exactly (F16 and FP8 values widen), towards O1..O3 by rounding the weights to F16 and
 * requantising m and v with fresh per-tensor scales. A checkpoint without gradients loads with the
 * gradients zeroed. All four calls are synchronous.
 *
 * On a data-parallel model (fp8_model_set_comm) save and load are collective. Every rank holds the
 * same state (at O3 its share of it, gathered first: the file holds the whole state), so rank 0
 * writes the file and the ranks agree on the outcome (a failure on rank 0 fails the call on every
 * rank); FP8_CHECKPOINT_GRADIENTS is refused (FP8_ERR_INVALID_STATE), since each rank's gradients are
 * its own until the step averages them. The ranks pass the optimizer alike, all or none
 * (FP8_ERR_INVALID_ARGUMENT on every rank otherwise). Every rank reads and checks the file (its path
 * must be readable on every host) and the ranks agree before any of them changes anything: if one
 * fails (its own checks included), every rank fails and none changes. Each rank takes its share of sharded state. A file saved by any
 * number of ranks (or by a model without a communicator) loads into any number, and trains on
 * bit-identically with the same data.
 * --------------------------------------------------------------------------------------------- */

/** Flags of fp8_checkpoint_save. */
#define FP8_CHECKPOINT_GRADIENTS 1u /**< also save the gradients (e.g. mid-accumulation) */

/** [in] optimizer: may be NULL (the model alone: parameters, O3's F16 masters, which are the
 *  model's, and scaling states). [in] path: UTF-8 file name; its directory must exist. An empty
 *  path, or one ending in '/', is FP8_ERR_INVALID_ARGUMENT here and in every call below that
 *  takes one. */
FP8_API fp8_status_t fp8_checkpoint_save(const fp8_model_t *model, const fp8_optimizer_t *optimizer,
                                         const char *path, uint32_t flags);
/** [in,out] optimizer: may be NULL (the weights and scaling states alone; the optimizer's own
 *  state is kept); if given, the file must hold optimizer state of the same kind. The model must
 *  be converted with the saved recipe (backend and opt_level may differ); its training mode is set
 *  to the saved one. */
FP8_API fp8_status_t fp8_checkpoint_load(fp8_model_t *model, fp8_optimizer_t *optimizer, const char *path);
/** The recipe a checkpoint's model was converted with, written into `recipe` (rebuild the model,
 *  convert it with this, then load). FP8_ERR_INVALID_STATE if the model was not converted;
 *  FP8_ERR_CORRUPT, as fp8_checkpoint_load, if the saved recipe does not parse (`recipe` is then
 *  unchanged). */
FP8_API fp8_status_t fp8_checkpoint_read_recipe(const char *path, fp8_recipe_t *recipe);

/** Writes the parameters as a Hugging Face safetensors file, named as the parameters ("fc1.weight"):
 *  FP32 parameters as F32, F16 weights (O1/O2) as F16, O3 weights as their F16 master. Metadata:
 *  format=pt, producer=libfp8. */
FP8_API fp8_status_t fp8_model_export_safetensors(const fp8_model_t *model, const char *path);
/** Reads every parameter from a safetensors file (F32, F16 or BF16 tensors of the parameters' names
 *  and shapes; a missing or extra tensor is refused) into the model's storage, rounding where it is
 *  narrower (at O3 into the model's F16 master and the E4M3 copy). Gradients and optimizer
 *  moments are kept. The header is checked whole, and every name, shape and dtype, before any
 *  tensor's bytes are read; then only the parameters' bytes are read (host memory: the parameters
 *  as F32, not the file). FP8_ERR_IO when the path is no regular file or cannot be read;
 *  FP8_ERR_CORRUPT when the file is malformed or gets shorter while it is read. All or nothing. */
FP8_API fp8_status_t fp8_model_import_safetensors(fp8_model_t *model, const char *path);
/** As fp8_model_import_safetensors, from a file that may hold other tensors too: a framework's whole
 *  model (a Hugging Face checkpoint) of which this libfp8 model runs the Linears and norms, its
 *  layers named as the framework names the modules (layer "h.0.mlp.c_fc" reads
 *  "h.0.mlp.c_fc.weight"). Every parameter must be in the file (FP8_ERR_INVALID_STATE naming the
 *  first missing one); the file's other tensors, of any safetensors dtype, are left alone and
 *  unread. All or nothing. */
FP8_API fp8_status_t fp8_model_import_safetensors_part(fp8_model_t *model, const char *path);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FP8_H */
