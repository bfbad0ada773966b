//! Models: named layers with their parameters, whole-model and per-layer runs, conversion to FP8,
//! autocast, checkpoints (fp8.h, "Models and layers").

use crate::context::Context;
use crate::error::{c_path, c_string, c_text, check, created, read_text, Error, Result, Status};
use crate::optimizer::Optimizer;
use crate::recipe::Recipe;
use crate::scaling::ScalingInfo;
use crate::tensor::{AsTensor, DType, HostElement, TensorRef};
use fp8_sys as sys;
use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::ptr::{self, NonNull};

/// A layer's id: 0, 1, ... in the order the layers were added.
pub type LayerId = i32;

/// Activation functions (`FP8_ACTIVATION_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Activation {
    Relu = sys::FP8_ACTIVATION_RELU,
    /// The tanh approximation, TransformerEngine's.
    Gelu = sys::FP8_ACTIVATION_GELU,
    /// x = [gate | up] along the last dimension: silu(gate) * up.
    Swiglu = sys::FP8_ACTIVATION_SWIGLU,
}

/// Layer kinds (`FP8_LAYER_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    Linear,
    LayerNorm,
    RmsNorm,
    Activation,
    Unknown(i32),
}

impl LayerKind {
    fn from_raw(k: i32) -> LayerKind {
        match k {
            sys::FP8_LAYER_LINEAR => LayerKind::Linear,
            sys::FP8_LAYER_LAYERNORM => LayerKind::LayerNorm,
            sys::FP8_LAYER_RMSNORM => LayerKind::RmsNorm,
            sys::FP8_LAYER_ACTIVATION => LayerKind::Activation,
            k => LayerKind::Unknown(k),
        }
    }
}

/// The precision a layer's latest call ran at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    Fp8,
    High,
    /// No such call yet (or none planned).
    None,
}

impl Precision {
    fn from_raw(p: i32) -> Precision {
        match p {
            1 => Precision::Fp8,
            0 => Precision::High,
            _ => Precision::None,
        }
    }
}

/// What a layer did (`fp8_layer_report_t`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerReport {
    pub kind: LayerKind,
    pub converted: bool,
    pub fprop: Precision,
    pub dgrad: Precision,
    pub wgrad: Precision,
    pub fp8_calls: i64,
    pub fallback_calls: i64,
    /// Why the latest forward under FP8 fell back, or why conversion left the layer alone.
    pub reason: String,
    /// `fp8_sys::FP8_SCALING_*` of the layer's FP8 casts (its conversion recipe's `scaling`); -1
    /// when the layer is not converted.
    pub scaling: i32,
}

/// Which layers `Model::convert_with` converts, and in which direction (`fp8_convert_options_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvertOptions {
    /// true: to FP8 under the recipe; false: back to high precision.
    pub to_fp8: bool,
    pub linear: bool,
    pub norm: bool,
    pub activation: bool,
}

impl Default for ConvertOptions {
    /// libfp8's defaults (`fp8_convert_options_init`): every kind, to FP8.
    fn default() -> Self {
        let mut o = sys::fp8_convert_options_t::default();
        unsafe { sys::fp8_convert_options_init(&mut o) };
        ConvertOptions {
            to_fp8: o.to_fp8 != 0,
            linear: o.linear != 0,
            norm: o.norm != 0,
            activation: o.activation != 0,
        }
    }
}

/// Flat-storage roles (`FP8_STORAGE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum StorageRole {
    Values = sys::FP8_STORAGE_VALUES,
    Grads = sys::FP8_STORAGE_GRADS,
    Masters = sys::FP8_STORAGE_MASTERS,
}

/// Scaling-state slots of a layer (`FP8_SCALING_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum ScalingSlot {
    /// Linear: x.
    Input = sys::FP8_SCALING_INPUT,
    /// Linear: W.
    Weight = sys::FP8_SCALING_WEIGHT,
    /// Linear: dy.
    GradOutput = sys::FP8_SCALING_GRAD_OUTPUT,
    /// Norm / activation: the FP8 y.
    Output = sys::FP8_SCALING_OUTPUT,
}

/// What a backward writes into dx: the `FP8_BACKWARD_*` flags of `Model::backward_saved` and
/// `Model::stack_backward_saved`, one at a time (fp8.h: "Not both"; libfp8 refuses the pair).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DxMode {
    /// dx = the input gradient (flags 0).
    #[default]
    Write,
    /// dx = round(float(dx) + the input gradient) (`FP8_BACKWARD_ACCUMULATE_DX`): x feeds more than
    /// one branch (a residual connection) and dx already holds another branch's gradient.
    Accumulate,
    /// dx = round(float(dy) + the input gradient) (`FP8_BACKWARD_ADD_DY`): the gradient of
    /// y = x + f(x), whose residual is x itself (`Model::stack_forward_residual` with residual =
    /// x), in the same pass. dx takes dy's shape and dtype, dy must be 16-byte aligned (tensors from
    /// `Tensor::new` are) and dx is required.
    AddDy,
}

impl DxMode {
    /// The `FP8_BACKWARD_*` flags of this mode.
    pub fn flags(self) -> u32 {
        match self {
            DxMode::Write => 0,
            DxMode::Accumulate => sys::FP8_BACKWARD_ACCUMULATE_DX,
            DxMode::AddDy => sys::FP8_BACKWARD_ADD_DY,
        }
    }
}

