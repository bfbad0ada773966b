//! Raw bindings to libfp8's C ABI: every function, constant, typedef and struct of
//! `include/fp8.h`, written by hand (no bindgen) and named exactly as there.
//!
//! `include/fp8.h` is the reference for every contract (ownership, threading, synchronous or
//! asynchronous calls); the safe layer is the `fp8` crate. `tests/header.rs` parses the header and
//! this file and fails, listing the differences, when a function, a parameter or return type, a
//! constant's value, a typedef or a struct's fields (names, types, order, and with a C compiler
//! their offsets and sizes) differ.
//!
//! Conventions of this file, which `tests/header.rs` relies on: one item per declaration, in the
//! header's order; `pub const FP8_<NAME>: <type> = <value>;` for each `#define FP8_<NAME>`;
//! `pub type <name>_t = <name>;` beside each opaque `pub struct <name>` or `#[repr(C)]` struct;
//! `pub type <alias> = <primitive>;` for each integer typedef; every function in one `extern "C"`
//! block.

#![no_std]
#![allow(non_camel_case_types)]

use core::ffi::{c_char, c_uchar, c_void};
use core::marker::{PhantomData, PhantomPinned};

/// An incomplete C type: no size, not constructible, `!Send`, `!Sync` and `!Unpin`, so it is only
/// ever seen behind a pointer.
macro_rules! opaque {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[repr(C)]
        pub struct $name {
            _data: [u8; 0],
            _marker: PhantomData<(*mut u8, PhantomPinned)>,
        }
    };
}

/* ---- version ------------------------------------------------------------------------------- */

pub const FP8_VERSION_MAJOR: u32 = 0;
pub const FP8_VERSION_MINOR: u32 = 2;
pub const FP8_VERSION_PATCH: u32 = 0;
/// MAJOR*10000 + MINOR*100 + PATCH, the same formula as `fp8_version_number()`.
pub const FP8_VERSION_NUMBER: u32 = FP8_VERSION_MAJOR * 10000 + FP8_VERSION_MINOR * 100 + FP8_VERSION_PATCH;

opaque!(
    /// CUDA's stream type (`cudaStream_t` is `struct CUstream_st *`).
    CUstream_st
);

/* ---- status codes and errors ---------------------------------------------------------------- */

pub type fp8_status_t = i32;
pub const FP8_OK: fp8_status_t = 0;
pub const FP8_ERR_INVALID_ARGUMENT: fp8_status_t = 1;
pub const FP8_ERR_DTYPE: fp8_status_t = 2;
pub const FP8_ERR_SHAPE: fp8_status_t = 3;
pub const FP8_ERR_INVALID_STATE: fp8_status_t = 4;
pub const FP8_ERR_OUT_OF_MEMORY: fp8_status_t = 5;
pub const FP8_ERR_CUDA: fp8_status_t = 6;
pub const FP8_ERR_CUBLAS: fp8_status_t = 7;
pub const FP8_ERR_NCCL: fp8_status_t = 8;
pub const FP8_ERR_UNSUPPORTED: fp8_status_t = 9;
pub const FP8_ERR_IO: fp8_status_t = 10;
pub const FP8_ERR_CORRUPT: fp8_status_t = 11;
pub const FP8_ERR_VERSION: fp8_status_t = 12;
pub const FP8_ERR_BUFFER_TOO_SMALL: fp8_status_t = 13;
pub const FP8_ERR_NO_DEVICE: fp8_status_t = 14;
pub const FP8_ERR_INTERNAL: fp8_status_t = 15;

/* ---- data types ----------------------------------------------------------------------------- */

pub type fp8_dtype_t = i32;
pub const FP8_DTYPE_F32: fp8_dtype_t = 0;
pub const FP8_DTYPE_F16: fp8_dtype_t = 1;
pub const FP8_DTYPE_BF16: fp8_dtype_t = 2;
pub const FP8_DTYPE_E4M3: fp8_dtype_t = 3;
pub const FP8_DTYPE_E5M2: fp8_dtype_t = 4;

/* ---- context -------------------------------------------------------------------------------- */

opaque!(fp8_context);
pub type fp8_context_t = fp8_context;
pub const FP8_DEVICE_CPU: i32 = -1;

pub type fp8_alloc_fn =
    Option<unsafe extern "C" fn(user: *mut c_void, bytes: usize, device: i32, stream: *mut CUstream_st) -> *mut c_void>;
pub type fp8_free_fn =
    Option<unsafe extern "C" fn(user: *mut c_void, ptr: *mut c_void, device: i32, stream: *mut CUstream_st)>;

/// What a device can do. Versioned: `fp8_device_info_init` sets `struct_size`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fp8_device_info {
    pub struct_size: u32,
    pub device: i32,
    pub name: [c_char; 256],
    pub compute_capability: i32,
    pub multiprocessor_count: i32,
    pub total_memory_bytes: u64,
    pub fp8_gemm: i32,
    pub fp8_block_scaling: i32,
    pub fp8_nccl_reduction: i32,
    pub nccl_version: i32,
    pub cublaslt_version: i64,
}
pub type fp8_device_info_t = fp8_device_info;

