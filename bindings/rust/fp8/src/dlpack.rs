//! DLPack, the tensor exchange of PyTorch, JAX, CuPy and others (fp8.h, "DLPack"), in both of its
//! managed structs:
//! - DLPack 0.x's `DLManagedTensor` (the "dltensor" capsules): a libfp8 tensor lent out as a
//!   [`ManagedTensor`] ([`Tensor::to_dlpack`], [`TensorRef::to_dlpack`]), a producer's taken in as
//!   a [`Tensor`] ([`Tensor::from_managed`], [`Tensor::from_dlpack`]); FP8 travels as uint8 codes;
//! - DLPack 1.x's `DLManagedTensorVersioned` (the "dltensor_versioned" capsules, which frameworks
//!   export when asked for `max_version` (1, 0) or later): lent as a [`ManagedTensorVersioned`]
//!   ([`Tensor::to_dlpack_versioned`], [`TensorRef::to_dlpack_versioned`]), taken in by
//!   [`Tensor::from_managed_versioned`] and [`Tensor::from_dlpack_versioned`]; FP8 travels as
//!   DLPack 1.1's [`kDLFloat8_e4m3fn`] and [`kDLFloat8_e5m2`].
//!
//! Both owners are one generic type, [`Managed`], over the managed struct ([`ManagedStruct`]).
//!
//! fp8.h declares both structs without their fields (and `fp8_sys` keeps them opaque); the layouts
//! here are those of `dlpack/dlpack.h` (`DLManagedTensor` of 0.6 and later, unchanged in 1.x;
//! `DLManagedTensorVersioned` of 1.x), named as there. `fp8/tests/safe.rs` compares them with the C
//! compiler's where the header is installed (Debian's libdlpack-dev is 0.6: the unversioned ones).
//!
//! [`Tensor`]: crate::Tensor
//! [`Tensor::to_dlpack`]: crate::Tensor::to_dlpack
//! [`TensorRef::to_dlpack`]: crate::TensorRef::to_dlpack
//! [`Tensor::from_managed`]: crate::Tensor::from_managed
//! [`Tensor::from_dlpack`]: crate::Tensor::from_dlpack
//! [`Tensor::to_dlpack_versioned`]: crate::Tensor::to_dlpack_versioned
//! [`TensorRef::to_dlpack_versioned`]: crate::TensorRef::to_dlpack_versioned
//! [`Tensor::from_managed_versioned`]: crate::Tensor::from_managed_versioned
//! [`Tensor::from_dlpack_versioned`]: crate::Tensor::from_dlpack_versioned
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
/// DLPack 1.1's FP8 type codes (bits 8, lanes 1), which libfp8 lends and takes only in the
/// versioned struct: float8_e4m3fn is libfp8's E4M3 (`torch.float8_e4m3fn`)...
pub const kDLFloat8_e4m3fn: u8 = 10;
/// ... and float8_e5m2 its E5M2 (`torch.float8_e5m2`). The other FP8 codes (e4m3fnuz 11, e5m2fnuz
/// 13, ...) are other formats, which libfp8 refuses (`Status::Dtype`).
pub const kDLFloat8_e5m2: u8 = 12;

/// `DLManagedTensorVersioned::flags` bits (DLPack 1.x). Read-only: the consumer must not write the
/// tensor (libfp8 refuses it, since any call may write a tensor it is passed).
pub const DLPACK_FLAG_BITMASK_READ_ONLY: u64 = 1 << 0;
/// The producer made a copy: the consumer owns it alone until the deleter runs.
pub const DLPACK_FLAG_BITMASK_IS_COPIED: u64 = 1 << 1;

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

/// `DLPackVersion`: the version of a `DLManagedTensorVersioned`. Another major version is another
/// layout after `flags`; a minor version only adds codes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DLPackVersion {
    pub major: u32,
    pub minor: u32,
}

/// `DLManagedTensorVersioned` (DLPack 1.x): a `DLTensor` with its version, its owner's context, the
/// function that releases it and `DLPACK_FLAG_BITMASK_*` flags. Whoever holds one calls
/// `deleter(self)` exactly once when done with it (a NULL deleter: there is nothing to release);
/// `version`, `manager_ctx`, `deleter` and `flags` keep their places in every major version, the
/// rest is 1.x's.
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensorVersioned {
    pub version: DLPackVersion,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    pub flags: u64,
    pub dl_tensor: DLTensor,
}

