//! Recipes: how FP8 training is done (fp8.h, "Recipe").

use crate::error::{c_path, c_string, check, created, read_text, static_str, Error, Result, Status};
use crate::tensor::DType;
use fp8_sys as sys;
use std::ptr::{self, NonNull};

/// Recipe attributes (`FP8_RECIPE_*`); each has a range and a default (`Recipe::bounds`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum RecipeAttr {
    /// `fp8_sys::FP8_BACKEND_*`.
    Backend = sys::FP8_RECIPE_BACKEND,
    /// `fp8_sys::FP8_OPT_O1..O3`.
    OptLevel = sys::FP8_RECIPE_OPT_LEVEL,
    Margin = sys::FP8_RECIPE_MARGIN,
    Interval = sys::FP8_RECIPE_INTERVAL,
    /// `fp8_sys::FP8_FORMAT_*`.
    Fp8Format = sys::FP8_RECIPE_FP8_FORMAT,
    AmaxHistoryLen = sys::FP8_RECIPE_AMAX_HISTORY_LEN,
    /// `fp8_sys::FP8_AMAX_ALGO_*`.
    AmaxComputeAlgo = sys::FP8_RECIPE_AMAX_COMPUTE_ALGO,
    OverrideFprop = sys::FP8_RECIPE_OVERRIDE_FPROP,
    OverrideDgrad = sys::FP8_RECIPE_OVERRIDE_DGRAD,
    OverrideWgrad = sys::FP8_RECIPE_OVERRIDE_WGRAD,
    UseAutocastDuringEval = sys::FP8_RECIPE_USE_AUTOCAST_DURING_EVAL,
    SmallLayerFallback = sys::FP8_RECIPE_SMALL_LAYER_FALLBACK,
    PowerOf2Scales = sys::FP8_RECIPE_POWER_2_SCALES,
    /// `fp8_sys::FP8_SCALING_*`.
    Scaling = sys::FP8_RECIPE_SCALING,
}

impl RecipeAttr {
    /// Every attribute, in the order of the ids.
    pub const ALL: [RecipeAttr; sys::FP8_RECIPE_ATTR_COUNT as usize] = [
        RecipeAttr::Backend,
        RecipeAttr::OptLevel,
        RecipeAttr::Margin,
        RecipeAttr::Interval,
        RecipeAttr::Fp8Format,
        RecipeAttr::AmaxHistoryLen,
        RecipeAttr::AmaxComputeAlgo,
        RecipeAttr::OverrideFprop,
        RecipeAttr::OverrideDgrad,
        RecipeAttr::OverrideWgrad,
        RecipeAttr::UseAutocastDuringEval,
        RecipeAttr::SmallLayerFallback,
        RecipeAttr::PowerOf2Scales,
        RecipeAttr::Scaling,
    ];

    pub fn raw(self) -> sys::fp8_recipe_attr_t {
        self as i32
    }

    /// The attribute's range, default and text-form key (`fp8_recipe_attr_bounds`).
    pub fn bounds(self) -> Result<AttrBounds> {
        let (mut min, mut max, mut default) = (0i64, 0i64, 0i64);
        let mut key = ptr::null();
        check(unsafe { sys::fp8_recipe_attr_bounds(self.raw(), &mut min, &mut max, &mut default, &mut key) })?;
        Ok(AttrBounds { min, max, default, key: unsafe { static_str(key) } })
    }
}

/// An attribute's range (inclusive), default and key in the text form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttrBounds {
    pub min: i64,
    pub max: i64,
    pub default: i64,
    pub key: &'static str,
}

/// A tensor role, for the FP8 dtype a recipe gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Role {
    /// Activations and weights: E4M3.
    Forward = sys::FP8_ROLE_FORWARD,
    /// Gradients: E5M2 under HYBRID, E4M3 under E4M3.
    Backward = sys::FP8_ROLE_BACKWARD,
}

/// A recipe: Accelerate's FP8RecipeKwargs, TransformerEngine's DelayedScaling and MS-AMP's opt
/// levels in one object. `fp8_convert_model` copies it: changing it later never affects a model
/// already converted.
pub struct Recipe {
    raw: NonNull<sys::fp8_recipe_t>,
}

