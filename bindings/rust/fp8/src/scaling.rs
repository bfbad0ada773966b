//! Delayed-scaling states and the operations of fp8.h that work on tensors directly (casts, GEMM,
//! activations, norms), as methods of the context they run on.

use crate::context::Context;
use crate::error::{check, Error, Result, Status};
use crate::recipe::{Recipe, Role};
use crate::tensor::{AsTensor, DType};
use fp8_sys as sys;
use std::marker::PhantomData;
use std::ptr::{self, NonNull};

/// A snapshot of a scaling state (`fp8_scaling_info_t`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScalingInfo {
    pub scale: f32,
    pub scale_inv: f32,
    /// History slot 0: the amax accumulated since the last update.
    pub amax: f32,
    pub amax_history_len: i32,
    pub update_count: i64,
    pub nonfinite_count: i64,
}

impl ScalingInfo {
    /// # Safety
    /// `s` must be a live scaling state.
    pub(crate) unsafe fn read(s: *const sys::fp8_scaling_t) -> Result<ScalingInfo> {
        let mut i = sys::fp8_scaling_info_t::default();
        sys::fp8_scaling_info_init(&mut i);
        check(sys::fp8_scaling_get_info(s, &mut i))?;
        Ok(ScalingInfo {
            scale: i.scale,
            scale_inv: i.scale_inv,
            amax: i.amax,
            amax_history_len: i.amax_history_len,
            update_count: i.update_count,
            nonfinite_count: i.nonfinite_count,
        })
    }
}

/// The delayed-scaling state of one tensor (scale, scale_inv, amax history), on the context's
/// device.
pub struct Scaling<'c> {
    raw: NonNull<sys::fp8_scaling_t>,
    _ctx: PhantomData<&'c Context>,
}

impl<'c> Scaling<'c> {
    /// A state for a tensor of `role` under `recipe` (its dtype and history length).
    pub fn new(ctx: &'c Context, recipe: &Recipe, role: Role) -> Result<Scaling<'c>> {
        let mut raw = ptr::null_mut();
        check(unsafe { sys::fp8_scaling_create(&mut raw, ctx.as_ptr(), recipe.as_ptr(), role as i32) })?;
        Ok(Scaling { raw: NonNull::new(raw).expect("fp8_scaling_create gave NULL with FP8_OK"), _ctx: PhantomData })
    }

    /// The FP8 dtype it scales for.
    pub fn dtype(&self) -> Result<DType> {
        let mut d = 0;
        check(unsafe { sys::fp8_scaling_dtype(self.raw.as_ptr(), &mut d) })?;
        DType::from_raw(d).ok_or_else(|| Error::new(Status::Internal, format!("unknown dtype {d}")))
    }

    /// A snapshot, after the queued work. Synchronous.
    pub fn info(&self) -> Result<ScalingInfo> {
        unsafe { ScalingInfo::read(self.raw.as_ptr()) }
    }

    /// The amax history. Synchronous.
    pub fn history(&self) -> Result<Vec<f32>> {
        let len = self.info()?.amax_history_len;
        let mut h = vec![0.0f32; len.max(0) as usize];
        check(unsafe { sys::fp8_scaling_get_history(self.raw.as_ptr(), h.as_mut_ptr(), len) })?;
        Ok(h)
    }

    /// Sets scale (finite, > 0) and scale_inv = 1/scale. Synchronous.
    pub fn set_scale(&self, scale: f32) -> Result<()> {
        check(unsafe { sys::fp8_scaling_set_scale(self.raw.as_ptr(), scale) })
    }

    pub fn as_ptr(&self) -> *mut sys::fp8_scaling_t {
        self.raw.as_ptr()
    }
}

impl Drop for Scaling<'_> {
    fn drop(&mut self) {
        unsafe { sys::fp8_scaling_destroy(self.raw.as_ptr()) }
    }
}

/// GEMM options (`fp8_gemm_options_t`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmOptions {
    pub alpha: f32,
    /// Add the product to D.
    pub accumulate: bool,
    /// FP8 tensor-core fast accumulation.
    pub fast_accumulation: bool,
}