mod sealed {
    /// What [`super::Managed`] needs of a managed struct (private: only this module implements it).
    pub trait Sealed: Sized {
        /// `fp8_sys`'s opaque declaration of the struct.
        type Sys;
        /// The C struct's name and the Rust owner's, for messages.
        const C_NAME: &'static str;
        const OWNER: &'static str;
        /// The fp8.h function that lends one.
        const LENDER: &'static str;
        fn dl_tensor(&self) -> &super::DLTensor;
        fn deleter(&self) -> Option<unsafe extern "C" fn(*mut Self)>;
        /// The struct's own fields, for Debug.
        fn debug_fields(&self, _: &mut std::fmt::DebugStruct<'_, '_>) {}
    }
}

/// The DLPack managed structs a [`Managed`] owns: [`DLManagedTensor`] and
/// [`DLManagedTensorVersioned`] (sealed: implemented for those two only).
pub trait ManagedStruct: sealed::Sealed {}

impl sealed::Sealed for DLManagedTensor {
    type Sys = sys::DLManagedTensor;
    const C_NAME: &'static str = "DLManagedTensor";
    const OWNER: &'static str = "ManagedTensor";
    const LENDER: &'static str = "fp8_tensor_to_dlpack";
    fn dl_tensor(&self) -> &DLTensor {
        &self.dl_tensor
    }
    fn deleter(&self) -> Option<unsafe extern "C" fn(*mut Self)> {
        self.deleter
    }
}
impl ManagedStruct for DLManagedTensor {}

impl sealed::Sealed for DLManagedTensorVersioned {
    type Sys = sys::DLManagedTensorVersioned;
    const C_NAME: &'static str = "DLManagedTensorVersioned";
    const OWNER: &'static str = "ManagedTensorVersioned";
    const LENDER: &'static str = "fp8_tensor_to_dlpack_versioned";
    fn dl_tensor(&self) -> &DLTensor {
        &self.dl_tensor
    }
    fn deleter(&self) -> Option<unsafe extern "C" fn(*mut Self)> {
        self.deleter
    }
    fn debug_fields(&self, d: &mut std::fmt::DebugStruct<'_, '_>) {
        d.field("version", &self.version).field("flags", &self.flags);
    }
}
impl ManagedStruct for DLManagedTensorVersioned {}

/// A DLPack 0.x `DLManagedTensor` owned on the Rust side (see [`Managed`]).
pub type ManagedTensor<'a> = Managed<'a, DLManagedTensor>;

/// A DLPack 1.x `DLManagedTensorVersioned` owned on the Rust side (see [`Managed`]), with its
/// [`version`](Managed::version) and [`flags`](Managed::flags).
pub type ManagedTensorVersioned<'a> = Managed<'a, DLManagedTensorVersioned>;

/// A DLPack managed struct `M` owned on the Rust side: [`ManagedTensor`] for `DLManagedTensor`,
/// [`ManagedTensorVersioned`] for `DLManagedTensorVersioned`. Its deleter runs when this is
/// dropped, unless it was handed to a consumer with [`into_raw`](Self::into_raw) (or to libfp8 with
/// [`Tensor::from_managed`](crate::Tensor::from_managed) or
/// [`Tensor::from_managed_versioned`](crate::Tensor::from_managed_versioned)).
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
pub struct Managed<'a, M: ManagedStruct> {
    raw: NonNull<M>,
    _memory: PhantomData<&'a ()>,
}

