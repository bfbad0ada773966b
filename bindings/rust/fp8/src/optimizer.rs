//! The optimizer: SGD, Adam and AdamW at every storage level (fp8.h, "Optimizer").

use crate::error::{check, created, Result};
use crate::model::Model;
use crate::tensor::AsTensor;
use fp8_sys as sys;
use std::marker::PhantomData;
use std::ptr::{self, NonNull};

/// Optimizer kinds (`FP8_OPTIMIZER_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum OptimizerKind {
    Sgd = sys::FP8_OPTIMIZER_SGD,
    Adam = sys::FP8_OPTIMIZER_ADAM,
    AdamW = sys::FP8_OPTIMIZER_ADAMW,
}

/// Hyper-parameters (`FP8_OPTIM_*`), doubles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum OptimAttr {
    /// Learning rate, >= 0; default 1e-3.
    Lr = sys::FP8_OPTIM_LR,
    Beta1 = sys::FP8_OPTIM_BETA1,
    Beta2 = sys::FP8_OPTIM_BETA2,
    Eps = sys::FP8_OPTIM_EPS,
    WeightDecay = sys::FP8_OPTIM_WEIGHT_DECAY,
    /// SGD only.
    Momentum = sys::FP8_OPTIM_MOMENTUM,
    /// Clip to this global L2 norm; 0 (default): no clipping.
    MaxGradNorm = sys::FP8_OPTIM_MAX_GRAD_NORM,
}

/// What the optimizer did (`fp8_optimizer_stats_t`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimizerStats {
    /// Steps applied (t).
    pub steps: i64,
    /// Steps skipped for a non-finite gradient.
    pub skipped_steps: i64,
    pub last_skipped: bool,
    /// ||g|| of the latest step, before clipping.
    pub last_grad_norm: f32,
    /// Scalar parameters updated.
    pub parameters: i64,
    /// Device bytes of optimizer state.
    pub state_bytes: i64,
    /// 0: te (FP32 states); 1..3: the MS-AMP level.
    pub opt_level: i32,
    /// Device bytes of weights, masters, gradients, m and v, as stored.
    pub training_bytes: i64,
}

/// An optimizer over every parameter the model has when it is made. It borrows the model (fp8.h:
/// destroy it before the model), so layers cannot be added while it exists.
pub struct Optimizer<'m> {
    raw: NonNull<sys::fp8_optimizer_t>,
    _model: PhantomData<&'m ()>,
}

impl<'m> Optimizer<'m> {
    /// Allocates the optimizer's states (zeroed) on the model's device. Synchronous.
    pub fn new(model: &'m Model<'_>, kind: OptimizerKind) -> Result<Optimizer<'m>> {
        let mut raw = ptr::null_mut();
        check(unsafe { sys::fp8_optimizer_create(&mut raw, model.as_ptr(), kind as i32) })?;
        Ok(Optimizer { raw: created(raw, "fp8_optimizer_create")?, _model: PhantomData })
    }

    /// Sets a hyper-parameter (the next step uses it). Synchronous.
    pub fn set(&mut self, attr: OptimAttr, value: f64) -> Result<()> {
        check(unsafe { sys::fp8_optimizer_set_float(self.raw.as_ptr(), attr as i32, value) })
    }

    /// `set`, for chaining at creation: `Optimizer::new(&m, AdamW)?.with(Lr, 1e-3)?`.
    pub fn with(mut self, attr: OptimAttr, value: f64) -> Result<Self> {
        self.set(attr, value)?;
        Ok(self)
    }

    pub fn get(&self, attr: OptimAttr) -> Result<f64> {
        let mut v = 0.0;
        check(unsafe { sys::fp8_optimizer_get_float(self.raw.as_ptr(), attr as i32, &mut v) })?;
        Ok(v)
    }

    /// One update of every parameter from its gradient. Gradients are left as they are.
    pub fn step(&mut self) -> Result<()> {
        check(unsafe { sys::fp8_optimizer_step(self.raw.as_ptr()) })
    }

    /// One update under one gradient clip over the model's gradients and others it does not hold
    /// (`fp8_optimizer_step_joint`): `other_sumsq`, an F32 tensor of one element, holds their sum
    /// of squares; `clip_coef` (an F32 tensor of one element) receives the clip factor for them,
    /// NaN when the step is skipped.
    pub fn step_joint(&mut self, other_sumsq: &dyn AsTensor, clip_coef: Option<&mut dyn AsTensor>) -> Result<()> {
        let coef = clip_coef.map_or(ptr::null_mut(), |t| t.as_ptr());
        check(unsafe { sys::fp8_optimizer_step_joint(self.raw.as_ptr(), other_sumsq.as_ptr(), coef) })
    }

    /// Sets every gradient of the model to zero.
    pub fn zero_grad(&mut self) -> Result<()> {
        check(unsafe { sys::fp8_optimizer_zero_grad(self.raw.as_ptr()) })
    }

    /// Waits for the steps queued so far and reports.
    pub fn stats(&self) -> Result<OptimizerStats> {
        let mut s = sys::fp8_optimizer_stats_t::default();
        unsafe { sys::fp8_optimizer_stats_init(&mut s) };
        check(unsafe { sys::fp8_optimizer_get_stats(self.raw.as_ptr(), &mut s) })?;
        Ok(OptimizerStats {
            steps: s.steps,
            skipped_steps: s.skipped_steps,
            last_skipped: s.last_skipped != 0,
            last_grad_norm: s.last_grad_norm,
            parameters: s.parameters,
            state_bytes: s.state_bytes,
            opt_level: s.opt_level,
            training_bytes: s.training_bytes,
        })
    }

    pub fn as_ptr(&self) -> *mut sys::fp8_optimizer_t {
        self.raw.as_ptr()
    }
}

impl Drop for Optimizer<'_> {
    fn drop(&mut self) {
        unsafe { sys::fp8_optimizer_destroy(self.raw.as_ptr()) }
    }
}
