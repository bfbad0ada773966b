//! Tensors: owned (`Tensor`) and lent by a model (`TensorRef`).

use crate::context::Context;
use crate::dlpack::{
    DLManagedTensor, DLManagedTensorVersioned, Managed, ManagedStruct, ManagedTensor, ManagedTensorVersioned,
};
use crate::error::{check, created, static_str, Error, Result, Status};
use fp8_sys as sys;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::ptr::{self, NonNull};

/// Element types (`FP8_DTYPE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum DType {
    F32 = sys::FP8_DTYPE_F32,
    F16 = sys::FP8_DTYPE_F16,
    BF16 = sys::FP8_DTYPE_BF16,
    /// OCP E4M3FN: no infinities, max 448.
    E4M3 = sys::FP8_DTYPE_E4M3,
    /// OCP E5M2: infinities, max 57344.
    E5M2 = sys::FP8_DTYPE_E5M2,
}

impl DType {
    pub fn from_raw(raw: sys::fp8_dtype_t) -> Option<DType> {
        Some(match raw {
            sys::FP8_DTYPE_F32 => DType::F32,
            sys::FP8_DTYPE_F16 => DType::F16,
            sys::FP8_DTYPE_BF16 => DType::BF16,
            sys::FP8_DTYPE_E4M3 => DType::E4M3,
            sys::FP8_DTYPE_E5M2 => DType::E5M2,
            _ => return None,
        })
    }

    pub fn raw(self) -> sys::fp8_dtype_t {
        self as i32
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        unsafe { sys::fp8_dtype_size(self.raw()) }
    }

    /// libfp8's name ("bf16", "e4m3").
    pub fn name(self) -> &'static str {
        unsafe { static_str(sys::fp8_dtype_name(self.raw())) }
    }

    pub fn is_fp8(self) -> bool {
        matches!(self, DType::E4M3 | DType::E5M2)
    }
}

/// Encodes `x` as an FP8 code (round to nearest even, saturating; NaN -> 0x7F), the same bits as
/// CUDA's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, ..)`. `dtype` must be E4M3 or E5M2 (else 0).
pub fn encode(x: f32, dtype: DType) -> u8 {
    unsafe { sys::fp8_encode(x, dtype.raw()) }
}

/// Decodes an FP8 code exactly (NaN for a non-FP8 dtype).
pub fn decode(code: u8, dtype: DType) -> f32 {
    unsafe { sys::fp8_decode(code, dtype.raw()) }
}

mod sealed {
    pub trait Sealed {}
}

/// Plain host element types that tensor bytes can be copied into and out of: any bit pattern is
/// a valid value (bf16 and f16 travel as `u16`, FP8 codes as `u8`).
pub trait HostElement: sealed::Sealed + Copy + Default + 'static {}
macro_rules! host_elements {
    ($($t:ty),*) => { $(impl sealed::Sealed for $t {} impl HostElement for $t {})* };
}
host_elements!(u8, i8, u16, i16, u32, i32, u64, i64, f32, f64);

/// Anything that is a libfp8 tensor: an owned `Tensor` or a model's `TensorRef`.
pub trait AsTensor: sealed::Sealed {
    /// The raw handle, borrowed.
    fn as_ptr(&self) -> *mut sys::fp8_tensor_t;
}

fn bytes_of<T: HostElement>(s: &[T]) -> usize {
    std::mem::size_of_val(s)
}