impl Default for GemmOptions {
    /// libfp8's defaults (`fp8_gemm_options_init`).
    fn default() -> Self {
        let mut o = sys::fp8_gemm_options_t::default();
        unsafe { sys::fp8_gemm_options_init(&mut o) };
        GemmOptions { alpha: o.alpha, accumulate: o.accumulate != 0, fast_accumulation: o.fast_accumulation != 0 }
    }
}

/// Norm kinds (`FP8_NORM_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Norm {
    LayerNorm = sys::FP8_NORM_LAYERNORM,
    RmsNorm = sys::FP8_NORM_RMSNORM,
}

fn opt(t: Option<&dyn AsTensor>) -> *const sys::fp8_tensor_t {
    t.map_or(ptr::null(), |t| t.as_ptr().cast_const())
}
fn opt_mut(t: Option<&mut dyn AsTensor>) -> *mut sys::fp8_tensor_t {
    t.map_or(ptr::null_mut(), |t| t.as_ptr())
}
fn opt_scaling(s: Option<&Scaling<'_>>) -> *mut sys::fp8_scaling_t {
    s.map_or(ptr::null_mut(), |s| s.as_ptr())
}

/// The tensor operations (asynchronous on a CUDA context: they queue work on its stream).
impl Context {
    /// Quantises `input` into FP8 `out` with `scaling`'s scale, accumulating its amax; also the
    /// transposed codes when `out_transposed` is given.
    pub fn quantize<I: AsTensor + ?Sized, O: AsTensor + ?Sized>(
        &self,
        input: &I,
        out: &mut O,
        out_transposed: Option<&mut dyn AsTensor>,
        scaling: &Scaling<'_>,
    ) -> Result<()> {
        check(unsafe {
            sys::fp8_quantize(self.as_ptr(), input.as_ptr(), out.as_ptr(), opt_mut(out_transposed), scaling.as_ptr())
        })
    }

    /// Dequantises FP8 `input` into `out` (F32, F16 or BF16).
    pub fn dequantize<I: AsTensor + ?Sized, O: AsTensor + ?Sized>(&self, input: &I, out: &mut O) -> Result<()> {
        check(unsafe { sys::fp8_dequantize(self.as_ptr(), input.as_ptr(), out.as_ptr()) })
    }

    /// amax(input) into a one-element F32 tensor, also accumulated into `scaling` if given.
    pub fn amax<I: AsTensor + ?Sized, O: AsTensor + ?Sized>(
        &self,
        input: &I,
        amax: &mut O,
        scaling: Option<&Scaling<'_>>,
    ) -> Result<()> {
        check(unsafe { sys::fp8_amax(self.as_ptr(), input.as_ptr(), amax.as_ptr(), opt_scaling(scaling)) })
    }

