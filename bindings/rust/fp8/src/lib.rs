//! Safe Rust binding of libfp8: FP8 mixed-precision training behind a C ABI (`include/fp8.h`,
//! which documents every contract; the raw declarations are `fp8_sys`, re-exported as `sys`).
//!
//! ```no_run
//! use fp8::{Activation, Context, DType, Model, OptimAttr, Optimizer, OptimizerKind, Recipe, Tensor};
//! # fn main() -> fp8::Result<()> {
//! let ctx = Context::cpu()?;
//! let mut model = Model::new(&ctx)?;
//! model.add_linear("fc1", 32, 64, true)?;
//! model.add_activation("act", Activation::Gelu)?;
//! model.add_linear("fc2", 64, 16, true)?;
//! let fc1_weight = model.parameter("fc1.weight")?.0;
//! fc1_weight.copy_from_host(&vec![0.01f32; 32 * 64])?;
//! model.convert(&Recipe::from_text("fp8_format=HYBRID, backend=te")?)?;
//! let mut opt = Optimizer::new(&model, OptimizerKind::AdamW)?.with(OptimAttr::Lr, 1e-3)?;
//! let x = Tensor::from_host(&ctx, DType::F32, &[16, 32], &vec![0.5f32; 16 * 32])?;
//! let mut y = Tensor::new(&ctx, DType::F32, &[16, 16])?;
//! let dy = Tensor::from_host(&ctx, DType::F32, &[16, 16], &vec![0.1f32; 16 * 16])?;
//! let autocast = model.autocast()?;
//! let pass = model.forward(&x, &mut y)?; // FP8 inside the region
//! autocast.end()?;
//! pass.backward(&dy, None)?;
//! opt.step()?;
//! opt.zero_grad()?;
//! # Ok(()) }
//! ```
//!
//! # Ownership and lifetimes
//! Each handle kind is an owning type that destroys its object when dropped: [`Context`],
//! [`Recipe`], [`Tensor`], [`Scaling`], [`Model`], [`Optimizer`], [`Saved`], [`StackSaved`],
//! [`Comm`], [`ManagedTensor`] and [`ManagedTensorVersioned`] (which run their deleter). Objects made
//! from a context borrow it (`Tensor<'c>`, `Model<'c>`); a model's parameters are
//! [`TensorRef<'m>`] borrowed from the model; an [`Optimizer<'m>`] borrows its model (fp8.h:
//! destroy it first); a forward that awaits its backward ([`ForwardPass`], [`LayerPass`],
//! [`Saved`], [`StackSaved`]) borrows the forward's input, which the backward reads. libfp8 keeps one whole-model
//! forward and one `fp8_layer_forward` per layer, so a [`ForwardPass`] superseded by a later
//! `Model::forward` refuses its backward, and a layer's `Model::layer_forward` is refused while a
//! [`LayerPass`] of it is alive: a backward never reads another forward's input.
//! [`Model::convert`], [`Model::convert_with`] and [`Model::to_high_precision`] take `&mut self`:
//! a conversion may move the parameter storage, so no borrow of the model lives across it.
//!
//! # Stacks
//! [`Model::stack_forward_saved`] runs a range of layers as one operation (PyTorch's
//! `nn.Sequential`), [`Model::stack_forward_residual`] adds a residual in the last Linear's GEMM;
//! each hands back a [`StackSaved`] that borrows x, for [`Model::stack_backward_saved`] (or
//! `_add`). [`DxMode`] says what a backward does with dx: write it, accumulate into it, or make it
//! dy + the gradient (a residual that is x itself).
//!
//! # DLPack
//! [`Tensor::to_dlpack`] and [`TensorRef::to_dlpack`] lend a tensor as a [`ManagedTensor`] (hand
//! its raw `DLManagedTensor` to the consumer with [`ManagedTensor::into_raw`]: the consumer calls
//! the deleter); [`Tensor::from_managed`] and the `unsafe` [`Tensor::from_dlpack`] take one in.
//! DLPack 1.x's `DLManagedTensorVersioned` goes the same ways as a [`ManagedTensorVersioned`]
//! ([`Tensor::to_dlpack_versioned`], [`TensorRef::to_dlpack_versioned`],
//! [`Tensor::from_managed_versioned`], `unsafe` [`Tensor::from_dlpack_versioned`]): version 1.x,
//! flags, and FP8 as DLPack 1.1's float8_e4m3fn / float8_e5m2 both ways (the unversioned struct
//! carries FP8 as uint8 codes, which libfp8 does not take back). The C layouts are in [`dlpack`].
//!
//! # Scaling recipes
//! The recipe keys `scaling` (delayed, current, rowwise, block) and `power_2_scales` are
//! [`RecipeAttr::Scaling`] and [`RecipeAttr::PowerOf2Scales`]; a converted layer's
//! [`LayerReport::scaling`] says which one its casts use. For callers that drive the GEMMs
//! themselves, [`Context::quantize_scaled`] and [`Context::gemm_scaled`] take grids of scales
//! shaped by [`ScaleMode::grid_shape`].
//!
//! # Errors
//! Every fallible call returns [`Result`]; an [`Error`] carries the [`Status`] and the message
//! of `fp8_last_error_message()`, read right after the failing call.
//!
//! # Threads
//! fp8.h: "one thread at a time may use a context and everything created from it; different
//! contexts may be used from different threads at once." So [`Context`] is `Send` (it can move
//! only while nothing borrows it) and nothing is `Sync`; objects made from a context are neither.
//! [`Recipe`] is `Send` (made from no context, kept by nothing). For data parallelism on threads,
//! [`Rank::local_group`] makes one `Send` [`Rank`] (context + communicator) per thread.