/// The read side, the same for owned and borrowed tensors.
macro_rules! tensor_reads {
    ($name:ident) => {
        impl $name<'_> {
            pub fn dtype(&self) -> Result<DType> {
                let mut d = 0;
                check(unsafe { sys::fp8_tensor_dtype(self.raw.as_ptr(), &mut d) })?;
                DType::from_raw(d).ok_or_else(|| Error::new(Status::Internal, format!("unknown dtype {d}")))
            }

            pub fn shape(&self) -> Result<Vec<i64>> {
                let mut ndim = 0;
                let mut dims = [0i64; sys::FP8_MAX_DIMS];
                check(unsafe { sys::fp8_tensor_shape(self.raw.as_ptr(), &mut ndim, dims.as_mut_ptr()) })?;
                let dims = usize::try_from(ndim).ok().and_then(|n| dims.get(..n));
                dims.map(<[i64]>::to_vec).ok_or_else(|| Error::new(Status::Internal, format!("ndim {ndim}")))
            }

            /// Number of elements (1 for a 0-d tensor).
            pub fn numel(&self) -> Result<i64> {
                let mut n = 0;
                check(unsafe { sys::fp8_tensor_numel(self.raw.as_ptr(), &mut n) })?;
                Ok(n)
            }

            /// numel times the dtype's size (an error where that does not fit a `usize`).
            pub fn nbytes(&self) -> Result<usize> {
                let (numel, size) = (self.numel()?, self.dtype()?.size());
                usize::try_from(numel).ok().and_then(|n| n.checked_mul(size)).ok_or_else(|| {
                    Error::new(Status::OutOfMemory, format!("{numel} elements do not fit this host's address space"))
                })
            }

            /// The data pointer (device memory on a CUDA context), borrowed from the tensor.
            pub fn data_ptr(&self) -> Result<*mut c_void> {
                let mut p = ptr::null_mut();
                check(unsafe { sys::fp8_tensor_data(self.raw.as_ptr(), &mut p) })?;
                Ok(p)
            }

            /// Copies the tensor's bytes into `dst`, which must hold exactly that many bytes, after
            /// the work queued so far. Synchronous.
            pub fn copy_to_host<T: HostElement>(&self, dst: &mut [T]) -> Result<()> {
                check(unsafe {
                    sys::fp8_tensor_copy_to_host(self.raw.as_ptr(), dst.as_mut_ptr().cast(), bytes_of(dst))
                })
            }

            /// The tensor's bytes as a vector of `T` (its byte count must be a multiple of T's size).
            pub fn to_vec<T: HostElement>(&self) -> Result<Vec<T>> {
                let bytes = self.nbytes()?;
                let size = std::mem::size_of::<T>();
                if bytes % size != 0 {
                    return Err(Error::new(
                        Status::InvalidArgument,
                        format!("to_vec: the tensor holds {bytes} bytes, not a whole number of {size}-byte elements"),
                    ));
                }
                let mut v = vec![T::default(); bytes / size];
                self.copy_to_host(&mut v)?;
                Ok(v)
            }

            /// An FP8 tensor's dequantisation factor. Synchronous.
            pub fn scale_inv(&self) -> Result<f32> {
                let mut s = 0.0;
                check(unsafe { sys::fp8_tensor_get_scale_inv(self.raw.as_ptr(), &mut s) })?;
                Ok(s)
            }
        }

        impl sealed::Sealed for $name<'_> {}
        impl AsTensor for $name<'_> {
            fn as_ptr(&self) -> *mut sys::fp8_tensor_t {
                self.raw.as_ptr()
            }
        }

        impl std::fmt::Debug for $name<'_> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("dtype", &self.dtype().ok())
                    .field("shape", &self.shape().ok())
                    .finish()
            }
        }
    };
}

/// A tensor that owns its memory (or wraps the caller's), on its context's device. It borrows
/// the context (`'c`), so it cannot outlive it nor leave its thread.
pub struct Tensor<'c> {
    raw: NonNull<sys::fp8_tensor_t>,
    _ctx: PhantomData<&'c Context>,
}

tensor_reads!(Tensor);

fn shape_arg(shape: &[i64]) -> Result<i32> {
    i32::try_from(shape.len()).map_err(|_| Error::new(Status::InvalidArgument, format!("{} dimensions", shape.len())))
}