/* ---- recipe --------------------------------------------------------------------------------- */

opaque!(fp8_recipe);
pub type fp8_recipe_t = fp8_recipe;

pub type fp8_recipe_attr_t = i32;
pub const FP8_RECIPE_BACKEND: fp8_recipe_attr_t = 0;
pub const FP8_RECIPE_OPT_LEVEL: fp8_recipe_attr_t = 1;
pub const FP8_RECIPE_MARGIN: fp8_recipe_attr_t = 2;
pub const FP8_RECIPE_INTERVAL: fp8_recipe_attr_t = 3;
pub const FP8_RECIPE_FP8_FORMAT: fp8_recipe_attr_t = 4;
pub const FP8_RECIPE_AMAX_HISTORY_LEN: fp8_recipe_attr_t = 5;
pub const FP8_RECIPE_AMAX_COMPUTE_ALGO: fp8_recipe_attr_t = 6;
pub const FP8_RECIPE_OVERRIDE_FPROP: fp8_recipe_attr_t = 7;
pub const FP8_RECIPE_OVERRIDE_DGRAD: fp8_recipe_attr_t = 8;
pub const FP8_RECIPE_OVERRIDE_WGRAD: fp8_recipe_attr_t = 9;
pub const FP8_RECIPE_USE_AUTOCAST_DURING_EVAL: fp8_recipe_attr_t = 10;
pub const FP8_RECIPE_SMALL_LAYER_FALLBACK: fp8_recipe_attr_t = 11;
pub const FP8_RECIPE_POWER_2_SCALES: fp8_recipe_attr_t = 12;
pub const FP8_RECIPE_SCALING: fp8_recipe_attr_t = 13;
pub const FP8_RECIPE_ATTR_COUNT: fp8_recipe_attr_t = 14;
pub const FP8_SMALL_LAYER_MIN_FEATURES: i64 = 2048;
pub const FP8_SMALL_LAYER_MIN_MACS: u64 = 4294967296;

pub const FP8_BACKEND_AUTO: i32 = 0;
pub const FP8_BACKEND_TE: i32 = 1;
pub const FP8_BACKEND_MSAMP: i32 = 2;
pub const FP8_OPT_O1: i32 = 1;
pub const FP8_OPT_O2: i32 = 2;
pub const FP8_OPT_O3: i32 = 3;
pub const FP8_FORMAT_E4M3: i32 = 0;
pub const FP8_FORMAT_HYBRID: i32 = 1;
pub const FP8_AMAX_ALGO_MAX: i32 = 0;
pub const FP8_AMAX_ALGO_MOST_RECENT: i32 = 1;
pub const FP8_SCALING_DELAYED: i32 = 0;
pub const FP8_SCALING_CURRENT: i32 = 1;
pub const FP8_SCALING_ROWWISE: i32 = 2;
pub const FP8_SCALING_BLOCK: i32 = 3;
pub const FP8_POWER_2_SCALES_AUTO: i32 = -1;

pub type fp8_scale_mode_t = i32;
pub const FP8_SCALE_MODE_ROW: fp8_scale_mode_t = 1;
pub const FP8_SCALE_MODE_BLOCK_1X128: fp8_scale_mode_t = 2;
pub const FP8_SCALE_MODE_BLOCK_128X128: fp8_scale_mode_t = 3;

pub type fp8_role_t = i32;
pub const FP8_ROLE_FORWARD: fp8_role_t = 0;
pub const FP8_ROLE_BACKWARD: fp8_role_t = 1;

/* ---- tensors -------------------------------------------------------------------------------- */

opaque!(fp8_tensor);
pub type fp8_tensor_t = fp8_tensor;
pub const FP8_MAX_DIMS: usize = 8;

opaque!(
    /// DLPack's managed tensor (dlpack/dlpack.h).
    DLManagedTensor
);
opaque!(
    /// DLPack 1.x's versioned managed tensor (dlpack/dlpack.h).
    DLManagedTensorVersioned
);

/* ---- delayed scaling ------------------------------------------------------------------------ */

opaque!(fp8_scaling);
pub type fp8_scaling_t = fp8_scaling;

/// A snapshot of a scaling state. Versioned: `fp8_scaling_info_init` sets `struct_size`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct fp8_scaling_info {
    pub struct_size: u32,
    pub scale: f32,
    pub scale_inv: f32,
    pub amax: f32,
    pub amax_history_len: i32,
    pub reserved: i32,
    pub update_count: i64,
    pub nonfinite_count: i64,
}
pub type fp8_scaling_info_t = fp8_scaling_info;

/* ---- GEMM ----------------------------------------------------------------------------------- */