mod comm;
mod context;
pub mod dlpack;
mod error;
mod model;
mod optimizer;
mod recipe;
mod scaling;
mod tensor;

pub use fp8_sys as sys;

pub use comm::{Comm, CommId, Rank};
pub use context::{device_count, device_info, Context, DeviceInfo};
pub use dlpack::{ManagedTensor, ManagedTensorVersioned};
pub use error::{Error, Result, Status};
pub use model::{
    Activation, Autocast, ConvertOptions, DxMode, ForwardPass, LayerId, LayerKind, LayerPass, LayerReport, Model,
    Parameter, Precision, Saved, ScalingSlot, StackSaved, StorageRole,
};
pub use optimizer::{OptimAttr, Optimizer, OptimizerKind, OptimizerStats};
pub use recipe::{AttrBounds, Recipe, RecipeAttr, Role};
pub use scaling::{GemmOptions, Norm, ScaleMode, Scaling, ScalingInfo};
pub use tensor::{decode, encode, AsTensor, DType, HostElement, Tensor, TensorRef};

/// The version of the library loaded (MAJOR*10000 + MINOR*100 + PATCH; compare with
/// `sys::FP8_VERSION_NUMBER`).
pub fn version_number() -> u32 {
    unsafe { sys::fp8_version_number() }
}

/// "MAJOR.MINOR.PATCH" of the library loaded.
pub fn version() -> &'static str {
    unsafe { error::static_str(sys::fp8_version_string()) }
}

