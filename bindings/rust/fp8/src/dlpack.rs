//! DLPack, the tensor exchange of PyTorch, JAX, CuPy and others (fp8.h, "DLPack"): a libfp8
//! tensor lent out as a `DLManagedTensor` ([`Tensor::to_dlpack`], [`TensorRef::to_dlpack`]), and
//! a producer's `DLManagedTensor` taken in as a [`Tensor`] ([`Tensor::from_managed`],
//! [`Tensor::from_dlpack`]).
//!
//! fp8.h declares `struct DLManagedTensor` without its fields (and `fp8_sys` keeps it opaque); the
//! layouts here are those of `dlpack/dlpack.h` 0.6 and later (the unversioned `DLManagedTensor`,
//! unchanged in 1.x), named as there. `fp8/tests/safe.rs` compares them with the C compiler's where
//! the header is installed (Debian's libdlpack-dev).
//!
//! [`Tensor`]: crate::Tensor
//! [`Tensor::to_dlpack`]: crate::Tensor::to_dlpack
//! [`TensorRef::to_dlpack`]: crate::TensorRef::to_dlpack
//! [`Tensor::from_managed`]: crate::Tensor::from_managed
//! [`Tensor::from_dlpack`]: crate::Tensor::from_dlpack
#![allow(non_upper_case_globals)]

use crate::error::{Error, Result, Status};
use fp8_sys as sys;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::ptr::NonNull;

/// `DLDeviceType` values (a C enum: `i32`).
pub const kDLCPU: i32 = 1;
pub const kDLCUDA: i32 = 2;
/// Pinned host memory (`cudaMallocHost`): libfp8's CPU contexts take it.
pub const kDLCUDAHost: i32 = 3;
pub const kDLOpenCL: i32 = 4;
pub const kDLVulkan: i32 = 7;
pub const kDLMetal: i32 = 8;
pub const kDLVPI: i32 = 9;
pub const kDLROCM: i32 = 10;
pub const kDLROCMHost: i32 = 11;
pub const kDLExtDev: i32 = 12;
/// `cudaMallocManaged` memory: libfp8's CUDA contexts take it.
pub const kDLCUDAManaged: i32 = 13;

/// `DLDataTypeCode` values (`DLDataType::code`).
pub const kDLInt: u8 = 0;
pub const kDLUInt: u8 = 1;
pub const kDLFloat: u8 = 2;
pub const kDLOpaqueHandle: u8 = 3;
pub const kDLBfloat: u8 = 4;
pub const kDLComplex: u8 = 5;

/// `DLDevice`: where the data lives.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DLDevice {
    /// A `kDL*` device type.
    pub device_type: i32,
    /// The device ordinal (0 for host memory).
    pub device_id: i32,
}

/// `DLDataType`: an element type (code, bits, lanes).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DLDataType {
    /// A `kDL*` type code.
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

/// `DLTensor`: a view of memory (borrowed pointers, as in C).
#[repr(C)]
#[derive(Debug)]
pub struct DLTensor {
    pub data: *mut c_void,
    pub device: DLDevice,
    pub ndim: i32,
    pub dtype: DLDataType,
    /// `ndim` sizes.
    pub shape: *mut i64,
    /// `ndim` strides in elements, or NULL for a compact row-major tensor.
    pub strides: *mut i64,
    /// Bytes from `data` to the first element.
    pub byte_offset: u64,
}

/// `DLManagedTensor`: a `DLTensor` with its owner's context and the function that releases it.
/// Whoever holds one calls `deleter(self)` exactly once when done with it (a NULL deleter: there
/// is nothing to release).
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensor {
    pub dl_tensor: DLTensor,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// A `DLManagedTensor` owned on the Rust side: its deleter runs when this is dropped, unless it was
/// handed to a consumer with [`into_raw`](Self::into_raw) (or to libfp8 with
/// [`Tensor::from_managed`](crate::Tensor::from_managed)).
///
/// `'a` bounds the memory it views: a tensor lent by libfp8 borrows what its [`Tensor`](crate::Tensor)
/// borrowed (the context, and the caller's buffer for a [`Tensor::wrap_host`](crate::Tensor::wrap_host)
/// tensor, which libfp8 does not keep alive), a model parameter's view borrows the model. Memory
/// libfp8 owns stays allocated until the deleter runs, even after the tensor it came from is
/// dropped. It is neither `Send` nor `Sync`: the deleter releases memory of a context, on the thread
/// that uses it.
///
/// Only the metadata is readable safely (shape, strides, dtype, device, the data pointer): the
/// elements may be written meanwhile through libfp8's tensor, so reading them is the consumer's
/// business (after the context's queued work: [`Context::synchronize`](crate::Context::synchronize)).
pub struct ManagedTensor<'a> {
    raw: NonNull<DLManagedTensor>,
    _memory: PhantomData<&'a ()>,
}