/// A parameter of a model: its name ("fc1.weight"), value and gradient, borrowed from the model.
#[derive(Clone, Debug)]
pub struct Parameter<'m> {
    pub name: String,
    pub value: TensorRef<'m>,
    pub grad: TensorRef<'m>,
}

/// A model: named layers (Linear, LayerNorm, RMSNorm, activations) with FP32 parameters and
/// gradients. It borrows its context (`'c`).
///
/// Methods that change the model's structure (adding layers, data parallelism) take `&mut self`,
/// so that nothing borrowed from the model (parameters, an optimizer, a forward awaiting its
/// backward) is alive then; the training calls take `&self`.
pub struct Model<'c> {
    raw: NonNull<sys::fp8_model_t>,
    // libfp8 keeps one whole-model forward and one `fp8_layer_forward` per layer for their
    // backwards, holding x's data pointer, and a backward differentiates whichever is kept. These
    // tie each `ForwardPass` and `LayerPass` to its own forward, so that a backward can never reach
    // the x of another forward, which its caller may have freed (see `ForwardPass`, `LayerPass`).
    /// `fp8_model_forward` calls so far (a `ForwardPass` is valid while it holds the latest).
    forwards: Cell<u64>,
    /// The layers with a `LayerPass` alive (their next `layer_forward` is refused until it goes).
    layer_passes: RefCell<Vec<LayerId>>,
    _ctx: PhantomData<&'c Context>,
}

fn layer_index(i: usize, what: &str) -> Result<i32> {
    i32::try_from(i).map_err(|_| Error::new(Status::InvalidArgument, format!("{what} {i} is out of range")))
}

fn opt_mut(t: Option<&mut dyn AsTensor>) -> *mut sys::fp8_tensor_t {
    t.map_or(ptr::null_mut(), |t| t.as_ptr())
}

impl<'c> Model<'c> {
    /// An empty model on `ctx`'s device.
    pub fn new(ctx: &'c Context) -> Result<Model<'c>> {
        let mut raw = ptr::null_mut();
        check(unsafe { sys::fp8_model_create(&mut raw, ctx.as_ptr()) })?;
        Ok(Model {
            raw: created(raw, "fp8_model_create")?,
            forwards: Cell::new(0),
            layer_passes: RefCell::new(Vec::new()),
            _ctx: PhantomData,
        })
    }

    fn ptr(&self) -> *mut sys::fp8_model_t {
        self.raw.as_ptr()
    }

    /// The raw handle, borrowed.
    pub fn as_ptr(&self) -> *mut sys::fp8_model_t {
        self.raw.as_ptr()
    }

    /* ---- building ---- */

    /// A Linear of weight `[out_features, in_features]` (and bias `[out_features]` if `bias`). Its
    /// weights start at zero: initialise them (`parameter_at(..).value.copy_from_host`).
    pub fn add_linear(&mut self, name: &str, in_features: i64, out_features: i64, bias: bool) -> Result<LayerId> {
        let name = c_string(name, "layer name")?;
        let mut id = 0;
        check(unsafe {
            sys::fp8_model_add_linear(self.ptr(), name.as_ptr(), in_features, out_features, bias as i32, &mut id)
        })?;
        Ok(id)
    }

    /// A LayerNorm over the last dimension `dim` (parameters "weight" = 1 and "bias" = 0).
    pub fn add_layernorm(&mut self, name: &str, dim: i64, eps: f32) -> Result<LayerId> {
        let name = c_string(name, "layer name")?;
        let mut id = 0;
        check(unsafe { sys::fp8_model_add_layernorm(self.ptr(), name.as_ptr(), dim, eps, &mut id) })?;
        Ok(id)
    }

    /// An RMSNorm over the last dimension `dim` (parameter "weight" = 1).
    pub fn add_rmsnorm(&mut self, name: &str, dim: i64, eps: f32) -> Result<LayerId> {
        let name = c_string(name, "layer name")?;
        let mut id = 0;
        check(unsafe { sys::fp8_model_add_rmsnorm(self.ptr(), name.as_ptr(), dim, eps, &mut id) })?;
        Ok(id)
    }

    /// An activation layer (no parameters).
    pub fn add_activation(&mut self, name: &str, activation: Activation) -> Result<LayerId> {
        let name = c_string(name, "layer name")?;
        let mut id = 0;
        check(unsafe { sys::fp8_model_add_activation(self.ptr(), name.as_ptr(), activation as i32, &mut id) })?;
        Ok(id)
    }

    pub fn layer_count(&self) -> Result<usize> {
        let mut n = 0;
        check(unsafe { sys::fp8_model_layer_count(self.ptr(), &mut n) })?;
        Ok(n as usize)
    }

    pub fn find_layer(&self, name: &str) -> Result<LayerId> {
        let name = c_string(name, "layer name")?;
        let mut id = 0;
        check(unsafe { sys::fp8_model_find_layer(self.ptr(), name.as_ptr(), &mut id) })?;
        Ok(id)
    }

    pub fn layer_name(&self, layer: LayerId) -> Result<String> {
        let mut name = ptr::null();
        check(unsafe { sys::fp8_model_layer_name(self.ptr(), layer, &mut name) })?;
        Ok(unsafe { c_text(name) })
    }

    /* ---- parameters ---- */

    /// The parameter `"<layer>.<param>"`: (value, gradient), borrowed from the model.
    pub fn parameter(&self, name: &str) -> Result<(TensorRef<'_>, TensorRef<'_>)> {
        let cname = c_string(name, "parameter name")?;
        let (mut value, mut grad) = (ptr::null_mut(), ptr::null_mut());
        check(unsafe { sys::fp8_model_parameter(self.ptr(), cname.as_ptr(), &mut value, &mut grad) })?;
        Ok((lent(value, name)?, lent(grad, name)?))
    }

    pub fn parameter_count(&self) -> Result<usize> {
        let mut n = 0;
        check(unsafe { sys::fp8_model_parameter_count(self.ptr(), &mut n) })?;
        Ok(n as usize)
    }

    /// Parameter `index` in the fixed order (layers in order; weight, bias / gamma, beta).
    pub fn parameter_at(&self, index: usize) -> Result<Parameter<'_>> {
        let (mut name, mut value, mut grad) = (ptr::null(), ptr::null_mut(), ptr::null_mut());
        check(unsafe {
            sys::fp8_model_parameter_at(self.ptr(), layer_index(index, "index")?, &mut name, &mut value, &mut grad)
        })?;
        let name = unsafe { c_text(name) };
        Ok(Parameter { value: lent(value, &name)?, grad: lent(grad, &name)?, name })
    }

