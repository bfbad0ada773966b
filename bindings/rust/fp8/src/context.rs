//! Contexts (a device, its stream and resources) and what can be asked of the devices.

use crate::error::{check, created, Result};
use fp8_sys as sys;
use std::ffi::CStr;
use std::ptr::{self, NonNull};

/// A context on one device: `Context::cpu()` for libfp8's CPU reference backend, or a CUDA
/// device. Everything made from it (tensors, models, scaling states, communicators) borrows it,
/// so none of them can outlive it in Rust (libfp8 itself would keep its resources alive) and,
/// above all, it cannot move to another thread while any of them exists.
pub struct Context {
    raw: NonNull<sys::fp8_context_t>,
}

// SAFETY: fp8.h: "one thread at a time may use a context and everything created from it.
// Different contexts may be used from different threads at once." Every object this crate makes
// from a context holds a shared borrow of it (`Tensor<'c>`, `Model<'c>`, ...), and those objects
// are neither Send nor Sync. So a Context can only be moved to another thread when nothing made
// from it is alive, which moves "the context and everything created from it" as one: a single
// thread uses them at any time. Context is not Sync: `&Context` shared across threads would let
// two threads make and use its objects at once.
unsafe impl Send for Context {}

impl Context {
    /// A context on `device`: `fp8_sys::FP8_DEVICE_CPU` (-1) or a CUDA ordinal. A CUDA device must
    /// be compute capability 8.9 or newer (FP8_ERR_UNSUPPORTED otherwise).
    pub fn new(device: i32) -> Result<Context> {
        let mut raw = ptr::null_mut();
        // SAFETY: out-parameter written only on success.
        check(unsafe { sys::fp8_context_create(&mut raw, device) })?;
        Ok(Context { raw: created(raw, "fp8_context_create")? })
    }

    /// libfp8's CPU reference backend.
    pub fn cpu() -> Result<Context> {
        Context::new(sys::FP8_DEVICE_CPU)
    }

    /// CUDA device `ordinal`.
    pub fn cuda(ordinal: i32) -> Result<Context> {
        Context::new(ordinal)
    }

    /// The device ordinal it was made with (`FP8_DEVICE_CPU` for the CPU).
    pub fn device(&self) -> Result<i32> {
        let mut device = 0;
        check(unsafe { sys::fp8_context_device(self.raw.as_ptr(), &mut device) })?;
        Ok(device)
    }

    /// Waits until all work queued by this context has finished; reports an asynchronous fault
    /// of that work.
    pub fn synchronize(&self) -> Result<()> {
        check(unsafe { sys::fp8_context_synchronize(self.raw.as_ptr()) })
    }

    /// Queues all later work of this context on `stream` (a `cudaStream_t`; NULL: the legacy
    /// default stream). The CPU backend accepts only NULL.
    ///
    /// # Safety
    /// `stream` must be NULL or a live CUDA stream of the context's device that outlives its use
    /// by the context (every call made until the stream is set again and that work is done).
    pub unsafe fn set_stream(&self, stream: *mut sys::CUstream_st) -> Result<()> {
        check(sys::fp8_context_set_stream(self.raw.as_ptr(), stream))
    }

    /// The stream set with `set_stream` (NULL by default).
    pub fn stream(&self) -> Result<*mut sys::CUstream_st> {
        let mut stream = ptr::null_mut();
        check(unsafe { sys::fp8_context_get_stream(self.raw.as_ptr(), &mut stream) })?;
        Ok(stream)
    }

    /// The raw handle, borrowed (for calls this crate does not wrap).
    pub fn as_ptr(&self) -> *mut sys::fp8_context_t {
        self.raw.as_ptr()
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // Objects keep their context's resources alive in libfp8; in Rust they cannot outlive it.
        unsafe { sys::fp8_context_destroy(self.raw.as_ptr()) }
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("device", &self.device().ok()).finish()
    }
}

/// What a device can do (`fp8_device_info_t`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The ordinal, `FP8_DEVICE_CPU` for the CPU backend.
    pub device: i32,
    pub name: String,
    /// major*10 + minor (90 for an H100); 0 for the CPU.
    pub compute_capability: i32,
    pub multiprocessor_count: i32,
    pub total_memory_bytes: u64,
    /// FP8 tensor-core GEMMs run here (sm_89 and newer).
    pub fp8_gemm: bool,
    pub fp8_block_scaling: bool,
    pub fp8_nccl_reduction: bool,
    pub nccl_version: i32,
    pub cublaslt_version: i64,
}

/// What `device` (`FP8_DEVICE_CPU` or a CUDA ordinal) can do. Thread safe.
pub fn device_info(device: i32) -> Result<DeviceInfo> {
    // SAFETY: a zeroed struct is valid (integers and chars); the _init sets struct_size.
    let mut info: sys::fp8_device_info_t = unsafe { std::mem::zeroed() };
    unsafe { sys::fp8_device_info_init(&mut info) };
    check(unsafe { sys::fp8_device_query(device, &mut info) })?;
    let name_bytes: Vec<u8> = info.name.iter().map(|&c| c as u8).collect();
    let name = CStr::from_bytes_until_nul(&name_bytes).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
    Ok(DeviceInfo {
        device: info.device,
        name,
        compute_capability: info.compute_capability,
        multiprocessor_count: info.multiprocessor_count,
        total_memory_bytes: info.total_memory_bytes,
        fp8_gemm: info.fp8_gemm != 0,
        fp8_block_scaling: info.fp8_block_scaling != 0,
        fp8_nccl_reduction: info.fp8_nccl_reduction != 0,
        nccl_version: info.nccl_version,
        cublaslt_version: info.cublaslt_version,
    })
}

/// Number of CUDA devices visible (0 without a driver or GPU). Thread safe.
pub fn device_count() -> Result<i32> {
    let mut count = 0;
    check(unsafe { sys::fp8_device_count(&mut count) })?;
    Ok(count)
}