impl<'a> ManagedTensor<'a> {
    /// Takes ownership of a producer's `DLManagedTensor` (a framework's `to_dlpack`); its deleter
    /// runs when the result is dropped.
    ///
    /// # Safety
    /// `raw` must point to a valid `DLManagedTensor` that nobody else will release (its deleter is
    /// now this value's to call, once); its `dl_tensor` (`shape`, `strides` when not NULL, `ndim`
    /// entries each) and `data` (the bytes the shape, strides, dtype and `byte_offset` span) must
    /// stay valid until the deleter runs and for `'a`; its deleter must be callable from this
    /// thread. Once the tensor reaches libfp8 ([`Tensor::from_managed`](crate::Tensor::from_managed)),
    /// the conditions of [`Tensor::wrap`](crate::Tensor::wrap) hold for its data: the context's
    /// device memory, aligned to the dtype, not accessed by anyone else in a conflicting way while
    /// libfp8 uses it.
    pub unsafe fn from_raw(raw: *mut DLManagedTensor) -> Result<ManagedTensor<'a>> {
        NonNull::new(raw)
            .map(|raw| ManagedTensor { raw, _memory: PhantomData })
            .ok_or_else(|| Error::new(Status::InvalidArgument, "ManagedTensor::from_raw: the DLManagedTensor is NULL"))
    }

    pub(crate) fn lent(raw: *mut sys::DLManagedTensor) -> Result<ManagedTensor<'a>> {
        NonNull::new(raw.cast::<DLManagedTensor>())
            .map(|raw| ManagedTensor { raw, _memory: PhantomData })
            .ok_or_else(|| Error::new(Status::Internal, "fp8_tensor_to_dlpack returned FP8_OK without a tensor"))
    }

    /// Hands the tensor to its consumer, who calls `(*ptr).deleter(ptr)` exactly once when done
    /// (frameworks' `from_dlpack` do). Until then the view stays valid: memory libfp8 owns stays
    /// allocated; memory a tensor wraps must stay alive (`'a` no longer says so once the pointer
    /// leaves Rust's sight), and, as for every object of a context, the deleter belongs on the
    /// thread that uses the context.
    pub fn into_raw(self) -> *mut DLManagedTensor {
        let raw = self.raw.as_ptr();
        std::mem::forget(self);
        raw
    }

    /// The `DLManagedTensor`, still owned here.
    pub fn as_ptr(&self) -> *mut DLManagedTensor {
        self.raw.as_ptr()
    }

    /// The `DLTensor` header (pointers and all, as C has them).
    pub fn dl_tensor(&self) -> &DLTensor {
        // SAFETY: valid until the deleter runs, which only Drop and into_raw's consumer do.
        unsafe { &self.raw.as_ref().dl_tensor }
    }

    pub fn device(&self) -> DLDevice {
        self.dl_tensor().device
    }

    pub fn dtype(&self) -> DLDataType {
        self.dl_tensor().dtype
    }

    /// The sizes (empty for a 0-d tensor).
    pub fn shape(&self) -> &[i64] {
        let t = self.dl_tensor();
        // SAFETY: `shape` holds ndim sizes while the tensor lives (DLPack; from_raw's contract).
        unsafe { dims(t.shape, t.ndim) }
    }

    /// The strides in elements, or None where the producer left them NULL (compact row-major).
    pub fn strides(&self) -> Option<&[i64]> {
        let t = self.dl_tensor();
        // SAFETY: as for shape.
        (!t.strides.is_null()).then(|| unsafe { dims(t.strides, t.ndim) })
    }

    /// The first element's address: `data` plus `byte_offset` (device memory on a CUDA device).
    pub fn data_ptr(&self) -> *mut c_void {
        let t = self.dl_tensor();
        t.data.cast::<u8>().wrapping_add(t.byte_offset as usize).cast()
    }
}

/// `ndim` entries at `p` (none for NULL or ndim <= 0).
unsafe fn dims<'t>(p: *const i64, ndim: i32) -> &'t [i64] {
    match usize::try_from(ndim) {
        Ok(n) if n > 0 && !p.is_null() => std::slice::from_raw_parts(p, n),
        _ => &[],
    }
}

impl Drop for ManagedTensor<'_> {
    fn drop(&mut self) {
        // SAFETY: this value owns the tensor; its deleter is called once, here.
        unsafe {
            if let Some(deleter) = self.raw.as_ref().deleter {
                deleter(self.raw.as_ptr());
            }
        }
    }
}

impl std::fmt::Debug for ManagedTensor<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManagedTensor")
            .field("device", &self.device())
            .field("dtype", &self.dtype())
            .field("shape", &self.shape())
            .field("strides", &self.strides())
            .finish()
    }
}