    /// Every parameter, in order.
    pub fn parameters(&self) -> Result<Vec<Parameter<'_>>> {
        (0..self.parameter_count()?).map(|i| self.parameter_at(i)).collect()
    }

    /// Writes F32 host values into parameter `index` in whatever form the model stores it (FP32,
    /// F16 at O1/O2, the F16 master and its E4M3 copy at O3). Synchronous.
    pub fn write_parameter(&self, index: usize, values: &[f32]) -> Result<()> {
        self.write_parameter_as(index, DType::F32, values)
    }

    /// As `write_parameter`, from host values of `dtype` (F32, F16 or BF16; 16-bit ones as `u16`).
    pub fn write_parameter_as<T: HostElement>(&self, index: usize, dtype: DType, values: &[T]) -> Result<()> {
        check(unsafe {
            sys::fp8_model_write_parameter(
                self.ptr(),
                layer_index(index, "index")?,
                dtype.raw(),
                values.as_ptr().cast(),
                std::mem::size_of_val(values),
            )
        })
    }

    /// Tells the model its weights changed outside libfp8.
    pub fn weights_changed(&self) -> Result<()> {
        check(unsafe { sys::fp8_model_weights_changed(self.ptr()) })
    }

    /// `grad[index] += g` (an F32 tensor of the parameter's element count).
    pub fn accumulate_grad(&self, index: usize, g: &(impl AsTensor + ?Sized)) -> Result<()> {
        check(unsafe { sys::fp8_model_accumulate_grad(self.ptr(), layer_index(index, "index")?, g.as_ptr()) })
    }

    pub fn zero_grad(&self) -> Result<()> {
        check(unsafe { sys::fp8_model_zero_grad(self.ptr()) })
    }

    /// 0 (FP32 Linear weights) or `FP8_OPT_O1..O3`: the level the storage is at.
    pub fn storage_level(&self) -> Result<i32> {
        let mut level = 0;
        check(unsafe { sys::fp8_model_storage_level(self.ptr(), &mut level) })?;
        Ok(level)
    }

    /// The flat allocation of `role` holding `dtype` (device memory on a CUDA context) and the
    /// bytes it spans; (NULL, 0) when there is none. The pointer is borrowed from the model and
    /// moves when the storage is laid out again (fp8.h, "Flat storage").
    pub fn flat_storage(&self, role: StorageRole, dtype: DType) -> Result<(*mut c_void, usize)> {
        let (mut data, mut bytes) = (ptr::null_mut(), 0usize);
        check(unsafe { sys::fp8_model_flat_storage(self.ptr(), role as i32, dtype.raw(), &mut data, &mut bytes) })?;
        Ok((data, bytes))
    }

    /* ---- modes, conversion, autocast ---- */

    /// Training (the default) or eval mode.
    pub fn set_training(&self, training: bool) -> Result<()> {
        check(unsafe { sys::fp8_model_set_training(self.ptr(), training as i32) })
    }

    /// Converts every Linear, norm and activation layer to FP8 under `recipe` (copied).
    ///
    /// Takes `&mut self` because a conversion may move the parameter storage (the first one, or
    /// one that changes the storage level, frees the old memory): no borrow of the model may live
    /// across it (parameter [`TensorRef`]s, passes, autocast regions, optimizers), and a parameter
    /// fetched before must be fetched again after. A [`Saved`] or [`StackSaved`] borrows only its
    /// forward's x, so one made before a conversion can outlive it; libfp8 refuses its backward.
    ///
    /// These must not compile. A parameter kept across the conversion:
    /// ```compile_fail,E0502
    /// let ctx = fp8::Context::cpu().unwrap();
    /// let mut model = fp8::Model::new(&ctx).unwrap();
    /// model.add_linear("fc", 16, 16, true).unwrap();
    /// let weight = model.parameter("fc.weight").unwrap().0;
    /// model.convert(&fp8::Recipe::from_text("backend=te").unwrap()).unwrap();
    /// weight.to_vec::<f32>().unwrap(); // would read freed memory
    /// ```
    /// A parameter as the x of another model's saved forward, which keeps only x's data pointer:
    /// ```compile_fail,E0502
    /// let ctx = fp8::Context::cpu().unwrap();
    /// let mut a = fp8::Model::new(&ctx).unwrap();
    /// a.add_linear("fc", 16, 16, false).unwrap();
    /// let mut b = fp8::Model::new(&ctx).unwrap();
    /// b.add_linear("fc", 16, 16, false).unwrap();
    /// let weight = a.parameter("fc.weight").unwrap().0;
    /// let mut y = fp8::Tensor::new(&ctx, fp8::DType::F32, &[16, 16]).unwrap();
    /// let mut saved = b.forward_saved(0, &weight, &mut y).unwrap();
    /// a.convert(&fp8::Recipe::from_text("backend=te").unwrap()).unwrap();
    /// b.backward_saved(0, &mut saved, &y, None, fp8::DxMode::Write).unwrap(); // would read freed memory
    /// ```
    /// A forward awaiting its backward:
    /// ```compile_fail,E0502
    /// let ctx = fp8::Context::cpu().unwrap();
    /// let mut model = fp8::Model::new(&ctx).unwrap();
    /// model.add_linear("fc", 16, 16, true).unwrap();
    /// let x = fp8::Tensor::new(&ctx, fp8::DType::F32, &[1, 16]).unwrap();
    /// let mut y = fp8::Tensor::new(&ctx, fp8::DType::F32, &[1, 16]).unwrap();
    /// let pass = model.forward(&x, &mut y).unwrap();
    /// model.convert(&fp8::Recipe::from_text("backend=te").unwrap()).unwrap();
    /// pass.backward(&y, None).unwrap();
    /// ```
    pub fn convert(&mut self, recipe: &Recipe) -> Result<()> {
        check(unsafe { sys::fp8_convert_model(self.ptr(), recipe.as_ptr(), ptr::null()) })
    }

    /// Converts the layers `options` chooses; `recipe` may be None when `options.to_fp8` is false.
    /// Takes `&mut self` as [`Self::convert`] does: a conversion may move the parameter storage,
    /// so no borrow of the model may live across it.
    pub fn convert_with(&mut self, recipe: Option<&Recipe>, options: &ConvertOptions) -> Result<()> {
        let mut o = sys::fp8_convert_options_t::default();
        unsafe { sys::fp8_convert_options_init(&mut o) };
        o.to_fp8 = options.to_fp8 as i32;
        o.linear = options.linear as i32;
        o.norm = options.norm as i32;
        o.activation = options.activation as i32;
        check(unsafe { sys::fp8_convert_model(self.ptr(), recipe.map_or(ptr::null(), |r| r.as_ptr()), &o) })
    }

    /// Every layer back to high precision (parameters and gradients kept). Takes `&mut self` as
    /// [`Self::convert`] does: a conversion may move the parameter storage, so no borrow of the
    /// model may live across it.
    pub fn to_high_precision(&mut self) -> Result<()> {
        self.convert_with(None, &ConvertOptions { to_fp8: false, ..ConvertOptions::default() })
    }

    pub fn has_fp8_layers(&self) -> Result<bool> {
        let mut has = 0;
        check(unsafe { sys::fp8_model_has_fp8_layers(self.ptr(), &mut has) })?;
        Ok(has != 0)
    }

    /// Starts an autocast region (`fp8_autocast_begin`); end it with `autocast_end`.
    pub fn autocast_begin(&self) -> Result<()> {
        check(unsafe { sys::fp8_autocast_begin(self.ptr()) })
    }

    /// Ends the region and updates the scaling states that recorded an amax in it.
    pub fn autocast_end(&self) -> Result<()> {
        check(unsafe { sys::fp8_autocast_end(self.ptr()) })
    }

    /// An autocast region that ends when the guard does (`Autocast::end` reports the end's
    /// status; a drop ignores it).
    pub fn autocast(&self) -> Result<Autocast<'_>> {
        self.autocast_begin()?;
        Ok(Autocast { model: self.raw, open: true, _model: PhantomData })
    }

    /// Every forward and per-layer call outside an explicit region runs as a region of its own.
    pub fn set_autowrap(&self, on: bool) -> Result<()> {
        check(unsafe { sys::fp8_model_set_autowrap(self.ptr(), on as i32) })
    }

    /* ---- running ---- */

    /// y = model(x), the layers in order. In training mode the model keeps what the backward
    /// needs, x included: the returned pass borrows x (so it stays alive and unchanged) and is
    /// the way to run the backward. Drop it to forgo the backward (evaluation).
    ///
    /// libfp8 differentiates the latest forward only, so a later `forward` of this model (even a
    /// failed one) supersedes the pass: its `backward` is then refused (`Status::InvalidState`)
    /// rather than run on the later forward's x.
    pub fn forward<'a, X, Y>(&'a self, x: &'a X, y: &mut Y) -> Result<ForwardPass<'a>>
    where
        X: AsTensor + ?Sized,
        Y: AsTensor + ?Sized,
    {
        // Counted before the call: whatever a failed forward leaves kept is not an older pass's.
        let serial = self.forwards.get() + 1;
        self.forwards.set(serial);
        check(unsafe { sys::fp8_model_forward(self.ptr(), x.as_ptr(), y.as_ptr()) })?;
        Ok(ForwardPass { model: self, serial, _x: PhantomData })
    }

    /// y = layer(x) (`fp8_layer_forward`); the pass runs the layer's backward.
    ///
    /// libfp8 keeps one such forward per layer: while a `LayerPass` of `layer` is alive, another
    /// `layer_forward` of that layer is refused (`Status::InvalidState`): run the pass's backward
    /// or drop it first, or keep several forwards in flight with `forward_saved`.
    pub fn layer_forward<'a, X, Y>(&'a self, layer: LayerId, x: &'a X, y: &mut Y) -> Result<LayerPass<'a>>
    where
        X: AsTensor + ?Sized,
        Y: AsTensor + ?Sized,
    {
        if self.layer_passes.borrow().contains(&layer) {
            return Err(Error::new(
                Status::InvalidState,
                format!(
                    "layer_forward: layer {layer} has a LayerPass awaiting its backward; run its backward or drop it \
                     first, or keep several forwards in flight with forward_saved"
                ),
            ));
        }
        check(unsafe { sys::fp8_layer_forward(self.ptr(), layer, x.as_ptr(), y.as_ptr()) })?;
        self.layer_passes.borrow_mut().push(layer);
        Ok(LayerPass { model: self, layer, _x: PhantomData })
    }

    /// y = layer(x), with what its backward needs handed to the caller: any number of forwards
    /// of a layer may be in flight, differentiated in any order with `backward_saved`.
    pub fn forward_saved<'x, X, Y>(&self, layer: LayerId, x: &'x X, y: &mut Y) -> Result<Saved<'x>>
    where
        X: AsTensor + ?Sized,
        Y: AsTensor + ?Sized,
    {
        let mut raw = ptr::null_mut();
        check(unsafe { sys::fp8_layer_forward_saved(self.ptr(), layer, x.as_ptr(), y.as_ptr(), &mut raw) })?;
        Ok(Saved { raw: created(raw, "fp8_layer_forward_saved")?, _x: PhantomData })
    }

    /// Backward of exactly the forward that made `saved` (`fp8_layer_backward_saved`; consumed on
    /// success: a second backward is refused). `dx` may be None only for a Linear (and not with
    /// `DxMode::AddDy`); `mode` says whether dx is written, accumulated into or made dy + the
    /// gradient. Parameter gradients accumulate. Refused before anything runs for another model's
    /// or layer's state, an eval-mode one, or when the layer was converted or its weights changed
    /// since the forward.
    pub fn backward_saved<DY: AsTensor + ?Sized>(
        &self,
        layer: LayerId,
        saved: &mut Saved<'_>,
        dy: &DY,
        dx: Option<&mut dyn AsTensor>,
        mode: DxMode,
    ) -> Result<()> {
        check(unsafe {
            sys::fp8_layer_backward_saved(self.ptr(), layer, saved.raw.as_ptr(), dy.as_ptr(), opt_mut(dx), mode.flags())
        })
    }

    /* ---- stacks ---- */

    /// (first_layer, layer_count) of a range of layer ids; `..` is every layer. An empty range
    /// goes to libfp8, which refuses it with its own message.
    fn layer_range(&self, layers: &impl RangeBounds<LayerId>) -> Result<(i32, i32)> {
        let start = match layers.start_bound() {
            Bound::Included(&s) => i64::from(s),
            Bound::Excluded(&s) => i64::from(s) + 1,
            Bound::Unbounded => 0,
        };
        let end = match layers.end_bound() {
            Bound::Included(&e) => i64::from(e) + 1,
            Bound::Excluded(&e) => i64::from(e),
            Bound::Unbounded => self.layer_count()? as i64,
        };
        let bad = || Error::new(Status::InvalidArgument, format!("layers {start}..{end}: not a range of layer ids"));
        let first = i32::try_from(start).map_err(|_| bad())?;
        let count = i32::try_from(end - start).map_err(|_| bad())?;
        if count < 0 {
            return Err(bad());
        }
        Ok((first, count))
    }

    /// y = layers(x): the layers of `layers` (`2..5`, `..`) as one sequential stack, each one's
    /// y the next one's x, as `forward` runs the whole model (the same checks, the same E4M3
    /// hand-offs and activation folds under FP8), with what the backward needs handed to the
    /// caller (`fp8_stack_forward_saved`): the activations between the layers that their
    /// backwards read and each layer's state, on loan from the model's pool. Any number of stack
    /// forwards may be in flight; differentiate each with `stack_backward_saved` (or
    /// `stack_backward_saved_add`).
    ///
    /// x: F32 or BF16 `[.., in_features of the first layer]`, of y's dtype unless the first layer
    /// is a norm (which takes either); y: the last layer's output shape, F32 or BF16, the dtype of
    /// every activation between the layers. The state borrows x, which the first layer's backward
    /// may read ("x must stay alive and unchanged until the backward"): x cannot be written or
    /// dropped, nor be the backward's dx, while the state lives.
    pub fn stack_forward_saved<'x, X, Y>(
        &self,
        layers: impl RangeBounds<LayerId>,
        x: &'x X,
        y: &mut Y,
    ) -> Result<StackSaved<'x>>
    where
        X: AsTensor + ?Sized,
        Y: AsTensor + ?Sized,
    {
        let (first, count) = self.layer_range(&layers)?;
        let mut raw = ptr::null_mut();
        check(unsafe { sys::fp8_stack_forward_saved(self.ptr(), first, count, x.as_ptr(), y.as_ptr(), &mut raw) })?;
        Ok(StackSaved { raw: created(raw, "fp8_stack_forward_saved")?, _x: PhantomData })
    }

    /// y = residual + layers(x) (`fp8_stack_forward_residual`): `stack_forward_saved` with the
    /// residual added by the last layer's GEMM, which must be a Linear (`Status::Unsupported`
    /// otherwise). residual and y: the stack's output shape, one dtype (F32 or BF16, a
    /// transformer's residual stream); `act_dtype` (F32 or BF16): the activations between the
    /// layers and x's dtype (either when the first layer is a norm); a BF16 residual takes BF16
    /// activations. The residual may be x itself (pass the same tensor twice: a block
    /// y = x + f(x), whose backward adds dy into dx with `DxMode::AddDy`); for residual = y use
    /// `stack_forward_residual_in_place`; otherwise libfp8 refuses a residual overlapping y. The
    /// backward reads no residual: only x is borrowed by the state. Its backward is
    /// `stack_backward_saved` with dy of y's dtype (the residual's gradient is dy itself).
    pub fn stack_forward_residual<'x, X, R, Y>(
        &self,
        layers: impl RangeBounds<LayerId>,
        x: &'x X,
        residual: &R,
        y: &mut Y,
        act_dtype: DType,
    ) -> Result<StackSaved<'x>>
    where
        X: AsTensor + ?Sized,
        R: AsTensor + ?Sized,
        Y: AsTensor + ?Sized,
    {
        let (first, count) = self.layer_range(&layers)?;
        // SAFETY: residual is only read, during the call.
        unsafe { self.stack_residual(first, count, x.as_ptr(), residual.as_ptr(), y.as_ptr(), act_dtype) }
    }

    /// y += layers(x) (`fp8_stack_forward_residual` with residual = y itself): y holds the residual
    /// stream on entry and the sum on return. As `stack_forward_residual` otherwise.
    pub fn stack_forward_residual_in_place<'x, X, Y>(
        &self,
        layers: impl RangeBounds<LayerId>,
        x: &'x X,
        y: &mut Y,
        act_dtype: DType,
    ) -> Result<StackSaved<'x>>
    where
        X: AsTensor + ?Sized,
        Y: AsTensor + ?Sized,
    {
        let (first, count) = self.layer_range(&layers)?;
        let y = y.as_ptr();
        // SAFETY: fp8.h allows the residual to be y itself.
        unsafe { self.stack_residual(first, count, x.as_ptr(), y, y, act_dtype) }
    }

    /// # Safety
    /// Handles of live tensors (the callers' borrows).
    unsafe fn stack_residual<'x>(
        &self,
        first: i32,
        count: i32,
        x: *mut sys::fp8_tensor_t,
        residual: *mut sys::fp8_tensor_t,
        y: *mut sys::fp8_tensor_t,
        act_dtype: DType,
    ) -> Result<StackSaved<'x>> {
        let mut raw = ptr::null_mut();
        check(sys::fp8_stack_forward_residual(self.ptr(), first, count, x, residual, y, act_dtype.raw(), &mut raw))?;
        Ok(StackSaved { raw: created(raw, "fp8_stack_forward_residual")?, _x: PhantomData })
    }

    /// Backward of the stack forward that made `saved` (`fp8_stack_backward_saved`; consumed on
    /// success: a second backward is refused). dy: y's shape and dtype; dx: x's shape and dtype, or
    /// None when x needs no gradient (not with `DxMode::AddDy`), written as `mode` says.
    /// Parameter gradients accumulate. Refused before anything runs for another model's state, an
    /// eval-mode one, or when a layer of the stack was converted or its weights changed since the
    /// forward (an optimizer step, a parameter write). A layer's `Saved` is another type: the
    /// compiler refuses it here, as libfp8 would.
    pub fn stack_backward_saved<DY: AsTensor + ?Sized>(
        &self,
        saved: &mut StackSaved<'_>,
        dy: &DY,
        dx: Option<&mut dyn AsTensor>,
        mode: DxMode,
    ) -> Result<()> {
        check(unsafe {
            sys::fp8_stack_backward_saved(self.ptr(), saved.raw.as_ptr(), dy.as_ptr(), opt_mut(dx), mode.flags())
        })
    }

    /// `stack_backward_saved` with dx = round(float(base) + the stack's input gradient)
    /// (`fp8_stack_backward_saved_add`): x's gradient from elsewhere (the dy of a residual that is
    /// x, a second consumer of x) added in the first layer's own pass. base: dx's shape and dtype,
    /// 16-byte aligned, not overlapping dx (base = dx itself is `DxMode::Accumulate`).
    pub fn stack_backward_saved_add<DY, B, DX>(
        &self,
        saved: &mut StackSaved<'_>,
        dy: &DY,
        base: &B,
        dx: &mut DX,
    ) -> Result<()>
    where
        DY: AsTensor + ?Sized,
        B: AsTensor + ?Sized,
        DX: AsTensor + ?Sized,
    {
        check(unsafe {
            sys::fp8_stack_backward_saved_add(self.ptr(), saved.raw.as_ptr(), dy.as_ptr(), base.as_ptr(), dx.as_ptr())
        })
    }

    /* ---- reports ---- */

    pub fn layer_report(&self, layer: LayerId) -> Result<LayerReport> {
        // SAFETY: zeroed is a valid value of this plain struct; _init sets struct_size.
        let mut r: sys::fp8_layer_report_t = unsafe { std::mem::zeroed() };
        unsafe { sys::fp8_layer_report_init(&mut r) };
        check(unsafe { sys::fp8_layer_get_report(self.ptr(), layer, &mut r) })?;
        let reason: Vec<u8> = r.reason.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        Ok(LayerReport {
            kind: LayerKind::from_raw(r.kind),
            converted: r.converted != 0,
            fprop: Precision::from_raw(r.fprop),
            dgrad: Precision::from_raw(r.dgrad),
            wgrad: Precision::from_raw(r.wgrad),
            fp8_calls: r.fp8_calls,
            fallback_calls: r.fallback_calls,
            reason: String::from_utf8_lossy(&reason).into_owned(),
            scaling: r.scaling,
        })
    }

    /// A table of every layer as text (`fp8_model_report`).
    pub fn report(&self) -> Result<String> {
        read_text(|buf, cap, needed| unsafe { sys::fp8_model_report(self.ptr(), buf, cap, needed) })
    }

    /// A snapshot of a layer's scaling state in `slot` (None if it has none there). Synchronous.
    pub fn scaling_info(&self, layer: LayerId, slot: ScalingSlot) -> Result<Option<ScalingInfo>> {
        let mut s = ptr::null_mut();
        check(unsafe { sys::fp8_layer_get_scaling(self.ptr(), layer, slot as i32, &mut s) })?;
        if s.is_null() {
            return Ok(None);
        }
        // The borrowed state is valid until the next conversion: read at once.
        Ok(Some(unsafe { ScalingInfo::read(s) }?))
    }

    /* ---- checkpoints and safetensors ---- */

    /// Writes everything needed to resume training (`fp8_checkpoint_save`), atomically; with
    /// `gradients`, the gradients too. `optimizer` None: the model alone.
    pub fn save_checkpoint(
        &self,
        path: impl AsRef<std::path::Path>,
        optimizer: Option<&Optimizer<'_>>,
        gradients: bool,
    ) -> Result<()> {
        let path = c_path(path.as_ref())?;
        let flags = if gradients { sys::FP8_CHECKPOINT_GRADIENTS } else { 0 };
        let opt = optimizer.map_or(ptr::null(), |o| o.as_ptr().cast_const());
        check(unsafe { sys::fp8_checkpoint_save(self.ptr(), opt, path.as_ptr(), flags) })
    }

    /// Loads a checkpoint, all or nothing (`fp8_checkpoint_load`); `optimizer` None keeps the
    /// optimizer's own state.
    pub fn load_checkpoint(
        &self,
        path: impl AsRef<std::path::Path>,
        optimizer: Option<&mut Optimizer<'_>>,
    ) -> Result<()> {
        let path = c_path(path.as_ref())?;
        let opt = optimizer.map_or(ptr::null_mut(), |o| o.as_ptr());
        check(unsafe { sys::fp8_checkpoint_load(self.ptr(), opt, path.as_ptr()) })
    }

    pub fn export_safetensors(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = c_path(path.as_ref())?;
        check(unsafe { sys::fp8_model_export_safetensors(self.ptr(), path.as_ptr()) })
    }

    pub fn import_safetensors(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = c_path(path.as_ref())?;
        check(unsafe { sys::fp8_model_import_safetensors(self.ptr(), path.as_ptr()) })
    }

    /// As `import_safetensors`, from a file that may hold other tensors too (a framework's whole
    /// model of which this one runs a part): every parameter must be there, the rest is left alone.
    pub fn import_safetensors_part(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = c_path(path.as_ref())?;
        check(unsafe { sys::fp8_model_import_safetensors_part(self.ptr(), path.as_ptr()) })
    }

    /* ---- data parallelism ---- */

    /// Makes the model data-parallel over `comm` (collective), or single-rank again with None.
    pub fn set_comm(&mut self, comm: Option<&crate::comm::Comm<'_>>) -> Result<()> {
        check(unsafe { sys::fp8_model_set_comm(self.ptr(), comm.map_or(ptr::null_mut(), |c| c.as_ptr())) })
    }

    /// Averages the gradients not yet averaged across the communicator.
    pub fn sync_grads(&self) -> Result<()> {
        check(unsafe { sys::fp8_model_sync_grads(self.ptr()) })
    }

    /// Each backward is the step's last: buckets are exchanged during it (DDP's default).
    pub fn set_backward_sync(&self, on: bool) -> Result<()> {
        check(unsafe { sys::fp8_model_set_backward_sync(self.ptr(), on as i32) })
    }

    /// Gradient bytes per communication bucket; before `set_comm`.
    pub fn set_bucket_bytes(&mut self, bytes: usize) -> Result<()> {
        check(unsafe { sys::fp8_model_set_bucket_bytes(self.ptr(), bytes) })
    }
}