impl<'c> Tensor<'c> {
    /// A tensor of newly allocated, uninitialised memory. Synchronous.
    pub fn new(ctx: &'c Context, dtype: DType, shape: &[i64]) -> Result<Tensor<'c>> {
        let mut raw = ptr::null_mut();
        check(unsafe {
            sys::fp8_tensor_create(&mut raw, ctx.as_ptr(), dtype.raw(), shape_arg(shape)?, shape.as_ptr())
        })?;
        Ok(Tensor { raw: created(raw, "fp8_tensor_create")?, _ctx: PhantomData })
    }

    /// A new tensor holding `data` (whose bytes must be exactly the tensor's).
    pub fn from_host<T: HostElement>(ctx: &'c Context, dtype: DType, shape: &[i64], data: &[T]) -> Result<Tensor<'c>> {
        let mut t = Tensor::new(ctx, dtype, shape)?;
        t.copy_from_host(data)?;
        Ok(t)
    }

    /// A tensor over the caller's host memory (the CPU backend; a CUDA context refuses host
    /// memory), borrowed for as long as the tensor lives. `data` must hold at least the tensor's
    /// bytes and be aligned to the dtype's size.
    pub fn wrap_host<T: HostElement>(
        ctx: &'c Context,
        dtype: DType,
        shape: &[i64],
        data: &'c mut [T],
    ) -> Result<Tensor<'c>> {
        let mut numel: i64 = 1;
        for &d in shape {
            if d < 0 {
                return Err(Error::new(Status::Shape, format!("wrap_host: negative dimension in {shape:?}")));
            }
            numel = numel.checked_mul(d).ok_or_else(|| Error::new(Status::Shape, "wrap_host: too many elements"))?;
        }
        let need = (numel as u128) * dtype.size() as u128;
        if need > bytes_of(data) as u128 {
            return Err(Error::new(
                Status::Shape,
                format!(
                    "wrap_host: shape {shape:?} of {} needs {need} bytes, the buffer has {}",
                    dtype.name(),
                    bytes_of(data)
                ),
            ));
        }
        // An empty tensor takes NULL (fp8.h), not an empty slice's dangling pointer, which need not
        // be aligned to the dtype.
        let ptr: *mut c_void = if need == 0 { ptr::null_mut() } else { data.as_mut_ptr().cast() };
        if (ptr as usize) % dtype.size() != 0 {
            return Err(Error::new(
                Status::InvalidArgument,
                format!("wrap_host: data not aligned to {}", dtype.size()),
            ));
        }
        // SAFETY: the buffer is large enough and aligned (or NULL for an empty tensor), and stays
        // borrowed for 'c.
        unsafe { Tensor::wrap(ctx, dtype, shape, ptr) }
    }

    /// A tensor over memory the caller owns (`fp8_tensor_wrap`).
    ///
    /// # Safety
    /// `data` must point to at least numel*dtype_size bytes of the context's device memory (host
    /// memory on the CPU backend), aligned to the dtype's size, which nothing else accesses in a
    /// conflicting way and which stays alive until the tensor is dropped and the work queued on
    /// it has finished.
    pub unsafe fn wrap(ctx: &'c Context, dtype: DType, shape: &[i64], data: *mut c_void) -> Result<Tensor<'c>> {
        let mut raw = ptr::null_mut();
        check(sys::fp8_tensor_wrap(&mut raw, ctx.as_ptr(), dtype.raw(), shape_arg(shape)?, shape.as_ptr(), data))?;
        Ok(Tensor { raw: created(raw, "fp8_tensor_wrap")?, _ctx: PhantomData })
    }

    /// Copies exactly the tensor's bytes from `src` (which must hold that many). Synchronous.
    pub fn copy_from_host<T: HostElement>(&mut self, src: &[T]) -> Result<()> {
        check(unsafe { sys::fp8_tensor_copy_from_host(self.raw.as_ptr(), src.as_ptr().cast(), bytes_of(src)) })
    }

    /// Sets an FP8 tensor's dequantisation factor (finite, > 0). Synchronous.
    pub fn set_scale_inv(&mut self, scale_inv: f32) -> Result<()> {
        check(unsafe { sys::fp8_tensor_set_scale_inv(self.raw.as_ptr(), scale_inv) })
    }

    /// Lends the tensor as a DLPack tensor (`fp8_tensor_to_dlpack`): its data, shape and compact
    /// row-major strides, `kDLCPU` 0 or `kDLCUDA` and the ordinal, dtype float32, float16 or
    /// bfloat16, and E4M3/E5M2 as their uint8 codes (the scale_inv stays with [`Self::scale_inv`]).
    /// Hand it on with [`ManagedTensor::into_raw`]: the consumer calls its deleter. Memory libfp8
    /// allocated stays allocated until then, even after this tensor is dropped; the view borrows
    /// what the tensor borrows (`'c`: the context, and the buffer of a [`Self::wrap_host`] tensor).
    /// Work queued on the context may still be writing the memory: order the consumer after it.
    pub fn to_dlpack(&self) -> Result<ManagedTensor<'c>> {
        to_dlpack(self.raw)
    }

    /// Takes a DLPack tensor in (`fp8_tensor_from_dlpack`): a tensor over its memory (byte_offset
    /// applied) that owns it: the deleter runs when the tensor is dropped, or, if the tensor was
    /// lent on with [`Self::to_dlpack`], when the last consumer is done. Checked: the device
    /// (`kDLCPU` or `kDLCUDAHost` for a CPU context, `kDLCUDA` with the context's ordinal or
    /// `kDLCUDAManaged` for a CUDA one: `Status::InvalidArgument`), the dtype (float32, float16 or
    /// bfloat16: `Status::Dtype`), at most `FP8_MAX_DIMS` dimensions and compact row-major strides
    /// (any stride on a size-1 dimension; `Status::Shape`). On failure `managed` is dropped, so its
    /// deleter runs (use [`Self::from_dlpack`] to keep a refused pointer).
    pub fn from_managed(ctx: &'c Context, managed: ManagedTensor<'c>) -> Result<Tensor<'c>> {
        // SAFETY: ManagedTensor's invariant (from_raw's contract, or lent by libfp8).
        take(managed, |m| unsafe { Tensor::from_dlpack(ctx, m) })
    }