/// The lifetime and thread rules, checked at compile time (these examples must not compile).
///
/// A parameter cannot outlive its model:
/// ```compile_fail,E0597
/// let ctx = fp8::Context::cpu().unwrap();
/// let weight;
/// {
///     let mut model = fp8::Model::new(&ctx).unwrap();
///     model.add_linear("fc", 16, 16, true).unwrap();
///     weight = model.parameter("fc.weight").unwrap().0;
/// }
/// weight.numel().unwrap();
/// ```
///
/// A tensor cannot outlive its context:
/// ```compile_fail,E0597
/// let tensor;
/// {
///     let ctx = fp8::Context::cpu().unwrap();
///     tensor = fp8::Tensor::new(&ctx, fp8::DType::F32, &[4]).unwrap();
/// }
/// drop(tensor);
/// ```
///
/// A context cannot move to another thread while something made from it lives:
/// ```compile_fail,E0505
/// let ctx = fp8::Context::cpu().unwrap();
/// let tensor = fp8::Tensor::new(&ctx, fp8::DType::F32, &[4]).unwrap();
/// std::thread::spawn(move || drop(ctx));
/// drop(tensor);
/// ```
///
/// A forward's input cannot be written (or dropped) before its backward, which reads it:
/// ```compile_fail,E0502
/// let ctx = fp8::Context::cpu().unwrap();
/// let mut model = fp8::Model::new(&ctx).unwrap();
/// model.add_linear("fc", 4, 4, true).unwrap();
/// let mut x = fp8::Tensor::new(&ctx, fp8::DType::F32, &[1, 4]).unwrap();
/// let mut y = fp8::Tensor::new(&ctx, fp8::DType::F32, &[1, 4]).unwrap();
/// let dy = fp8::Tensor::new(&ctx, fp8::DType::F32, &[1, 4]).unwrap();
/// let pass = model.forward(&x, &mut y).unwrap();
/// x.copy_from_host(&[0.0f32; 4]).unwrap();
/// pass.backward(&dy, None).unwrap();
/// ```
///
/// Nor the input of a stack forward, whose first layer's backward may read it:
/// ```compile_fail,E0502
/// let ctx = fp8::Context::cpu().unwrap();
/// let mut model = fp8::Model::new(&ctx).unwrap();
/// model.add_linear("fc", 4, 4, true).unwrap();
/// let mut x = fp8::Tensor::new(&ctx, fp8::DType::F32, &[1, 4]).unwrap();
/// let mut y = fp8::Tensor::new(&ctx, fp8::DType::F32, &[1, 4]).unwrap();
/// let dy = fp8::Tensor::new(&ctx, fp8::DType::F32, &[1, 4]).unwrap();
/// let mut saved = model.stack_forward_saved(.., &x, &mut y).unwrap();
/// x.copy_from_host(&[0.0f32; 4]).unwrap();
/// model.stack_backward_saved(&mut saved, &dy, None, fp8::DxMode::Write).unwrap();
/// ```
///
/// x cannot be its own backward's dx (fp8.h: dx must not overlap the x the backward reads):
/// ```compile_fail,E0502
/// let ctx = fp8::Context::cpu().unwrap();
/// let mut model = fp8::Model::new(&ctx).unwrap();
/// model.add_linear("fc", 4, 4, true).unwrap();
/// let mut x = fp8::Tensor::new(&ctx, fp8::DType::F32, &[1, 4]).unwrap();
/// let mut y = fp8::Tensor::new(&ctx, fp8::DType::F32, &[1, 4]).unwrap();
/// let dy = fp8::Tensor::new(&ctx, fp8::DType::F32, &[1, 4]).unwrap();
/// let mut saved = model.stack_forward_saved(.., &x, &mut y).unwrap();
/// model.stack_backward_saved(&mut saved, &dy, Some(&mut x), fp8::DxMode::Write).unwrap();
/// ```
///
/// A stack's state goes to the stack's backward, a layer's to the layer's (libfp8 refuses the
/// other; here the compiler does):
/// ```compile_fail,E0308
/// let ctx = fp8::Context::cpu().unwrap();
/// let mut model = fp8::Model::new(&ctx).unwrap();
/// model.add_linear("fc", 4, 4, true).unwrap();
/// let x = fp8::Tensor::new(&ctx, fp8::DType::F32, &[1, 4]).unwrap();
/// let mut y = fp8::Tensor::new(&ctx, fp8::DType::F32, &[1, 4]).unwrap();
/// let mut saved = model.stack_forward_saved(.., &x, &mut y).unwrap();
/// model.backward_saved(0, &mut saved, &y, None, fp8::DxMode::Write).unwrap();
/// ```
/// ```compile_fail,E0308
/// let ctx = fp8::Context::cpu().unwrap();
/// let mut model = fp8::Model::new(&ctx).unwrap();
/// model.add_linear("fc", 4, 4, true).unwrap();
/// let x = fp8::Tensor::new(&ctx, fp8::DType::F32, &[1, 4]).unwrap();
/// let mut y = fp8::Tensor::new(&ctx, fp8::DType::F32, &[1, 4]).unwrap();
/// let mut saved = model.forward_saved(0, &x, &mut y).unwrap();
/// model.stack_backward_saved(&mut saved, &y, None, fp8::DxMode::Write).unwrap();
/// ```
///
/// A DLPack view of a tensor over the caller's buffer cannot outlive the buffer (libfp8 keeps
/// only the memory it allocated alive for its consumers):
/// ```compile_fail,E0597
/// let ctx = fp8::Context::cpu().unwrap();
/// let lent;
/// {
///     let mut buf = vec![0.0f32; 4];
///     let t = fp8::Tensor::wrap_host(&ctx, fp8::DType::F32, &[4], &mut buf).unwrap();
///     lent = t.to_dlpack().unwrap();
/// }
/// drop(lent);
/// ```
/// ```compile_fail,E0597
/// let ctx = fp8::Context::cpu().unwrap();
/// let lent;
/// {
///     let mut buf = vec![0u8; 4];
///     let t = fp8::Tensor::wrap_host(&ctx, fp8::DType::E4M3, &[4], &mut buf).unwrap();
///     lent = t.to_dlpack_versioned().unwrap();
/// }
/// drop(lent);
/// ```
///
/// An optimizer cannot outlive its model (fp8.h: destroy it first):
/// ```compile_fail,E0505
/// let ctx = fp8::Context::cpu().unwrap();
/// let model = fp8::Model::new(&ctx).unwrap();
/// let opt = fp8::Optimizer::new(&model, fp8::OptimizerKind::AdamW).unwrap();
/// drop(model);
/// drop(opt);
/// ```
///
/// Layers cannot be added while an optimizer of the model exists:
/// ```compile_fail,E0502
/// let ctx = fp8::Context::cpu().unwrap();
/// let mut model = fp8::Model::new(&ctx).unwrap();
/// let opt = fp8::Optimizer::new(&model, fp8::OptimizerKind::AdamW).unwrap();
/// model.add_linear("fc", 4, 4, true).unwrap();
/// drop(opt);
/// ```
///
/// Objects made from a context are not Send (only the context as a whole moves):
/// ```compile_fail,E0277
/// fn send<T: Send>(_: &T) {}
/// let ctx = fp8::Context::cpu().unwrap();
/// let tensor = fp8::Tensor::new(&ctx, fp8::DType::F32, &[4]).unwrap();
/// send(&tensor);
/// ```
/// ```compile_fail,E0277
/// fn send<T: Send>(_: &T) {}
/// let ctx = fp8::Context::cpu().unwrap();
/// let model = fp8::Model::new(&ctx).unwrap();
/// send(&model);
/// ```
/// ```compile_fail,E0277
/// fn send<T: Send>(_: &T) {}
/// let ctx = fp8::Context::cpu().unwrap();
/// let model = fp8::Model::new(&ctx).unwrap();
/// let opt = fp8::Optimizer::new(&model, fp8::OptimizerKind::AdamW).unwrap();
/// send(&opt);
/// ```
///
/// ```compile_fail,E0277
/// fn send<T: Send>(_: &T) {}
/// let ctx = fp8::Context::cpu().unwrap();
/// let t = fp8::Tensor::new(&ctx, fp8::DType::F32, &[4]).unwrap();
/// send(&t.to_dlpack().unwrap());
/// ```
/// ```compile_fail,E0277
/// fn send<T: Send>(_: &T) {}
/// let ctx = fp8::Context::cpu().unwrap();
/// let t = fp8::Tensor::new(&ctx, fp8::DType::F32, &[4]).unwrap();
/// send(&t.to_dlpack_versioned().unwrap());
/// ```
///
/// Nothing is Sync (externally synchronised objects):
/// ```compile_fail,E0277
/// fn sync<T: Sync>() {}
/// sync::<fp8::Context>();
/// ```
/// ```compile_fail,E0277
/// fn sync<T: Sync>() {}
/// sync::<fp8::Recipe>();
/// ```
/// ```compile_fail,E0277
/// fn sync<T: Sync>() {}
/// sync::<fp8::Rank>();
/// ```
#[doc(hidden)]
pub mod compile_time_rules {}