fn lent<'m>(raw: *mut sys::fp8_tensor_t, name: &str) -> Result<TensorRef<'m>> {
    TensorRef::from_raw(raw).ok_or_else(|| Error::new(Status::Internal, format!("no tensor for parameter {name}")))
}

impl Drop for Model<'_> {
    fn drop(&mut self) {
        unsafe { sys::fp8_model_destroy(self.raw.as_ptr()) }
    }
}

impl std::fmt::Debug for Model<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("layers", &self.layer_count().ok()).finish()
    }
}

/// A forward of the whole model awaiting its backward: it borrows the model and the forward's x
/// (which the backward reads), so neither can be dropped or written before it is done.
///
/// libfp8's `fp8_model_backward` differentiates the model's latest forward, whatever pass asks:
/// a pass superseded by a later `Model::forward` refuses its backward (`Status::InvalidState`),
/// since that forward's x is borrowed by no one and may be gone.
pub struct ForwardPass<'a> {
    model: &'a Model<'a>,
    serial: u64,
    _x: PhantomData<&'a ()>,
}

impl ForwardPass<'_> {
    /// Backward of this forward (`fp8_model_backward`): dy of y's shape and dtype; dx (x's shape)
    /// or None when the input needs no gradient. Parameter gradients accumulate.
    pub fn backward<DY: AsTensor + ?Sized>(self, dy: &DY, dx: Option<&mut dyn AsTensor>) -> Result<()> {
        if self.model.forwards.get() != self.serial {
            return Err(Error::new(
                Status::InvalidState,
                "ForwardPass::backward: the model ran a later forward since this pass's forward; libfp8 keeps \
                 the latest one only (use Model::forward_saved to keep several)",
            ));
        }
        check(unsafe { sys::fp8_model_backward(self.model.ptr(), dy.as_ptr(), opt_mut(dx)) })
    }
}