impl<'a, M: ManagedStruct> Managed<'a, M> {
    /// Takes ownership of a producer's managed struct (a framework's `to_dlpack`, or the pointer of
    /// a "dltensor" / "dltensor_versioned" capsule); its deleter runs when the result is dropped.
    ///
    /// # Safety
    /// `raw` must point to a valid `M` that nobody else will release (its deleter is now this
    /// value's to call, once); its `dl_tensor` (`shape`, `strides` when not NULL, `ndim` entries
    /// each) and `data` (the bytes the shape, strides, dtype and `byte_offset` span) must stay valid
    /// until the deleter runs and for `'a`; its deleter must be callable from this thread. A
    /// `DLManagedTensorVersioned` must be laid out as DLPack 1.x's (a producer of another major
    /// version keeps only `version`, `manager_ctx`, `deleter` and `flags` in place: call its deleter
    /// instead, or pass the pointer to [`Tensor::from_dlpack_versioned`](crate::Tensor::from_dlpack_versioned),
    /// which reads the version first). Once the tensor reaches libfp8
    /// ([`Tensor::from_managed`](crate::Tensor::from_managed)), the conditions of
    /// [`Tensor::wrap`](crate::Tensor::wrap) hold for its data: the context's device memory,
    /// aligned to the dtype, not accessed by anyone else in a conflicting way while libfp8 uses it.
    pub unsafe fn from_raw(raw: *mut M) -> Result<Managed<'a, M>> {
        NonNull::new(raw).map(|raw| Managed { raw, _memory: PhantomData }).ok_or_else(|| {
            Error::new(Status::InvalidArgument, format!("{}::from_raw: the {} is NULL", M::OWNER, M::C_NAME))
        })
    }

    pub(crate) fn lent(raw: *mut M::Sys) -> Result<Managed<'a, M>> {
        NonNull::new(raw.cast::<M>())
            .map(|raw| Managed { raw, _memory: PhantomData })
            .ok_or_else(|| Error::new(Status::Internal, format!("{} returned FP8_OK without a tensor", M::LENDER)))
    }

    /// Hands the tensor to its consumer, who calls `(*ptr).deleter(ptr)` exactly once when done
    /// (frameworks' `from_dlpack` do). Until then the view stays valid: memory libfp8 owns stays
    /// allocated; memory a tensor wraps must stay alive (`'a` no longer says so once the pointer
    /// leaves Rust's sight), and, as for every object of a context, the deleter belongs on the
    /// thread that uses the context.
    pub fn into_raw(self) -> *mut M {
        let raw = self.raw.as_ptr();
        std::mem::forget(self);
        raw
    }

    /// The managed struct, still owned here.
    pub fn as_ptr(&self) -> *mut M {
        self.raw.as_ptr()
    }

    /// The `DLTensor` header (pointers and all, as C has them).
    pub fn dl_tensor(&self) -> &DLTensor {
        // SAFETY: valid until the deleter runs, which only Drop and into_raw's consumer do.
        unsafe { self.raw.as_ref().dl_tensor() }
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

impl Managed<'_, DLManagedTensorVersioned> {
    /// The struct's DLPack version (1.1 for a tensor libfp8 lends).
    pub fn version(&self) -> DLPackVersion {
        // SAFETY: valid until the deleter runs (as for dl_tensor); in place in every version.
        unsafe { self.raw.as_ref().version }
    }

    /// Its `DLPACK_FLAG_BITMASK_*` flags (0 for a tensor libfp8 lends).
    pub fn flags(&self) -> u64 {
        // SAFETY: as for version.
        unsafe { self.raw.as_ref().flags }
    }
}

/// `ndim` entries at `p` (none for NULL or ndim <= 0).
unsafe fn dims<'t>(p: *const i64, ndim: i32) -> &'t [i64] {
    match usize::try_from(ndim) {
        Ok(n) if n > 0 && !p.is_null() => std::slice::from_raw_parts(p, n),
        _ => &[],
    }
}

impl<M: ManagedStruct> Drop for Managed<'_, M> {
    fn drop(&mut self) {
        // SAFETY: this value owns the tensor; its deleter is called once, here.
        unsafe {
            if let Some(deleter) = self.raw.as_ref().deleter() {
                deleter(self.raw.as_ptr());
            }
        }
    }
}

impl<M: ManagedStruct> std::fmt::Debug for Managed<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct(M::OWNER);
        // SAFETY: as for dl_tensor.
        unsafe { self.raw.as_ref() }.debug_fields(&mut d);
        d.field("device", &self.device())
            .field("dtype", &self.dtype())
            .field("shape", &self.shape())
            .field("strides", &self.strides())
            .finish()
    }
}
