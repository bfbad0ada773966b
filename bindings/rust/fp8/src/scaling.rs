//! Delayed-scaling states and the operations of fp8.h that work on tensors directly (casts, GEMM,
//! activations, norms), as methods of the context they run on.

use crate::context::Context;
use crate::error::{check, created, Error, Result, Status};
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
        Ok(Scaling { raw: created(raw, "fp8_scaling_create")?, _ctx: PhantomData })
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

/// How a grid of scales covers an FP8 operand viewed as a matrix [rows, cols] (cols: its last
/// dimension, the K of the GEMM that reads it), for `Context::quantize_scaled` and
/// `Context::gemm_scaled` (`FP8_SCALE_MODE_*`; fp8.h, "Scale grids").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum ScaleMode {
    /// One scale per row (torchao's rowwise; recipe `scaling=rowwise`).
    Row = sys::FP8_SCALE_MODE_ROW,
    /// One scale per 128 consecutive elements of a row, the last block maybe shorter
    /// (activations and gradients under recipe `scaling=block`).
    Block1x128 = sys::FP8_SCALE_MODE_BLOCK_1X128,
    /// One scale per 128 x 128 block, shorter at the edges (weights under `scaling=block`).
    Block128x128 = sys::FP8_SCALE_MODE_BLOCK_128X128,
}

impl ScaleMode {
    /// The 2-D shape of the F32 grid of scales of an operand of [rows, cols] in this mode
    /// (`fp8_scale_grid_shape`): [rows, 1], [ceil(cols/128), rows], or [ceil(rows/128),
    /// ceil(cols/128) rounded up to a multiple of 4]. `Status::Shape` for negative sizes or more
    /// than 2^62 elements. Thread safe.
    pub fn grid_shape(self, rows: i64, cols: i64) -> Result<[i64; 2]> {
        let mut shape = [0i64; 2];
        check(unsafe { sys::fp8_scale_grid_shape(self as i32, rows, cols, shape.as_mut_ptr()) })?;
        Ok(shape)
    }
}

/// Norm kinds (`FP8_NORM_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Norm {
    LayerNorm = sys::FP8_NORM_LAYERNORM,
    RmsNorm = sys::FP8_NORM_RMSNORM,
}

/// libfp8's options with `o`'s values (None: NULL, the defaults).
fn raw_gemm_options(o: Option<&GemmOptions>) -> Option<sys::fp8_gemm_options_t> {
    o.map(|o| {
        let mut raw = sys::fp8_gemm_options_t::default();
        unsafe { sys::fp8_gemm_options_init(&mut raw) };
        raw.alpha = o.alpha;
        raw.accumulate = o.accumulate as i32;
        raw.fast_accumulation = o.fast_accumulation as i32;
        raw
    })
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
        let o = raw_gemm_options(options);
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

    /// Quantises `input` (F32, F16 or BF16, viewed as [rows, cols]) into `out` (E4M3 or E5M2, of
    /// input's shape) with a scale per cell of `mode` (`fp8_quantize_scaled`): each cell's scale is
    /// the current-scaling rule on the cell's amax, with `recipe`'s margin and power_2_scales
    /// (auto: on for the block modes); `out_scales` (F32 of `mode.grid_shape(rows, cols)`) receives
    /// 1/scale per cell, and `out`'s own scale_inv is left as it is. `transposed`: also the
    /// [cols, rows] copy and its grid (`mode.grid_shape(cols, rows)`), for a GEMM that reads the
    /// operand transposed. Outputs must not overlap `input` or each other.
    pub fn quantize_scaled<I, O, S>(
        &self,
        input: &I,
        mode: ScaleMode,
        recipe: &Recipe,
        out: &mut O,
        out_scales: &mut S,
        transposed: Option<(&mut dyn AsTensor, &mut dyn AsTensor)>,
    ) -> Result<()>
    where
        I: AsTensor + ?Sized,
        O: AsTensor + ?Sized,
        S: AsTensor + ?Sized,
    {
        let (t, t_scales) = transposed.map_or((ptr::null_mut(), ptr::null_mut()), |(t, s)| (t.as_ptr(), s.as_ptr()));
        check(unsafe {
            sys::fp8_quantize_scaled(
                self.as_ptr(),
                input.as_ptr(),
                mode as i32,
                recipe.as_ptr(),
                out.as_ptr(),
                out_scales.as_ptr(),
                t,
                t_scales,
            )
        })
    }

    /// D = alpha * A * B^T (+ bias) (+ D) with grids of scales (`fp8_gemm_scaled`): `a` `[m, k]`
    /// and `b` `[n, k]` FP8 with their grids as `quantize_scaled` makes them, `d` `[m, n]` F32 or
    /// BF16, `bias` BF16 `[n]`. Mode pairs: Row x Row, and the block modes except 128x128 x 128x128.
    /// The CPU backend takes any shape; a GPU needs `DeviceInfo::fp8_block_scaling`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_scaled<A, AS, B, BS, D>(
        &self,
        a: &A,
        a_mode: ScaleMode,
        a_scales: &AS,
        b: &B,
        b_mode: ScaleMode,
        b_scales: &BS,
        bias: Option<&dyn AsTensor>,
        d: &mut D,
        options: Option<&GemmOptions>,
    ) -> Result<()>
    where
        A: AsTensor + ?Sized,
        AS: AsTensor + ?Sized,
        B: AsTensor + ?Sized,
        BS: AsTensor + ?Sized,
        D: AsTensor + ?Sized,
    {
        let o = raw_gemm_options(options);
        check(unsafe {
            sys::fp8_gemm_scaled(
                self.as_ptr(),
                a.as_ptr(),
                a_mode as i32,
                a_scales.as_ptr(),
                b.as_ptr(),
                b_mode as i32,
                b_scales.as_ptr(),
                opt(bias),
                d.as_ptr(),
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