    /// [`Self::from_managed`] from a raw pointer, as C has it: on success the tensor owns
    /// `managed` (its deleter runs when the tensor, and any view lent on, is gone); on failure
    /// `managed` stays the caller's, deleter not run.
    ///
    /// # Safety
    /// `managed` must point to a valid `DLManagedTensor` whose `dl_tensor` (shape, strides) and data
    /// stay valid until its deleter runs and for `'c`, whose deleter nobody else will call once
    /// this succeeds and may be called from this thread, and whose data meets [`Self::wrap`]'s
    /// conditions: memory of the context's device (host memory on the CPU backend), aligned to the
    /// dtype, holding every element the shape and strides reach, and accessed by nobody else (the
    /// producing framework included) in a way that conflicts with libfp8's reads and writes while
    /// the tensor or a view lent on exists. A raw pointer cannot be checked for any of this.
    pub unsafe fn from_dlpack(ctx: &'c Context, managed: *mut DLManagedTensor) -> Result<Tensor<'c>> {
        let mut raw = ptr::null_mut();
        check(sys::fp8_tensor_from_dlpack(&mut raw, ctx.as_ptr(), managed.cast()))?;
        Ok(Tensor { raw: created(raw, "fp8_tensor_from_dlpack")?, _ctx: PhantomData })
    }

    /// Lends the tensor as DLPack 1.x's struct (`fp8_tensor_to_dlpack_versioned`): as
    /// [`Self::to_dlpack`] (the same memory, lifetime and borrows), with version 1.1, flags 0, and
    /// E4M3/E5M2 as DLPack 1.1's float8_e4m3fn / float8_e5m2 ([`kDLFloat8_e4m3fn`] 10 and
    /// [`kDLFloat8_e5m2`] 12, bits 8; the scale_inv stays with [`Self::scale_inv`]). Hand it on
    /// with [`Managed::into_raw`]: the consumer calls its deleter.
    ///
    /// [`kDLFloat8_e4m3fn`]: crate::dlpack::kDLFloat8_e4m3fn
    /// [`kDLFloat8_e5m2`]: crate::dlpack::kDLFloat8_e5m2
    pub fn to_dlpack_versioned(&self) -> Result<ManagedTensorVersioned<'c>> {
        to_dlpack_versioned(self.raw)
    }

    /// [`Self::from_managed`] for DLPack 1.x's struct (`fp8_tensor_from_dlpack_versioned`): the
    /// same checks and ownership, and besides: the version's major must be 1 (`Status::Version`;
    /// any minor is taken), the tensor must not be read-only
    /// ([`DLPACK_FLAG_BITMASK_READ_ONLY`](crate::dlpack::DLPACK_FLAG_BITMASK_READ_ONLY):
    /// `Status::InvalidArgument`, since libfp8 may write any tensor it is passed), and the dtype may
    /// also be float8_e4m3fn or float8_e5m2 (codes 10 and 12, bits 8, lanes 1): an E4M3 or E5M2
    /// tensor with a scale_inv of 1.0 (set it with [`Self::set_scale_inv`]; for these two this
    /// allocates that slot and synchronises). On failure `managed` is dropped, so its deleter runs
    /// (use [`Self::from_dlpack_versioned`] to keep a refused pointer).
    pub fn from_managed_versioned(ctx: &'c Context, managed: ManagedTensorVersioned<'c>) -> Result<Tensor<'c>> {
        // SAFETY: Managed's invariant (from_raw's contract, or lent by libfp8).
        take(managed, |m| unsafe { Tensor::from_dlpack_versioned(ctx, m) })
    }

    /// [`Self::from_managed_versioned`] from a raw pointer, as C has it: on success the tensor owns
    /// `managed` (its deleter runs when the tensor, and any view lent on, is gone); on failure
    /// `managed` stays the caller's, deleter not run.
    ///
    /// # Safety
    /// That of [`Self::from_dlpack`], for a `DLManagedTensorVersioned`: `version` is read first, and
    /// the rest only when its major is 1 (another major version may lay the struct out otherwise
    /// after `flags`; it is refused, and its deleter stays the caller's to call).
    pub unsafe fn from_dlpack_versioned(
        ctx: &'c Context,
        managed: *mut DLManagedTensorVersioned,
    ) -> Result<Tensor<'c>> {
        let mut raw = ptr::null_mut();
        check(sys::fp8_tensor_from_dlpack_versioned(&mut raw, ctx.as_ptr(), managed.cast()))?;
        Ok(Tensor { raw: created(raw, "fp8_tensor_from_dlpack_versioned")?, _ctx: PhantomData })
    }
}