/// A forward of one layer awaiting its backward (`fp8_layer_forward`); borrows the model and x.
/// While it is alive the layer's next `Model::layer_forward` is refused (libfp8 keeps one forward
/// per layer; a second would make this pass's backward read the other forward's x). Dropped
/// without its backward, the forward stays kept in libfp8, which refuses the layer's next
/// training-mode `layer_forward` until the weights change, the model is converted or its training
/// mode changes: where a forward may go undifferentiated, prefer `Model::forward_saved`.
pub struct LayerPass<'a> {
    model: &'a Model<'a>,
    layer: LayerId,
    _x: PhantomData<&'a ()>,
}

impl LayerPass<'_> {
    /// Backward of this layer's forward (`fp8_layer_backward`); dx None only for a Linear.
    pub fn backward<DY: AsTensor + ?Sized>(self, dy: &DY, dx: Option<&mut dyn AsTensor>) -> Result<()> {
        check(unsafe { sys::fp8_layer_backward(self.model.ptr(), self.layer, dy.as_ptr(), opt_mut(dx)) })
    }
}

impl Drop for LayerPass<'_> {
    fn drop(&mut self) {
        let mut passes = self.model.layer_passes.borrow_mut();
        if let Some(k) = passes.iter().position(|&l| l == self.layer) {
            passes.swap_remove(k);
        }
    }
}