/// GEMM options. Versioned: `fp8_gemm_options_init` sets `struct_size` and the defaults.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct fp8_gemm_options {
    pub struct_size: u32,
    pub alpha: f32,
    pub accumulate: i32,
    pub fast_accumulation: i32,
}
pub type fp8_gemm_options_t = fp8_gemm_options;

/* ---- activations and norms ------------------------------------------------------------------ */

pub type fp8_activation_t = i32;
pub const FP8_ACTIVATION_RELU: fp8_activation_t = 0;
pub const FP8_ACTIVATION_GELU: fp8_activation_t = 1;
pub const FP8_ACTIVATION_SWIGLU: fp8_activation_t = 2;

pub type fp8_norm_t = i32;
pub const FP8_NORM_LAYERNORM: fp8_norm_t = 0;
pub const FP8_NORM_RMSNORM: fp8_norm_t = 1;

/* ---- models and layers ---------------------------------------------------------------------- */

opaque!(fp8_model);
pub type fp8_model_t = fp8_model;

pub type fp8_layer_kind_t = i32;
pub const FP8_LAYER_LINEAR: fp8_layer_kind_t = 0;
pub const FP8_LAYER_LAYERNORM: fp8_layer_kind_t = 1;
pub const FP8_LAYER_RMSNORM: fp8_layer_kind_t = 2;
pub const FP8_LAYER_ACTIVATION: fp8_layer_kind_t = 3;

pub type fp8_storage_role_t = i32;
pub const FP8_STORAGE_VALUES: fp8_storage_role_t = 0;
pub const FP8_STORAGE_GRADS: fp8_storage_role_t = 1;
pub const FP8_STORAGE_MASTERS: fp8_storage_role_t = 2;

/// Which layer kinds `fp8_convert_model` converts. Versioned: `fp8_convert_options_init`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct fp8_convert_options {
    pub struct_size: u32,
    pub to_fp8: i32,
    pub linear: i32,
    pub norm: i32,
    pub activation: i32,
}
pub type fp8_convert_options_t = fp8_convert_options;

opaque!(fp8_saved);
pub type fp8_saved_t = fp8_saved;

pub const FP8_BACKWARD_ACCUMULATE_DX: u32 = 1;
pub const FP8_BACKWARD_ADD_DY: u32 = 2;

pub const FP8_SCALING_INPUT: i32 = 0;
pub const FP8_SCALING_WEIGHT: i32 = 1;
pub const FP8_SCALING_GRAD_OUTPUT: i32 = 2;
pub const FP8_SCALING_OUTPUT: i32 = 3;

/// What a layer did. Versioned: `fp8_layer_report_init` sets `struct_size`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fp8_layer_report {
    pub struct_size: u32,
    pub kind: fp8_layer_kind_t,
    pub converted: i32,
    pub fprop: i32,
    pub dgrad: i32,
    pub wgrad: i32,
    pub fp8_calls: i64,
    pub fallback_calls: i64,
    pub reason: [c_char; 200],
    pub scaling: i32,
    pub reserved: i32,
}
pub type fp8_layer_report_t = fp8_layer_report;

/* ---- optimizer ------------------------------------------------------------------------------ */

opaque!(fp8_optimizer);
pub type fp8_optimizer_t = fp8_optimizer;

pub type fp8_optimizer_kind_t = i32;
pub const FP8_OPTIMIZER_SGD: fp8_optimizer_kind_t = 0;
pub const FP8_OPTIMIZER_ADAM: fp8_optimizer_kind_t = 1;
pub const FP8_OPTIMIZER_ADAMW: fp8_optimizer_kind_t = 2;

pub type fp8_optimizer_attr_t = i32;
pub const FP8_OPTIM_LR: fp8_optimizer_attr_t = 0;
pub const FP8_OPTIM_BETA1: fp8_optimizer_attr_t = 1;
pub const FP8_OPTIM_BETA2: fp8_optimizer_attr_t = 2;
pub const FP8_OPTIM_EPS: fp8_optimizer_attr_t = 3;
pub const FP8_OPTIM_WEIGHT_DECAY: fp8_optimizer_attr_t = 4;
pub const FP8_OPTIM_MOMENTUM: fp8_optimizer_attr_t = 5;
pub const FP8_OPTIM_MAX_GRAD_NORM: fp8_optimizer_attr_t = 6;
pub const FP8_OPTIM_ATTR_COUNT: fp8_optimizer_attr_t = 7;

/// What the optimizer did. Versioned: `fp8_optimizer_stats_init` sets `struct_size`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct fp8_optimizer_stats {
    pub struct_size: u32,
    pub steps: i64,
    pub skipped_steps: i64,
    pub last_skipped: i32,
    pub last_grad_norm: f32,
    pub parameters: i64,
    pub state_bytes: i64,
    pub opt_level: i32,
    pub training_bytes: i64,
}
pub type fp8_optimizer_stats_t = fp8_optimizer_stats;