    /// Updates `states` with the recipe's margin, interval and algorithm (one launch).
    pub fn scaling_update(&self, states: &[&Scaling<'_>], recipe: &Recipe) -> Result<()> {
        let raw: Vec<*mut sys::fp8_scaling_t> = states.iter().map(|s| s.as_ptr()).collect();
        let count =
            i32::try_from(raw.len()).map_err(|_| Error::new(Status::InvalidArgument, "too many scaling states"))?;
        check(unsafe { sys::fp8_scaling_update(self.as_ptr(), raw.as_ptr(), count, recipe.as_ptr()) })
    }

    /// D = alpha * A * B^T (+ bias) (+ D), fp8.h's GEMM; `d_scaling` for an FP8 D only.
    pub fn gemm<A: AsTensor + ?Sized, B: AsTensor + ?Sized, D: AsTensor + ?Sized>(
        &self,
        a: &A,
        b: &B,
        bias: Option<&dyn AsTensor>,
        d: &mut D,
        d_scaling: Option<&Scaling<'_>>,
        options: Option<&GemmOptions>,
    ) -> Result<()> {
        let o = options.map(|o| {
            let mut raw = sys::fp8_gemm_options_t::default();
            unsafe { sys::fp8_gemm_options_init(&mut raw) };
            raw.alpha = o.alpha;
            raw.accumulate = o.accumulate as i32;
            raw.fast_accumulation = o.fast_accumulation as i32;
            raw
        });
        check(unsafe {
            sys::fp8_gemm(
                self.as_ptr(),
                a.as_ptr(),
                b.as_ptr(),
                opt(bias),
                d.as_ptr(),
                opt_scaling(d_scaling),
                o.as_ref().map_or(ptr::null(), |o| o as *const _),
            )
        })
    }

    /// y = act(x); an FP8 y needs `y_scaling`.
    pub fn activation_forward<X: AsTensor + ?Sized, Y: AsTensor + ?Sized>(
        &self,
        activation: crate::model::Activation,
        x: &X,
        y: &mut Y,
        y_scaling: Option<&Scaling<'_>>,
    ) -> Result<()> {
        check(unsafe {
            sys::fp8_activation_forward(
                self.as_ptr(),
                activation as i32,
                x.as_ptr(),
                y.as_ptr(),
                opt_scaling(y_scaling),
            )
        })
    }

    /// dx = dy * act'(x); an FP8 dx needs `dx_scaling`.
    pub fn activation_backward<X: AsTensor + ?Sized, DY: AsTensor + ?Sized, DX: AsTensor + ?Sized>(
        &self,
        activation: crate::model::Activation,
        x: &X,
        dy: &DY,
        dx: &mut DX,
        dx_scaling: Option<&Scaling<'_>>,
    ) -> Result<()> {
        check(unsafe {
            sys::fp8_activation_backward(
                self.as_ptr(),
                activation as i32,
                x.as_ptr(),
                dy.as_ptr(),
                dx.as_ptr(),
                opt_scaling(dx_scaling),
            )
        })
    }

    /// LayerNorm or RMSNorm over the last dimension; `mean` (LayerNorm) and `rstd` are saved for
    /// the backward (None when no backward follows).
    #[allow(clippy::too_many_arguments)]
    pub fn norm_forward<X: AsTensor + ?Sized, G: AsTensor + ?Sized, Y: AsTensor + ?Sized>(
        &self,
        kind: Norm,
        x: &X,
        gamma: &G,
        beta: Option<&dyn AsTensor>,
        eps: f32,
        y: &mut Y,
        y_scaling: Option<&Scaling<'_>>,
        mean: Option<&mut dyn AsTensor>,
        rstd: Option<&mut dyn AsTensor>,
    ) -> Result<()> {
        check(unsafe {
            sys::fp8_norm_forward(
                self.as_ptr(),
                kind as i32,
                x.as_ptr(),
                gamma.as_ptr(),
                opt(beta),
                eps,
                y.as_ptr(),
                opt_scaling(y_scaling),
                opt_mut(mean),
                opt_mut(rstd),
            )
        })
    }

    /// The norm's backward: dx, dgamma and (LayerNorm with a shift) dbeta.
    #[allow(clippy::too_many_arguments)]
    pub fn norm_backward<X, G, R, DY, DX, DG>(
        &self,
        kind: Norm,
        x: &X,
        gamma: &G,
        mean: Option<&dyn AsTensor>,
        rstd: &R,
        dy: &DY,
        dx: &mut DX,
        dgamma: &mut DG,
        dbeta: Option<&mut dyn AsTensor>,
    ) -> Result<()>
    where
        X: AsTensor + ?Sized,
        G: AsTensor + ?Sized,
        R: AsTensor + ?Sized,
        DY: AsTensor + ?Sized,
        DX: AsTensor + ?Sized,
        DG: AsTensor + ?Sized,
    {
        check(unsafe {
            sys::fp8_norm_backward(
                self.as_ptr(),
                kind as i32,
                x.as_ptr(),
                gamma.as_ptr(),
                opt(mean),
                rstd.as_ptr(),
                dy.as_ptr(),
                dx.as_ptr(),
                dgamma.as_ptr(),
                opt_mut(dbeta),
            )
        })
    }
}