/// What one forward of a layer keeps for its backward (`fp8_saved_t`). It borrows the forward's
/// x, which its backward reads; it may outlive its model.
pub struct Saved<'x> {
    raw: NonNull<sys::fp8_saved_t>,
    _x: PhantomData<&'x ()>,
}

impl Saved<'_> {
    /// Whether this state's backward reads the forward's x (`fp8_saved_needs_input`): false for a
    /// Linear whose weight gradient runs in FP8 (it kept x's transposed FP8 copy).
    pub fn needs_input(&self) -> Result<bool> {
        let mut needs = 0i32;
        check(unsafe { sys::fp8_saved_needs_input(self.raw.as_ptr(), &mut needs) })?;
        Ok(needs != 0)
    }
}

impl Drop for Saved<'_> {
    fn drop(&mut self) {
        unsafe { sys::fp8_saved_destroy(self.raw.as_ptr()) }
    }
}

/// What one stack forward keeps for its backward (`fp8_saved_t` from `Model::stack_forward_saved`
/// or `Model::stack_forward_residual`): each layer's state and the activations between the layers
/// that their backwards read, on loan from the model's pool until the backward or the drop. It
/// borrows the forward's x, which the first layer's backward may read; it may outlive its model.
/// A separate type from a layer's [`Saved`], so that neither reaches the other's backward.
pub struct StackSaved<'x> {
    raw: NonNull<sys::fp8_saved_t>,
    _x: PhantomData<&'x ()>,
}