// SAFETY: a recipe is made from no context and nothing keeps a pointer to it (conversion and
// scaling states copy what they need; fp8_scaling_update reads it during the call only), so it
// may move to another thread. fp8.h makes every object externally synchronised, so it is not
// Sync: `&Recipe` is not shared between threads.
unsafe impl Send for Recipe {}

impl Recipe {
    /// Accelerate's defaults (fp8.h lists each attribute's).
    pub fn new() -> Result<Recipe> {
        let mut raw = ptr::null_mut();
        check(unsafe { sys::fp8_recipe_create(&mut raw) })?;
        Ok(Recipe { raw: created(raw, "fp8_recipe_create")? })
    }

    /// The defaults with `text` applied ("fp8_format=E4M3, margin=1").
    pub fn from_text(text: &str) -> Result<Recipe> {
        let mut r = Recipe::new()?;
        r.parse(text)?;
        Ok(r)
    }

    /// The recipe a checkpoint's model was converted with (`fp8_checkpoint_read_recipe`).
    pub fn from_checkpoint(path: impl AsRef<std::path::Path>) -> Result<Recipe> {
        let r = Recipe::new()?;
        let path = c_path(path.as_ref())?;
        check(unsafe { sys::fp8_checkpoint_read_recipe(path.as_ptr(), r.raw.as_ptr()) })?;
        Ok(r)
    }

    /// An independent copy (`fp8_recipe_clone`).
    pub fn try_clone(&self) -> Result<Recipe> {
        let mut raw = ptr::null_mut();
        check(unsafe { sys::fp8_recipe_clone(&mut raw, self.raw.as_ptr()) })?;
        Ok(Recipe { raw: created(raw, "fp8_recipe_clone")? })
    }

    /// Applies comma-separated `key=value` pairs; all or nothing.
    pub fn parse(&mut self, text: &str) -> Result<()> {
        let text = c_string(text, "recipe text")?;
        check(unsafe { sys::fp8_recipe_parse(self.raw.as_ptr(), text.as_ptr()) })
    }

    /// The full text form, every attribute (`fp8_recipe_to_string`); parsing it gives back an
    /// equal recipe.
    pub fn to_text(&self) -> Result<String> {
        read_text(|buf, cap, needed| unsafe { sys::fp8_recipe_to_string(self.raw.as_ptr(), buf, cap, needed) })
    }

    pub fn get(&self, attr: RecipeAttr) -> Result<i64> {
        let mut v = 0;
        check(unsafe { sys::fp8_recipe_get_int(self.raw.as_ptr(), attr.raw(), &mut v) })?;
        Ok(v)
    }

    /// Sets one attribute; a value out of range is refused and the recipe left unchanged.
    pub fn set(&mut self, attr: RecipeAttr, value: i64) -> Result<()> {
        check(unsafe { sys::fp8_recipe_set_int(self.raw.as_ptr(), attr.raw(), value) })
    }

    /// The FP8 dtype the recipe's format gives a role.
    pub fn dtype_for(&self, role: Role) -> Result<DType> {
        let mut d = 0;
        check(unsafe { sys::fp8_recipe_dtype_for(self.raw.as_ptr(), role as i32, &mut d) })?;
        DType::from_raw(d).ok_or_else(|| Error::new(Status::Internal, format!("unknown dtype {d}")))
    }

    pub fn as_ptr(&self) -> *mut sys::fp8_recipe_t {
        self.raw.as_ptr()
    }
}

impl Drop for Recipe {
    fn drop(&mut self) {
        unsafe { sys::fp8_recipe_destroy(self.raw.as_ptr()) }
    }
}

impl Clone for Recipe {
    /// Panics only if libfp8 cannot allocate the copy (use `try_clone` to handle that).
    fn clone(&self) -> Recipe {
        self.try_clone().expect("fp8_recipe_clone")
    }
}

impl std::fmt::Display for Recipe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_text().map_err(|_| std::fmt::Error)?)
    }
}

impl std::fmt::Debug for Recipe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Recipe({:?})", self.to_text().unwrap_or_default())
    }
}

impl std::str::FromStr for Recipe {
    type Err = Error;
    fn from_str(text: &str) -> Result<Recipe> {
        Recipe::from_text(text)
    }
}