/* ---- data parallelism ----------------------------------------------------------------------- */

opaque!(fp8_comm);
pub type fp8_comm_t = fp8_comm;

pub const FP8_COMM_ID_BYTES: usize = 128;
/// The id that joins the ranks of a group (an ncclUniqueId): plain bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fp8_comm_id {
    pub bytes: [c_uchar; FP8_COMM_ID_BYTES],
}
pub type fp8_comm_id_t = fp8_comm_id;

opaque!(
    /// NCCL's communicator (`ncclComm_t` is `struct ncclComm *`).
    ncclComm
);

pub const FP8_DEFAULT_COMM_TIMEOUT_S: f64 = 600.0;
pub const FP8_DEFAULT_BUCKET_BYTES: usize = 33554432;
pub const FP8_MIN_BUCKET_BYTES: usize = 256;

/* ---- checkpoints ---------------------------------------------------------------------------- */

pub const FP8_CHECKPOINT_GRADIENTS: u32 = 1;

/* ---- functions ------------------------------------------------------------------------------ */

extern "C" {
    pub fn fp8_version_number() -> u32;
    pub fn fp8_version_string() -> *const c_char;
    pub fn fp8_status_string(status: fp8_status_t) -> *const c_char;
    pub fn fp8_last_error_message() -> *const c_char;

    pub fn fp8_dtype_size(dtype: fp8_dtype_t) -> usize;
    pub fn fp8_dtype_name(dtype: fp8_dtype_t) -> *const c_char;

    pub fn fp8_encode(x: f32, dtype: fp8_dtype_t) -> u8;
    pub fn fp8_decode(code: u8, dtype: fp8_dtype_t) -> f32;

    pub fn fp8_context_create(out: *mut *mut fp8_context_t, device: i32) -> fp8_status_t;
    pub fn fp8_context_destroy(ctx: *mut fp8_context_t);
    pub fn fp8_context_device(ctx: *const fp8_context_t, device: *mut i32) -> fp8_status_t;
    pub fn fp8_context_set_stream(ctx: *mut fp8_context_t, stream: *mut CUstream_st) -> fp8_status_t;
    pub fn fp8_context_get_stream(ctx: *const fp8_context_t, stream: *mut *mut CUstream_st) -> fp8_status_t;
    pub fn fp8_context_synchronize(ctx: *mut fp8_context_t) -> fp8_status_t;
    pub fn fp8_context_set_allocator(
        ctx: *mut fp8_context_t,
        alloc: fp8_alloc_fn,
        free_fn: fp8_free_fn,
        user: *mut c_void,
    ) -> fp8_status_t;

    pub fn fp8_device_info_init(info: *mut fp8_device_info_t);
    pub fn fp8_device_query(device: i32, info: *mut fp8_device_info_t) -> fp8_status_t;
    pub fn fp8_device_count(count: *mut i32) -> fp8_status_t;

    pub fn fp8_recipe_create(out: *mut *mut fp8_recipe_t) -> fp8_status_t;
    pub fn fp8_recipe_clone(out: *mut *mut fp8_recipe_t, src: *const fp8_recipe_t) -> fp8_status_t;
    pub fn fp8_recipe_destroy(recipe: *mut fp8_recipe_t);
    pub fn fp8_recipe_set_int(recipe: *mut fp8_recipe_t, attr: fp8_recipe_attr_t, value: i64) -> fp8_status_t;
    pub fn fp8_recipe_get_int(recipe: *const fp8_recipe_t, attr: fp8_recipe_attr_t, value: *mut i64) -> fp8_status_t;
    pub fn fp8_recipe_attr_bounds(
        attr: fp8_recipe_attr_t,
        min_value: *mut i64,
        max_value: *mut i64,
        default_value: *mut i64,
        key: *mut *const c_char,
    ) -> fp8_status_t;
    pub fn fp8_recipe_parse(recipe: *mut fp8_recipe_t, text: *const c_char) -> fp8_status_t;
    pub fn fp8_recipe_to_string(
        recipe: *const fp8_recipe_t,
        buf: *mut c_char,
        cap: usize,
        needed: *mut usize,
    ) -> fp8_status_t;
    pub fn fp8_recipe_dtype_for(recipe: *const fp8_recipe_t, role: fp8_role_t, dtype: *mut fp8_dtype_t)
        -> fp8_status_t;

    pub fn fp8_tensor_create(
        out: *mut *mut fp8_tensor_t,
        ctx: *mut fp8_context_t,
        dtype: fp8_dtype_t,
        ndim: i32,
        shape: *const i64,
    ) -> fp8_status_t;
    pub fn fp8_tensor_wrap(
        out: *mut *mut fp8_tensor_t,
        ctx: *mut fp8_context_t,
        dtype: fp8_dtype_t,
        ndim: i32,
        shape: *const i64,
        data: *mut c_void,
    ) -> fp8_status_t;
    pub fn fp8_tensor_wrap_scaled(
        out: *mut *mut fp8_tensor_t,
        ctx: *mut fp8_context_t,
        dtype: fp8_dtype_t,
        ndim: i32,
        shape: *const i64,
        data: *mut c_void,
        scale_inv: *mut f32,
    ) -> fp8_status_t;
    pub fn fp8_tensor_from_dlpack(
        out: *mut *mut fp8_tensor_t,
        ctx: *mut fp8_context_t,
        managed: *mut DLManagedTensor,
    ) -> fp8_status_t;
    pub fn fp8_tensor_to_dlpack(tensor: *const fp8_tensor_t, out: *mut *mut DLManagedTensor) -> fp8_status_t;
    pub fn fp8_tensor_from_dlpack_versioned(
        out: *mut *mut fp8_tensor_t,
        ctx: *mut fp8_context_t,
        managed: *mut DLManagedTensorVersioned,
    ) -> fp8_status_t;
    pub fn fp8_tensor_to_dlpack_versioned(
        tensor: *const fp8_tensor_t,
        out: *mut *mut DLManagedTensorVersioned,
    ) -> fp8_status_t;
    pub fn fp8_tensor_destroy(tensor: *mut fp8_tensor_t);
    pub fn fp8_tensor_dtype(tensor: *const fp8_tensor_t, dtype: *mut fp8_dtype_t) -> fp8_status_t;
    pub fn fp8_tensor_shape(tensor: *const fp8_tensor_t, ndim: *mut i32, shape: *mut i64) -> fp8_status_t;
    pub fn fp8_tensor_numel(tensor: *const fp8_tensor_t, numel: *mut i64) -> fp8_status_t;
    pub fn fp8_tensor_data(tensor: *const fp8_tensor_t, data: *mut *mut c_void) -> fp8_status_t;
    pub fn fp8_tensor_copy_from_host(tensor: *mut fp8_tensor_t, src: *const c_void, bytes: usize) -> fp8_status_t;
    pub fn fp8_tensor_copy_to_host(tensor: *const fp8_tensor_t, dst: *mut c_void, bytes: usize) -> fp8_status_t;
    pub fn fp8_tensor_get_scale_inv(tensor: *const fp8_tensor_t, scale_inv: *mut f32) -> fp8_status_t;
    pub fn fp8_tensor_set_scale_inv(tensor: *mut fp8_tensor_t, scale_inv: f32) -> fp8_status_t;

    pub fn fp8_scaling_create(
        out: *mut *mut fp8_scaling_t,
        ctx: *mut fp8_context_t,
        recipe: *const fp8_recipe_t,
        role: fp8_role_t,
    ) -> fp8_status_t;
    pub fn fp8_scaling_destroy(scaling: *mut fp8_scaling_t);
    pub fn fp8_scaling_dtype(scaling: *const fp8_scaling_t, dtype: *mut fp8_dtype_t) -> fp8_status_t;
    pub fn fp8_scaling_info_init(info: *mut fp8_scaling_info_t);
    pub fn fp8_scaling_get_info(scaling: *const fp8_scaling_t, info: *mut fp8_scaling_info_t) -> fp8_status_t;
    pub fn fp8_scaling_get_history(scaling: *const fp8_scaling_t, history: *mut f32, len: i32) -> fp8_status_t;
    pub fn fp8_scaling_set_scale(scaling: *mut fp8_scaling_t, scale: f32) -> fp8_status_t;
    pub fn fp8_scaling_update(
        ctx: *mut fp8_context_t,
        states: *const *mut fp8_scaling_t,
        count: i32,
        recipe: *const fp8_recipe_t,
    ) -> fp8_status_t;

    pub fn fp8_quantize(
        ctx: *mut fp8_context_t,
        in_: *const fp8_tensor_t,
        out: *mut fp8_tensor_t,
        out_transposed: *mut fp8_tensor_t,
        scaling: *mut fp8_scaling_t,
    ) -> fp8_status_t;
    pub fn fp8_dequantize(ctx: *mut fp8_context_t, in_: *const fp8_tensor_t, out: *mut fp8_tensor_t) -> fp8_status_t;
    pub fn fp8_amax(
        ctx: *mut fp8_context_t,
        in_: *const fp8_tensor_t,
        amax: *mut fp8_tensor_t,
        scaling: *mut fp8_scaling_t,
    ) -> fp8_status_t;

    pub fn fp8_gemm_options_init(options: *mut fp8_gemm_options_t);
    pub fn fp8_gemm(
        ctx: *mut fp8_context_t,
        a: *const fp8_tensor_t,
        b: *const fp8_tensor_t,
        bias: *const fp8_tensor_t,
        d: *mut fp8_tensor_t,
        d_scaling: *mut fp8_scaling_t,
        options: *const fp8_gemm_options_t,
    ) -> fp8_status_t;

    pub fn fp8_scale_grid_shape(mode: fp8_scale_mode_t, rows: i64, cols: i64, shape: *mut i64) -> fp8_status_t;
    pub fn fp8_quantize_scaled(
        ctx: *mut fp8_context_t,
        in_: *const fp8_tensor_t,
        mode: fp8_scale_mode_t,
        recipe: *const fp8_recipe_t,
        out: *mut fp8_tensor_t,
        out_scales: *mut fp8_tensor_t,
        out_transposed: *mut fp8_tensor_t,
        out_t_scales: *mut fp8_tensor_t,
    ) -> fp8_status_t;
    pub fn fp8_gemm_scaled(
        ctx: *mut fp8_context_t,
        a: *const fp8_tensor_t,
        a_mode: fp8_scale_mode_t,
        a_scales: *const fp8_tensor_t,
        b: *const fp8_tensor_t,
        b_mode: fp8_scale_mode_t,
        b_scales: *const fp8_tensor_t,
        bias: *const fp8_tensor_t,
        d: *mut fp8_tensor_t,
        options: *const fp8_gemm_options_t,
    ) -> fp8_status_t;

    pub fn fp8_activation_forward(
        ctx: *mut fp8_context_t,
        activation: fp8_activation_t,
        x: *const fp8_tensor_t,
        y: *mut fp8_tensor_t,
        y_scaling: *mut fp8_scaling_t,
    ) -> fp8_status_t;
    pub fn fp8_activation_backward(
        ctx: *mut fp8_context_t,
        activation: fp8_activation_t,
        x: *const fp8_tensor_t,
        dy: *const fp8_tensor_t,
        dx: *mut fp8_tensor_t,
        dx_scaling: *mut fp8_scaling_t,
    ) -> fp8_status_t;

    pub fn fp8_norm_forward(
        ctx: *mut fp8_context_t,
        kind: fp8_norm_t,
        x: *const fp8_tensor_t,
        gamma: *const fp8_tensor_t,
        beta: *const fp8_tensor_t,
        eps: f32,
        y: *mut fp8_tensor_t,
        y_scaling: *mut fp8_scaling_t,
        mean: *mut fp8_tensor_t,
        rstd: *mut fp8_tensor_t,
    ) -> fp8_status_t;
    pub fn fp8_norm_backward(
        ctx: *mut fp8_context_t,
        kind: fp8_norm_t,
        x: *const fp8_tensor_t,
        gamma: *const fp8_tensor_t,
        mean: *const fp8_tensor_t,
        rstd: *const fp8_tensor_t,
        dy: *const fp8_tensor_t,
        dx: *mut fp8_tensor_t,
        dgamma: *mut fp8_tensor_t,
        dbeta: *mut fp8_tensor_t,
    ) -> fp8_status_t;

    pub fn fp8_model_create(out: *mut *mut fp8_model_t, ctx: *mut fp8_context_t) -> fp8_status_t;
    pub fn fp8_model_destroy(model: *mut fp8_model_t);
    pub fn fp8_model_add_linear(
        model: *mut fp8_model_t,
        name: *const c_char,
        in_features: i64,
        out_features: i64,
        with_bias: i32,
        layer_id: *mut i32,
    ) -> fp8_status_t;
    pub fn fp8_model_add_layernorm(
        model: *mut fp8_model_t,
        name: *const c_char,
        dim: i64,
        eps: f32,
        layer_id: *mut i32,
    ) -> fp8_status_t;
    pub fn fp8_model_add_rmsnorm(
        model: *mut fp8_model_t,
        name: *const c_char,
        dim: i64,
        eps: f32,
        layer_id: *mut i32,
    ) -> fp8_status_t;
    pub fn fp8_model_add_activation(
        model: *mut fp8_model_t,
        name: *const c_char,
        activation: fp8_activation_t,
        layer_id: *mut i32,
    ) -> fp8_status_t;
    pub fn fp8_model_layer_count(model: *const fp8_model_t, count: *mut i32) -> fp8_status_t;
    pub fn fp8_model_find_layer(model: *const fp8_model_t, name: *const c_char, layer_id: *mut i32) -> fp8_status_t;
    pub fn fp8_model_layer_name(model: *const fp8_model_t, layer_id: i32, name: *mut *const c_char) -> fp8_status_t;
    pub fn fp8_model_parameter(
        model: *mut fp8_model_t,
        name: *const c_char,
        value: *mut *mut fp8_tensor_t,
        grad: *mut *mut fp8_tensor_t,
    ) -> fp8_status_t;
    pub fn fp8_model_parameter_count(model: *const fp8_model_t, count: *mut i32) -> fp8_status_t;
    pub fn fp8_model_parameter_at(
        model: *mut fp8_model_t,
        index: i32,
        name: *mut *const c_char,
        value: *mut *mut fp8_tensor_t,
        grad: *mut *mut fp8_tensor_t,
    ) -> fp8_status_t;
    pub fn fp8_model_storage_level(model: *const fp8_model_t, level: *mut i32) -> fp8_status_t;
    pub fn fp8_model_flat_storage(
        model: *mut fp8_model_t,
        role: fp8_storage_role_t,
        dtype: fp8_dtype_t,
        data: *mut *mut c_void,
        bytes: *mut usize,
    ) -> fp8_status_t;
    pub fn fp8_model_write_parameter(
        model: *mut fp8_model_t,
        index: i32,
        dtype: fp8_dtype_t,
        src: *const c_void,
        bytes: usize,
    ) -> fp8_status_t;
    pub fn fp8_model_weights_changed(model: *mut fp8_model_t) -> fp8_status_t;
    pub fn fp8_model_accumulate_grad(model: *mut fp8_model_t, index: i32, g: *const fp8_tensor_t) -> fp8_status_t;
    pub fn fp8_model_zero_grad(model: *mut fp8_model_t) -> fp8_status_t;
    pub fn fp8_model_set_training(model: *mut fp8_model_t, training: i32) -> fp8_status_t;

    pub fn fp8_convert_options_init(options: *mut fp8_convert_options_t);
    pub fn fp8_convert_model(
        model: *mut fp8_model_t,
        recipe: *const fp8_recipe_t,
        options: *const fp8_convert_options_t,
    ) -> fp8_status_t;
    pub fn fp8_model_has_fp8_layers(model: *const fp8_model_t, has: *mut i32) -> fp8_status_t;

    pub fn fp8_autocast_begin(model: *mut fp8_model_t) -> fp8_status_t;
    pub fn fp8_autocast_end(model: *mut fp8_model_t) -> fp8_status_t;
    pub fn fp8_model_set_autowrap(model: *mut fp8_model_t, on: i32) -> fp8_status_t;

    pub fn fp8_layer_forward(
        model: *mut fp8_model_t,
        layer_id: i32,
        x: *const fp8_tensor_t,
        y: *mut fp8_tensor_t,
    ) -> fp8_status_t;
    pub fn fp8_layer_backward(
        model: *mut fp8_model_t,
        layer_id: i32,
        dy: *const fp8_tensor_t,
        dx: *mut fp8_tensor_t,
    ) -> fp8_status_t;
    pub fn fp8_layer_forward_saved(
        model: *mut fp8_model_t,
        layer_id: i32,
        x: *const fp8_tensor_t,
        y: *mut fp8_tensor_t,
        saved: *mut *mut fp8_saved_t,
    ) -> fp8_status_t;
    pub fn fp8_layer_backward_saved(
        model: *mut fp8_model_t,
        layer_id: i32,
        saved: *mut fp8_saved_t,
        dy: *const fp8_tensor_t,
        dx: *mut fp8_tensor_t,
        flags: u32,
    ) -> fp8_status_t;
    pub fn fp8_saved_needs_input(saved: *const fp8_saved_t, needs_input: *mut i32) -> fp8_status_t;
    pub fn fp8_stack_forward_saved(
        model: *mut fp8_model_t,
        first_layer: i32,
        layer_count: i32,
        x: *const fp8_tensor_t,
        y: *mut fp8_tensor_t,
        saved: *mut *mut fp8_saved_t,
    ) -> fp8_status_t;
    pub fn fp8_stack_forward_residual(
        model: *mut fp8_model_t,
        first_layer: i32,
        layer_count: i32,
        x: *const fp8_tensor_t,
        residual: *const fp8_tensor_t,
        y: *mut fp8_tensor_t,
        act_dtype: fp8_dtype_t,
        saved: *mut *mut fp8_saved_t,
    ) -> fp8_status_t;
    pub fn fp8_stack_backward_saved(
        model: *mut fp8_model_t,
        saved: *mut fp8_saved_t,
        dy: *const fp8_tensor_t,
        dx: *mut fp8_tensor_t,
        flags: u32,
    ) -> fp8_status_t;
    pub fn fp8_stack_backward_saved_add(
        model: *mut fp8_model_t,
        saved: *mut fp8_saved_t,
        dy: *const fp8_tensor_t,
        base: *const fp8_tensor_t,
        dx: *mut fp8_tensor_t,
    ) -> fp8_status_t;
    pub fn fp8_saved_destroy(saved: *mut fp8_saved_t);

    pub fn fp8_model_forward(model: *mut fp8_model_t, x: *const fp8_tensor_t, y: *mut fp8_tensor_t) -> fp8_status_t;
    pub fn fp8_model_backward(model: *mut fp8_model_t, dy: *const fp8_tensor_t, dx: *mut fp8_tensor_t) -> fp8_status_t;

    pub fn fp8_layer_get_scaling(
        model: *mut fp8_model_t,
        layer_id: i32,
        slot: i32,
        scaling: *mut *mut fp8_scaling_t,
    ) -> fp8_status_t;
    pub fn fp8_layer_report_init(report: *mut fp8_layer_report_t);
    pub fn fp8_layer_get_report(
        model: *const fp8_model_t,
        layer_id: i32,
        report: *mut fp8_layer_report_t,
    ) -> fp8_status_t;
    pub fn fp8_model_report(
        model: *const fp8_model_t,
        buf: *mut c_char,
        cap: usize,
        needed: *mut usize,
    ) -> fp8_status_t;

    pub fn fp8_optimizer_create(
        out: *mut *mut fp8_optimizer_t,
        model: *mut fp8_model_t,
        kind: fp8_optimizer_kind_t,
    ) -> fp8_status_t;
    pub fn fp8_optimizer_destroy(optimizer: *mut fp8_optimizer_t);
    pub fn fp8_optimizer_set_float(
        optimizer: *mut fp8_optimizer_t,
        attr: fp8_optimizer_attr_t,
        value: f64,
    ) -> fp8_status_t;
    pub fn fp8_optimizer_get_float(
        optimizer: *const fp8_optimizer_t,
        attr: fp8_optimizer_attr_t,
        value: *mut f64,
    ) -> fp8_status_t;
    pub fn fp8_optimizer_step(optimizer: *mut fp8_optimizer_t) -> fp8_status_t;
    pub fn fp8_optimizer_step_joint(
        optimizer: *mut fp8_optimizer_t,
        other_sumsq: *const fp8_tensor_t,
        clip_coef: *mut fp8_tensor_t,
    ) -> fp8_status_t;
    pub fn fp8_optimizer_zero_grad(optimizer: *mut fp8_optimizer_t) -> fp8_status_t;
    pub fn fp8_optimizer_stats_init(stats: *mut fp8_optimizer_stats_t);
    pub fn fp8_optimizer_get_stats(
        optimizer: *const fp8_optimizer_t,
        stats: *mut fp8_optimizer_stats_t,
    ) -> fp8_status_t;

    pub fn fp8_comm_get_id(id: *mut fp8_comm_id_t) -> fp8_status_t;
    pub fn fp8_comm_create(
        out: *mut *mut fp8_comm_t,
        ctx: *mut fp8_context_t,
        nranks: i32,
        rank: i32,
        id: *const fp8_comm_id_t,
    ) -> fp8_status_t;
    pub fn fp8_comm_create_local(
        comms: *mut *mut fp8_comm_t,
        ctxs: *const *mut fp8_context_t,
        nranks: i32,
    ) -> fp8_status_t;
    pub fn fp8_comm_wrap_nccl(out: *mut *mut fp8_comm_t, ctx: *mut fp8_context_t, nccl: *mut ncclComm) -> fp8_status_t;
    pub fn fp8_comm_rank(comm: *const fp8_comm_t, rank: *mut i32) -> fp8_status_t;
    pub fn fp8_comm_size(comm: *const fp8_comm_t, size: *mut i32) -> fp8_status_t;
    pub fn fp8_comm_destroy(comm: *mut fp8_comm_t);
    pub fn fp8_comm_abort(comm: *mut fp8_comm_t) -> fp8_status_t;
    pub fn fp8_comm_set_timeout(comm: *mut fp8_comm_t, seconds: f64) -> fp8_status_t;
    pub fn fp8_comm_get_timeout(comm: *const fp8_comm_t, seconds: *mut f64) -> fp8_status_t;

    pub fn fp8_model_set_comm(model: *mut fp8_model_t, comm: *mut fp8_comm_t) -> fp8_status_t;
    pub fn fp8_model_sync_grads(model: *mut fp8_model_t) -> fp8_status_t;
    pub fn fp8_model_set_backward_sync(model: *mut fp8_model_t, on: i32) -> fp8_status_t;
    pub fn fp8_model_set_bucket_bytes(model: *mut fp8_model_t, bytes: usize) -> fp8_status_t;

    pub fn fp8_checkpoint_save(
        model: *const fp8_model_t,
        optimizer: *const fp8_optimizer_t,
        path: *const c_char,
        flags: u32,
    ) -> fp8_status_t;
    pub fn fp8_checkpoint_load(
        model: *mut fp8_model_t,
        optimizer: *mut fp8_optimizer_t,
        path: *const c_char,
    ) -> fp8_status_t;
    pub fn fp8_checkpoint_read_recipe(path: *const c_char, recipe: *mut fp8_recipe_t) -> fp8_status_t;
    pub fn fp8_model_export_safetensors(model: *const fp8_model_t, path: *const c_char) -> fp8_status_t;
    pub fn fp8_model_import_safetensors(model: *mut fp8_model_t, path: *const c_char) -> fp8_status_t;
    pub fn fp8_model_import_safetensors_part(model: *mut fp8_model_t, path: *const c_char) -> fp8_status_t;
}