impl StackSaved<'_> {
    /// Whether this state's backward reads the forward's x (`fp8_saved_needs_input`: the first
    /// layer's rule); false once consumed or for an eval-mode forward.
    pub fn needs_input(&self) -> Result<bool> {
        let mut needs = 0i32;
        check(unsafe { sys::fp8_saved_needs_input(self.raw.as_ptr(), &mut needs) })?;
        Ok(needs != 0)
    }
}

impl Drop for StackSaved<'_> {
    fn drop(&mut self) {
        unsafe { sys::fp8_saved_destroy(self.raw.as_ptr()) }
    }
}

impl std::fmt::Debug for StackSaved<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StackSaved").field("needs_input", &self.needs_input().ok()).finish()
    }
}

/// An autocast region (`Model::autocast`), ended by `end` or when dropped.
pub struct Autocast<'m> {
    model: NonNull<sys::fp8_model_t>,
    open: bool,
    _model: PhantomData<&'m ()>,
}

impl Autocast<'_> {
    /// Ends the region, updating its scaling states.
    pub fn end(mut self) -> Result<()> {
        self.open = false;
        check(unsafe { sys::fp8_autocast_end(self.model.as_ptr()) })
    }
}

impl Drop for Autocast<'_> {
    fn drop(&mut self) {
        if self.open {
            let _ = unsafe { sys::fp8_autocast_end(self.model.as_ptr()) };
        }
    }
}

impl std::fmt::Debug for ForwardPass<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForwardPass").field("serial", &self.serial).finish()
    }
}

impl std::fmt::Debug for LayerPass<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerPass").field("layer", &self.layer).finish()
    }
}

impl std::fmt::Debug for Saved<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Saved").field("needs_input", &self.needs_input().ok()).finish()
    }
}

impl std::fmt::Debug for Autocast<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Autocast").field("open", &self.open).finish()
    }
}