/// Hands `managed` to `import` (a `from_dlpack` of its struct): the tensor owns it on success, and
/// on failure it is dropped here (its deleter runs).
fn take<'c, M: ManagedStruct>(
    managed: Managed<'c, M>,
    import: impl FnOnce(*mut M) -> Result<Tensor<'c>>,
) -> Result<Tensor<'c>> {
    let t = import(managed.as_ptr())?;
    std::mem::forget(managed); // the tensor owns it now
    Ok(t)
}

fn to_dlpack<'a>(t: NonNull<sys::fp8_tensor_t>) -> Result<ManagedTensor<'a>> {
    let mut out = ptr::null_mut();
    check(unsafe { sys::fp8_tensor_to_dlpack(t.as_ptr(), &mut out) })?;
    ManagedTensor::lent(out)
}

fn to_dlpack_versioned<'a>(t: NonNull<sys::fp8_tensor_t>) -> Result<ManagedTensorVersioned<'a>> {
    let mut out = ptr::null_mut();
    check(unsafe { sys::fp8_tensor_to_dlpack_versioned(t.as_ptr(), &mut out) })?;
    ManagedTensorVersioned::lent(out)
}

impl Drop for Tensor<'_> {
    fn drop(&mut self) {
        unsafe { sys::fp8_tensor_destroy(self.raw.as_ptr()) }
    }
}

/// A tensor lent by a model (a parameter's value or gradient): valid as long as the model, which
/// owns it (`'m` borrows the model). Never destroyed here. What it stores follows the model's
/// storage level (an MS-AMP conversion makes a Linear weight F16 or E4M3 and its gradient FP8),
/// so ask for the dtype and shape when you use it.
#[derive(Clone, Copy)]
pub struct TensorRef<'m> {
    raw: NonNull<sys::fp8_tensor_t>,
    _model: PhantomData<&'m ()>,
}

tensor_reads!(TensorRef);

impl TensorRef<'_> {
    pub(crate) fn from_raw(raw: *mut sys::fp8_tensor_t) -> Option<Self> {
        NonNull::new(raw).map(|raw| TensorRef { raw, _model: PhantomData })
    }

    /// Copies exactly the tensor's bytes from `src` (its own dtype). libfp8 sees the write (the
    /// layer remakes its FP8 weight copies). FP8 gradients and O3's E4M3 weights refuse it: use
    /// `Model::write_parameter`. Synchronous.
    pub fn copy_from_host<T: HostElement>(&self, src: &[T]) -> Result<()> {
        check(unsafe { sys::fp8_tensor_copy_from_host(self.raw.as_ptr(), src.as_ptr().cast(), bytes_of(src)) })
    }
}

impl<'m> TensorRef<'m> {
    /// Lends the parameter as a DLPack tensor, as [`Tensor::to_dlpack`] does: a view of the
    /// model's flat storage. libfp8 keeps that memory allocated until the deleter runs, but when
    /// the storage moves (the first conversion, a level change, `Model::set_comm`) the view keeps
    /// the old memory and no longer sees the model's: take it again. It borrows the model (`'m`),
    /// through which it borrows the context.
    pub fn to_dlpack(&self) -> Result<ManagedTensor<'m>> {
        to_dlpack(self.raw)
    }

    /// Lends the parameter as DLPack 1.x's struct, as [`Tensor::to_dlpack_versioned`] does (version
    /// 1.1, flags 0, FP8 storage as float8_e4m3fn / float8_e5m2), with [`Self::to_dlpack`]'s view
    /// and borrows.
    pub fn to_dlpack_versioned(&self) -> Result<ManagedTensorVersioned<'m>> {
        to_dlpack_versioned(self.raw)
    }
}
