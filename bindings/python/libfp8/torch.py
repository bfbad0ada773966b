"""libfp8 for PyTorch: FP8 Linear, LayerNorm and RMSNorm modules over libfp8's C ABI, in the shape
of Hugging Face Accelerate's FP8 utilities.

    import libfp8.torch as lt
    recipe = lt.Recipe(backend="te")                  # every FP8RecipeKwargs field; defaults as Accelerate
    report = lt.convert_model(model, recipe=recipe)   # nn.Linear / nn.LayerNorm / nn.RMSNorm swapped in place
    print(report)                                     # what was converted, what was skipped and why
    lt.apply_fp8_autowrap(model, recipe)              # forward runs under fp8_autocast while training
    opt = lt.Optimizer(model, "adamw", lr=3e-4, max_grad_norm=1.0)   # te, O1 or O2; other params too
    loss = model(x).loss; loss.backward(); opt.step(); opt.zero_grad()

The converted modules' parameters ARE torch Parameters over libfp8's own storage (lent through
DLPack): state_dict and load_state_dict keep torch's names, and writes from torch (an optimizer's
step, load_state_dict, copy_) are noticed through the tensors' version counters. At the te level
(recipe backend="te") weights and gradients are FP32 and each Parameter's .grad is libfp8's gradient
memory, so torch optimizers and clip_grad_norm_ work on them. At MS-AMP levels (O1, O2) a Linear's
weight is stored in F16 and its gradient in FP8: the weight is a Parameter that does not require
grad, and libfp8.torch.Optimizer trains it (O3 is not offered here). load_safetensors(model, path)
loads a Hugging Face-style file of the whole model, libfp8's layers read by libfp8 itself.

FP8 runs where libfp8 says (fp8.h, "Models and layers"): in a converted layer, inside fp8_autocast
(or a forward wrapped by contextual_fp8_autocast / apply_fp8_autowrap), in training mode unless the
recipe's use_autocast_during_eval. Elsewhere the same modules compute in high precision.

An nn.Sequential whose children all convert (Linear, LayerNorm, RMSNorm, GELU(tanh), ReLU) becomes a
libfp8 Sequential, run as one stack (fp8_stack_forward_saved): its norms hand their outputs to the
Linears in E4M3 and its activations are folded into the Linears' casts. residual(module, x, r) is
r + module(x) with the sum made by the last GEMM of a libfp8 stack or Linear (fp8_stack_forward_residual).

Each layer call is a torch.autograd.Function over fp8_layer_forward_saved / fp8_layer_backward_saved,
so a module may be used several times in a step, recomputed by torch.utils.checkpoint, and
accumulate gradients over micro-batches. On CUDA the work goes on torch.cuda.current_stream() with
no host synchronisation, and libfp8's device memory comes from torch's caching allocator.

Threads: all libfp8 models of a torch device share one libfp8 context, whose objects libfp8 lets
one thread use at a time; libfp8.torch holds a lock per device around each call into it, so modules
may be called from several threads (they run one at a time on that device), each thread under its
own fp8_autocast. Frozen parameters (requires_grad=False) stay frozen through convert_model;
libfp8.torch.Optimizer refuses them (libfp8's optimizer updates every parameter of its model).
Resume training with torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}) and
the matching load_state_dict calls: the optimizer's state holds libfp8's checkpoint (scaling states
and amax histories, m and v in their stored types). Converted modules cannot be deep-copied.
"""
import collections
import contextlib
import ctypes
import json
import math
import os
import struct
import tempfile
import threading
import types
import weakref

import torch
import torch.utils.checkpoint
import torch.utils.dlpack

import libfp8 as _f
from libfp8 import _check, _i32, _i64, _lib, _p

__all__ = ["Recipe", "convert_model", "ConversionReport", "has_fp8_layers", "fp8_autocast", "checkpoint",
           "contextual_fp8_autocast", "apply_fp8_autowrap", "Optimizer", "Linear", "LayerNorm", "RMSNorm",
           "Sequential", "Activation", "residual", "load_safetensors",
           "report", "to_torch", "from_torch"]

_TORCH_DTYPES = {torch.float32: _f.DTYPE_F32, torch.float16: _f.DTYPE_F16, torch.bfloat16: _f.DTYPE_BF16}

# ------------------------------------------------------------------------------------------------
# Recipe
# ------------------------------------------------------------------------------------------------

_CHOICES = {
    "backend": {"auto": "auto", "te": "te", "msamp": "msamp", None: "auto"},
    "opt_level": {"O1": "O1", "O2": "O2", "O3": "O3"},
    "fp8_format": {"E4M3": "E4M3", "HYBRID": "HYBRID"},
    "amax_compute_algo": {"max": "max", "most_recent": "most_recent"},
    "scaling": {"delayed": "delayed", "current": "current", "rowwise": "rowwise", "block": "block"},
}
_RANGES = {"margin": (0, 32), "interval": (1, 1000000), "amax_history_len": (1, 16384)}


class Recipe:
    """How FP8 training is done: every field of Accelerate's FP8RecipeKwargs, with its defaults
    (backend "auto" prefers MS-AMP, as Accelerate documents), plus libfp8's small_layer_fallback,
    power_2_scales (True, False or "auto": on for block scaling) and scaling ("delayed",
    Accelerate's and TransformerEngine's DelayedScaling; "current": each cast scaled by the amax of
    the tensor it casts; "rowwise": one scale per row along K; "block": 1x128 blocks of activations
    and gradients, 128x128 blocks of weights).

    Immutable once made (copies are the recipe itself; pickling keeps the fields); equal recipes
    compare equal. A bad value raises ValueError (TypeError for a wrong type) naming the field and
    what it accepts."""

    __slots__ = ("backend", "opt_level", "margin", "interval", "fp8_format", "amax_history_len",
                 "amax_compute_algo", "override_linear_precision", "use_autocast_during_eval",
                 "small_layer_fallback", "power_2_scales", "scaling", "_c")

    def __init__(self, backend="auto", opt_level="O2", margin=0, interval=1, fp8_format="HYBRID",
                 amax_history_len=1024, amax_compute_algo="most_recent",
                 override_linear_precision=(False, False, False), use_autocast_during_eval=False,
                 small_layer_fallback=True, power_2_scales="auto", scaling="delayed"):
        def choice(field, value):
            lower = ("backend", "amax_compute_algo", "scaling")
            key = value.lower() if isinstance(value, str) and field in lower else value
            key = key.upper() if isinstance(key, str) and field in ("opt_level", "fp8_format") else key
            if key not in _CHOICES[field]:
                allowed = ", ".join(repr(k) for k in _CHOICES[field])
                raise ValueError(f"Recipe: {field}={value!r}; expected one of {allowed}")
            return _CHOICES[field][key]

        def integer(field, value):
            lo, hi = _RANGES[field]
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Recipe: {field}={value!r}; expected an int in {lo}..{hi}")
            if not lo <= value <= hi:
                raise ValueError(f"Recipe: {field}={value}; expected an int in {lo}..{hi}")
            return value

        def flag(field, value):
            if not isinstance(value, (bool, int)) or value not in (0, 1):
                raise TypeError(f"Recipe: {field}={value!r}; expected True or False")
            return bool(value)

        s = object.__setattr__
        s(self, "backend", choice("backend", backend))
        s(self, "opt_level", choice("opt_level", opt_level))
        s(self, "margin", integer("margin", margin))
        s(self, "interval", integer("interval", interval))
        s(self, "fp8_format", choice("fp8_format", fp8_format))
        s(self, "amax_history_len", integer("amax_history_len", amax_history_len))
        s(self, "amax_compute_algo", choice("amax_compute_algo", amax_compute_algo))
        olp = override_linear_precision
        if not isinstance(olp, (tuple, list)) or len(olp) != 3:
            raise TypeError(f"Recipe: override_linear_precision={olp!r}; expected three bools (fprop, dgrad, wgrad)")
        s(self, "override_linear_precision", tuple(flag("override_linear_precision", v) for v in olp))
        s(self, "use_autocast_during_eval", flag("use_autocast_during_eval", use_autocast_during_eval))
        s(self, "small_layer_fallback", flag("small_layer_fallback", small_layer_fallback))
        auto = isinstance(power_2_scales, str) and power_2_scales.lower() == "auto"
        s(self, "power_2_scales", "auto" if auto else flag("power_2_scales", power_2_scales))
        s(self, "scaling", choice("scaling", scaling))
        c = _f.Recipe(self.text())  # libfp8 checks it again
        s(self, "_c", c)

    @classmethod
    def from_kwargs(cls, kwargs):
        """From an Accelerate FP8RecipeKwargs (or any object or dict with its fields)."""
        fields = [f for f in cls.__slots__ if not f.startswith("_")]
        if isinstance(kwargs, dict):
            return cls(**{k: v for k, v in kwargs.items() if k in fields})
        return cls(**{k: getattr(kwargs, k) for k in fields if hasattr(kwargs, k)})

    def __setattr__(self, name, value):
        raise AttributeError("Recipe is immutable: make a new one")

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (_recipe_from_fields, ({f: getattr(self, f) for f in self.__slots__ if not f.startswith("_")},))

    @property
    def level(self):
        """The storage and optimizer level this recipe gives: "te", "O1", "O2" or "O3"."""
        return "te" if self.backend == "te" else self.opt_level

    def text(self):
        on = lambda v: "on" if v else "off"  # noqa: E731
        f, d, w = self.override_linear_precision
        return (f"backend={self.backend}, opt_level={self.opt_level}, margin={self.margin}, "
                f"interval={self.interval}, fp8_format={self.fp8_format}, "
                f"amax_history_len={self.amax_history_len}, amax_compute_algo={self.amax_compute_algo}, "
                f"override_linear_precision={on(f)}/{on(d)}/{on(w)}, "
                f"use_autocast_during_eval={on(self.use_autocast_during_eval)}, "
                f"small_layer_fallback={on(self.small_layer_fallback)}, "
                f"power_2_scales={'auto' if self.power_2_scales == 'auto' else on(self.power_2_scales)}, "
                f"scaling={self.scaling}")

    def __eq__(self, other):
        return isinstance(other, Recipe) and str(self._c) == str(other._c)

    def __hash__(self):
        return hash(str(self._c))

    def __repr__(self):
        return f"Recipe({self.text()})"


def _recipe_from_fields(fields):
    return Recipe(**fields)


def _recipe_arg(recipe, what):
    if recipe is None:
        return Recipe()
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, dict) or hasattr(recipe, "fp8_format"):
        return Recipe.from_kwargs(recipe)
    raise TypeError(f"{what}: recipe={recipe!r}; expected a libfp8.torch.Recipe, an FP8RecipeKwargs or a dict")


# ------------------------------------------------------------------------------------------------
# Devices: one libfp8 context per torch device, on torch's current stream and allocator
# ------------------------------------------------------------------------------------------------

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype, _capsule_new.argtypes = ctypes.py_object, [_p, _p, _p]
_capsule_get = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get.restype, _capsule_get.argtypes = _p, [ctypes.py_object, ctypes.c_char_p]
_capsule_set_name = ctypes.pythonapi.PyCapsule_SetName
_capsule_set_name.restype, _capsule_set_name.argtypes = ctypes.c_int, [ctypes.py_object, _p]
# Capsule names must outlive their capsules: static buffers.
_DLTENSOR = ctypes.create_string_buffer(b"dltensor")
_USED_DLTENSOR = ctypes.create_string_buffer(b"used_dltensor")

_WRAP_CACHE_LIMIT = 4096


class _Device:
    """A libfp8 context for one torch device, with a cache of borrowed tensor handles.

    Handles from fp8_tensor_wrap only name memory (pointer, dtype, shape): libfp8 keeps no handle
    past a call (a saved forward keeps x's pointer, and autograd keeps x alive), so a handle can be
    reused for whatever tensor torch places at that address with that dtype and shape, and the
    caching allocator gives the same addresses step after step. That takes the wrap (and on CUDA
    its pointer check) out of the per-call cost.

    Every operation on the context (a layer call, a backward, an optimizer step) runs inside
    `with device:`, which holds its lock: libfp8's objects are externally synchronised (one thread at
    a time per context and everything made from it, fp8.h), while torch lets several threads call
    modules (a server's threads, one model per thread), and all the models of a torch device share
    this context. The outermost entry also tidies up, where no handle taken from the cache can be on
    its way into a call: it empties a full cache, and destroys the saved states let go meanwhile
    (_Saved.__del__ runs wherever the garbage collector does)."""

    def __init__(self, device):
        self.device = device
        self.index = -1 if device.type == "cpu" else (device.index if device.index is not None
                                                      else torch.cuda.current_device())
        self.ctx = _f.Context(self.index)
        self.cuda = device.type == "cuda"
        self.stream = 0
        self._wraps = {}
        self.lock = threading.RLock()
        self._depth = 0  # nested entries of the thread holding the lock
        self._dead = []  # fp8_saved_t handles to destroy at the next entry
        if self.cuda:
            self._set_torch_allocator()

    def _set_torch_allocator(self):
        index = self.index

        def alloc(_user, nbytes, _device, stream):
            try:
                return torch.cuda.caching_allocator_alloc(max(int(nbytes), 1), index, stream or 0)
            except Exception:  # noqa: BLE001 - no exception may cross into C: NULL is "out of memory"
                return None

        def free(_user, ptr, _device, _stream):
            try:
                torch.cuda.caching_allocator_delete(ptr)
            except Exception:  # noqa: BLE001
                pass

        self._alloc, self._free = _f.ALLOC_FN(alloc), _f.FREE_FN(free)
        self.ctx.set_allocator(self._alloc, self._free)

    def follow_stream(self):
        """Queues libfp8's work on torch's current stream (fp8_context_set_stream orders it after
        what libfp8 queued before, on the device)."""
        if self.cuda:
            s = torch.cuda.current_stream(self.index).cuda_stream
            if s != self.stream:
                self.ctx.set_stream(s)
                self.stream = s

    def __enter__(self):
        self.lock.acquire()
        self._depth += 1
        if self._depth == 1 and (self._dead or len(self._wraps) >= _WRAP_CACHE_LIMIT):
            while self._dead:
                _lib.fp8_saved_destroy(self._dead.pop())
            if len(self._wraps) >= _WRAP_CACHE_LIMIT:
                self.clear()
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        self.lock.release()

    def destroy_saved(self, handle):
        """fp8_saved_destroy now where no call of this context is under way (this thread holds no
        entry, and no other thread does), else at the next entry."""
        if self.lock.acquire(blocking=False):
            try:
                if self._depth == 0:
                    _lib.fp8_saved_destroy(handle)
                    return
            finally:
                self.lock.release()
        self._dead.append(handle)

    def wrap(self, t):
        """A borrowed handle over contiguous tensor t (f32, f16, bf16; uint8 taken as E4M3), valid
        until the outermost `with self:` is entered again (the cache is emptied only there)."""
        key = (t.data_ptr(), t.dtype, t.shape)
        h = self._wraps.get(key)
        if h is None:
            dtype = _f.DTYPE_E4M3 if t.dtype == torch.uint8 else _TORCH_DTYPES[t.dtype]
            shape = (_i64 * max(t.dim(), 1))(*t.shape)
            h = _p()
            _check(_lib.fp8_tensor_wrap(ctypes.byref(h), self.ctx.handle, dtype, t.dim(), shape, key[0] or None))
            self._wraps[key] = h
        return h

    def clear(self):
        wraps, self._wraps = self._wraps, {}
        for h in wraps.values():
            _lib.fp8_tensor_destroy(h)

    def __del__(self):
        try:
            self.clear()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


_devices = {}
_devices_lock = threading.Lock()


def _device_for(device):
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    d = _devices.get(device)
    if d is None:
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"libfp8.torch: device {device}; expected cpu (libfp8's reference backend) or cuda")
        with _devices_lock:
            d = _devices.get(device)
            if d is None:
                d = _devices[device] = _Device(device)
    return d


def to_torch(tensor):
    """A torch tensor sharing a libfp8 tensor's memory (fp8_tensor_to_dlpack; FP8 as uint8 codes).
    `tensor` is a libfp8.Tensor (a model's Parameter too) or an fp8_tensor_t handle (ctypes
    c_void_p). The memory stays alive as long as the torch tensor, even past the libfp8 tensor or
    its model."""
    if isinstance(tensor, _f.Tensor):
        handle = tensor.handle
    elif isinstance(tensor, ctypes.c_void_p) and tensor.value:
        handle = tensor
    else:
        raise TypeError(f"to_torch: tensor is {type(tensor).__name__}; expected a libfp8.Tensor or a non-NULL "
                        "fp8_tensor_t handle (ctypes.c_void_p)")
    managed = _p()
    _check(_lib.fp8_tensor_to_dlpack(handle, ctypes.byref(managed)))
    return torch.utils.dlpack.from_dlpack(_capsule_new(managed, ctypes.addressof(_DLTENSOR), None))


class BorrowedTensor(_f.Tensor):
    """A libfp8 tensor over a torch tensor's memory (fp8_tensor_from_dlpack): the torch memory stays
    alive until this is destroyed."""

    def __init__(self, ctx, t):  # pylint: disable=super-init-not-called
        _f._Handle.__init__(self)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"from_torch: t is {type(t).__name__}; expected a torch.Tensor")
        ctx_handle = _f._arg(ctx, _f.Context, "from_torch: ctx")
        capsule = torch.utils.dlpack.to_dlpack(t.detach())
        managed = _capsule_get(capsule, _DLTENSOR.value)
        _check(_lib.fp8_tensor_from_dlpack(ctypes.byref(self.handle), ctx_handle, managed))
        _capsule_set_name(capsule, ctypes.addressof(_USED_DLTENSOR))  # libfp8 owns it now
        self.ctx, self.dtype, self.shape = ctx, _TORCH_DTYPES[t.dtype], tuple(t.shape)
        self.nbytes = t.numel() * t.element_size()


def from_torch(t, ctx=None):
    """Borrows torch tensor t as a libfp8 tensor (fp8_tensor_from_dlpack) on `ctx` (default: the
    context libfp8.torch keeps for t's device). Non-contiguous tensors, other dtypes and tensors of
    another device are refused by libfp8 with Fp8Error naming what it expected."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"from_torch: t is {type(t).__name__}; expected a torch.Tensor")
    if ctx is not None:
        return BorrowedTensor(ctx, t)
    dev = _device_for(t.device)
    with dev:
        return BorrowedTensor(dev.ctx, t)


# ------------------------------------------------------------------------------------------------
# Autocast regions (Python-side, per thread; each libfp8 model's region opens lazily)
# ------------------------------------------------------------------------------------------------

_local = threading.local()


class _Region:
    def __init__(self, enabled, recipe):
        self.enabled, self.recipe, self.opened = enabled, recipe, []


def _current_region():
    return getattr(_local, "region", None)


@contextlib.contextmanager
def fp8_autocast(enabled=True, recipe=None):
    """FP8 for the converted layers that run inside (Accelerate's / TransformerEngine's fp8_autocast).

    Each libfp8 model touched inside opens one region (fp8_autocast_begin) at its first layer call
    and closes it at the end of the block, which updates its scaling states in one batched launch
    (the backward's states too, at the next region's end). enabled=False runs the layers in high
    precision. `recipe`, if given, must equal the recipe the layers were converted with (libfp8
    fixes a model's recipe at conversion; convert again to change it). Regions nest; the innermost
    decides."""
    if not isinstance(enabled, bool):
        raise TypeError(f"fp8_autocast: enabled={enabled!r}; expected True or False")
    region = _Region(enabled, _recipe_arg(recipe, "fp8_autocast") if recipe is not None else None)
    outer = _current_region()
    if outer is not None and outer.enabled == enabled and region.recipe in (None, outer.recipe):
        yield  # the same FP8 state: the outer region goes on (scales update once, at its end)
        return
    _local.region = region
    try:
        yield
    finally:
        _local.region = outer
        for group in list(region.opened):
            group.close_region(region)


def checkpoint(function, *args, **kwargs):
    """torch.utils.checkpoint.checkpoint(function, *args, **kwargs) whose recompute (during the
    backward, outside the forward's fp8_autocast) runs in the FP8 state of the forward: the same
    layers in FP8 (with the scales of that moment, which the forward's region end may have moved
    since: the recompute then differs from the forward by FP8 rounding, not more)."""
    region = _current_region()
    enabled, recipe = (region.enabled, region.recipe) if region is not None else (False, None)

    def run(*a, **kw):
        with fp8_autocast(enabled=enabled, recipe=recipe):
            return function(*a, **kw)

    return torch.utils.checkpoint.checkpoint(run, *args, **kwargs)


def contextual_fp8_autocast(model_forward, recipe=None, use_during_eval=False):
    """Wraps a module's forward so that it runs under fp8_autocast while the module trains (and in
    eval too with use_during_eval). Returns a function of (self, *args, **kwargs), as Accelerate's."""
    if not callable(model_forward):
        raise TypeError(f"contextual_fp8_autocast: model_forward={model_forward!r}; expected a callable")
    recipe = _recipe_arg(recipe, "contextual_fp8_autocast") if recipe is not None else None

    def forward(self, *args, **kwargs):
        with fp8_autocast(enabled=bool(use_during_eval or self.training), recipe=recipe):
            return model_forward(*args, **kwargs)

    forward.__wrapped__ = model_forward
    return forward


def apply_fp8_autowrap(module, recipe=None):
    """Replaces module.forward by contextual_fp8_autocast(module.forward, recipe,
    recipe.use_autocast_during_eval) (Accelerate's apply_fp8_autowrap). Returns the module."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"apply_fp8_autowrap: module is {type(module).__name__}; expected a torch.nn.Module")
    recipe = _recipe_arg(recipe, "apply_fp8_autowrap")
    new_forward = contextual_fp8_autocast(module.forward, recipe, recipe.use_autocast_during_eval)
    module.forward = types.MethodType(new_forward, module)
    return module


# ------------------------------------------------------------------------------------------------
# A group: one libfp8 model holding the layers one convert_model call swapped in (per device)
# ------------------------------------------------------------------------------------------------


class _Saved:
    """Owns an fp8_saved_t (destroyed with autograd's ctx, differentiated or not: through its device,
    since the garbage collector may let it go on another thread, or inside a call of its model)."""
    __slots__ = ("handle", "dev")

    def __init__(self, dev):
        self.handle, self.dev = _p(), dev

    def __del__(self):
        handle, self.handle = self.handle, None
        if handle:
            self.dev.destroy_saved(handle)


class _Group:
    def __init__(self, device, recipe):
        self.dev = _device_for(device)
        self.model = _f.Model(self.dev.ctx)
        self.recipe = recipe
        self.modules = []  # in layer order
        self.training = True
        self.region = None  # the _Region that opened this model's libfp8 region
        self.level = None
        self.fp8_optimizer = None

    # Regions ------------------------------------------------------------------------------------
    def enter(self, training):
        """Before a layer call: training mode, the region, the stream."""
        self.dev.follow_stream()
        if training != self.training:
            _check(_lib.fp8_model_set_training(self.model.handle, int(training)))
            self.training = training
        region = _current_region()
        want = region is not None and region.enabled and self.recipe is not None
        if want and self.region is not region:
            if region.recipe is not None and region.recipe != self.recipe:
                raise ValueError(f"fp8_autocast: recipe {region.recipe.text()!r} differs from the one the layers "
                                 f"were converted with ({self.recipe.text()!r}); convert_model again to change it")
            if self.region is not None:
                self.close_region()
            _check(_lib.fp8_autocast_begin(self.model.handle))
            self.region = region
            region.opened.append(self)
        elif not want and self.region is not None:
            self.close_region()

    def close_region(self, region=None):
        """Ends the model's libfp8 region (updating the scales it recorded): the one open, or only
        `region`'s (another thread's region may have taken the model since)."""
        with self.dev:
            if self.region is None or (region is not None and self.region is not region):
                return
            region, self.region = self.region, None
            if self in region.opened:
                region.opened.remove(self)
            self.dev.follow_stream()
            _check(_lib.fp8_autocast_end(self.model.handle))

    # Weights written by torch -------------------------------------------------------------------
    def sync_versions(self):
        """Tells libfp8 once when any parameter was written from torch since the last look, and takes
        every module's versions at once (so that one write is one fp8_model_weights_changed, and a
        forward in flight is not invalidated by a later module's look)."""
        for m in self.modules:
            m._check_storage()
            m._seen = m._versions()
        _check(_lib.fp8_model_weights_changed(self.model.handle))


def _layer_forward(module, x, need_backward):
    """y = layer(x) through fp8_layer_forward_saved; the saved state when a backward will follow."""
    group = module._group
    wrap = group.dev.wrap
    y = torch.empty(module._out_shape(x), dtype=module._out_dtype(x), device=x.device)
    if not need_backward:
        saved = _p()
        _check(_lib.fp8_layer_forward_saved(group.model.handle, module._layer_id, wrap(x), wrap(y),
                                            ctypes.byref(saved)))
        _lib.fp8_saved_destroy(saved)  # its pool buffers go back now
        return y, None
    saved = _Saved(group.dev)
    _check(_lib.fp8_layer_forward_saved(group.model.handle, module._layer_id, wrap(x), wrap(y),
                                        ctypes.byref(saved.handle)))
    return y, saved


def _keep_for_backward(ctx, x, y, saved):
    """What a libfp8 Function's backward needs of its forward. x itself (not save_for_backward),
    where the backward reads it: libfp8's saved state reads x's memory, which must stay alive even
    where torch.utils.checkpoint drops saved tensors and recomputes them. An FP8 Linear's state keeps
    x's FP8 copy instead: x is let go (half or a quarter of the memory an activation would hold until
    the backward)."""
    ctx.saved, ctx.y_dtype = saved, y.dtype
    ctx.x = x if _f.saved_needs_input(saved.handle) else None
    ctx.x_version, ctx.x_shape, ctx.x_dtype = x._version, x.shape, x.dtype


def _check_backward(ctx, what):
    """Refuses a second backward of one forward, and an input changed in place since (`what` names
    the module in the message)."""
    if ctx.saved is None:
        raise RuntimeError(f"libfp8 {what}: backward through the same graph a second time (libfp8 differentiates "
                           "each forward once; retain_graph is not supported)")
    if ctx.x is not None and ctx.x._version != ctx.x_version:
        raise RuntimeError(f"libfp8 {what}: its input was modified in place after the forward; the backward needs "
                           "it unchanged")


class _LayerFunction(torch.autograd.Function):
    """One layer call: forward and backward by libfp8, parameter gradients accumulated by libfp8 into
    its own storage (which the te Parameters' .grad alias), so autograd gets None for them."""

    @staticmethod
    def forward(ctx, module, x, *params):  # pylint: disable=arguments-differ
        y, saved = _layer_forward(module, x, True)
        ctx.module = module
        _keep_for_backward(ctx, x, y, saved)
        return y

    @staticmethod
    def backward(ctx, dy):  # pylint: disable=arguments-differ
        module = ctx.module
        _check_backward(ctx, f"layer '{module._fp8_name}'")
        group = module._group
        dev = group.dev
        dy = dy.to(ctx.y_dtype).contiguous()
        need_dx = ctx.needs_input_grad[1] or not module._dx_optional
        # A Linear's dx has its activation dtype (y's); a norm's has x's.
        dx_dtype = ctx.y_dtype if module._dx_optional else ctx.x_dtype
        dx = torch.empty(ctx.x_shape, dtype=dx_dtype, device=dy.device) if need_dx else None
        with dev:
            dev.follow_stream()
            module._alias_grads()
            _check(_lib.fp8_layer_backward_saved(group.model.handle, module._layer_id, ctx.saved.handle,
                                                 dev.wrap(dy), dev.wrap(dx) if dx is not None else None, 0))
        ctx.saved = ctx.x = None
        return (None, dx if ctx.needs_input_grad[1] else None) + (None,) * (len(ctx.needs_input_grad) - 2)


class _Module(torch.nn.Module):
    """What the libfp8 modules share: the group, the layer id, the parameters lent by libfp8."""

    _dx_optional = False

    def _attach(self, group, layer_id, name):
        self._group, self._layer_id, self._fp8_name = group, layer_id, name
        self._lent = []  # (torch name, Parameter, value view, grad view or None, index, dtype of grad)

    def _lend_parameters(self, first_index, names, frozen=()):
        """Registers libfp8's parameters first_index.. as torch Parameters named `names`; those in
        `frozen` (requires_grad=False in torch's module) stay frozen."""
        model = self._group.model
        self._lent = []
        self._frozen_at_conversion = set(frozen)
        for k, name in enumerate(names):
            index = first_index + k
            value, grad = _p(), _p()
            _check(_lib.fp8_model_parameter_at(model.handle, index, None, ctypes.byref(value), ctypes.byref(grad)))
            v = to_torch(value)
            g = to_torch(grad)
            trains_in_torch = v.dtype == torch.float32 and g.dtype == torch.float32
            p = torch.nn.Parameter(v, requires_grad=trains_in_torch and name not in frozen)
            if p.requires_grad:
                p.grad = g
            setattr(self, name, p)
            self._lent.append((name, p, v, g, index, grad))
        self._plist = [p for _, p, *_ in self._lent]
        self._device = self._plist[0].device
        self._seen = self._versions()
        # An anchor that requires grad where nothing else would make autograd run the backward of a
        # weight that trains in libfp8 (FP8 gradient, MS-AMP levels).
        libfp8_trained = any(g.dtype != torch.float32 and name not in frozen for name, _, _, g, *_ in self._lent)
        self._anchor = None if any(p.requires_grad for p in self._plist) or not libfp8_trained else \
            torch.zeros(0, device=self._lent[0][1].device, requires_grad=True)

    def _frozen(self):
        """The names of the parameters that do not train: frozen in torch's module when it was
        converted, or FP32 ones whose requires_grad was turned off since."""
        return [name for name, p, v, g, *_ in self._lent if name in self._frozen_at_conversion or
                (v.dtype == torch.float32 and g.dtype == torch.float32 and not p.requires_grad)]

    def __deepcopy__(self, memo):
        raise TypeError(f"libfp8 layer '{self._fp8_name}': a module made by convert_model cannot be copied (its "
                        "parameters are its libfp8 model's memory); copy the torch module before convert_model")

    def _versions(self):
        return [p._version for p in self._plist]

    def _check_storage(self):
        for name, p, v, *_ in self._lent:  # (each call checks the weight; a write checks them all)
            if p.data_ptr() != v.data_ptr() or p.shape != v.shape:
                raise RuntimeError(f"libfp8 layer '{self._fp8_name}': parameter '{name}' no longer uses libfp8's "
                                   "memory (moved with .to()/.cuda()/.half() or .data replaced after "
                                   "convert_model?); move the model before converting it")

    def _alias_grads(self):
        """Re-aliases .grad to libfp8's gradient memory where torch dropped it (zero_grad with
        set_to_none) or replaced it (a tied use accumulated first): libfp8 accumulates into its own
        memory, so it first takes what torch holds (zero if nothing)."""
        for _, p, _, g, *_ in self._lent:
            if p.requires_grad and p.grad is not g:
                if p.grad is None:
                    g.zero_()
                else:
                    g.copy_(p.grad)
                p.grad = g
            elif not p.requires_grad and p.grad is g:
                p.grad = None  # frozen since the conversion: a torch optimizer must not step it

    def _out_dtype(self, x):
        return x.dtype

    def _call(self, x):
        group = getattr(self, "_group", None)
        if group is None:
            raise RuntimeError("this libfp8 module was not made by libfp8.torch.convert_model")
        x = self._cast_input(x).contiguous()
        with group.dev:
            self._notice_writes()
            group.enter(self.training)
            if torch.is_grad_enabled() and self.training:
                params = self._autograd_params()
                if x.requires_grad or params:
                    return _LayerFunction.apply(self, x, *params)
            return _layer_forward(self, x, False)[0]

    def _notice_writes(self):
        """Tells libfp8 once of parameter writes from torch since the last look (every module of the
        group at once: True then)."""
        if self._versions() != self._seen:
            self._group.sync_versions()
            return True
        if self._plist[0].data_ptr() != self._lent[0][2].data_ptr():  # .data replaced: no version bump
            self._check_storage()
        return False

    def _autograd_params(self):
        """What autograd must see as the call's inputs so that its backward runs: the Parameters
        that require grad, or an anchor where none does (MS-AMP weights train in libfp8)."""
        return [p for p in self._plist if p.requires_grad] + ([self._anchor] if self._anchor is not None else [])

    def _cast_input(self, x):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"libfp8 layer '{self._fp8_name}': input is {type(x).__name__}; expected a torch.Tensor")
        if x.device != self._device:
            raise ValueError(f"libfp8 layer '{self._fp8_name}': input is on {x.device}; the layer is on "
                             f"{self._lent[0][1].device}")
        if x.dtype not in _TORCH_DTYPES:
            raise TypeError(f"libfp8 layer '{self._fp8_name}': input dtype {x.dtype}; expected float32, "
                            "bfloat16 or float16")
        return x


def _autocast_dtype(x):
    if x.is_cuda:
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
    return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None


class Linear(_Module):
    """y = x W^T + b by libfp8 (made by convert_model from an nn.Linear; same parameter names).
    Activations are float32 or bfloat16 (under torch.autocast, the autocast dtype; float16 is
    refused); the output has the input's dtype."""

    _dx_optional = True

    def __init__(self, in_features, out_features):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x):
        return self._call(x)

    def _cast_input(self, x):
        x = super()._cast_input(x)
        want = _autocast_dtype(x)
        if want is not None and x.dtype != want:
            x = x.to(want)
        if x.dtype == torch.float16:
            raise TypeError(f"libfp8 Linear '{self._fp8_name}': input dtype float16; expected float32 or bfloat16 "
                            "(libfp8's Linear layers take f32 or bf16 activations)")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"libfp8 Linear '{self._fp8_name}': input shape {tuple(x.shape)}; expected "
                             f"[..., {self.in_features}]")
        return x

    def _out_shape(self, x):
        return x.shape[:-1] + (self.out_features,)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={'bias' in self._parameters}, libfp8='{self._fp8_name}'")


class _Norm(_Module):
    def forward(self, x):
        return self._call(x)

    def _cast_input(self, x):
        x = super()._cast_input(x)
        if x.dim() == 0 or x.shape[-1] != self.normalized_shape[0]:
            raise ValueError(f"libfp8 {type(self).__name__} '{self._fp8_name}': input shape {tuple(x.shape)}; "
                             f"expected [..., {self.normalized_shape[0]}]")
        return x

    def _out_shape(self, x):
        return x.shape

    def _out_dtype(self, x):
        # Under torch.autocast the norm writes the autocast dtype, which is what the Linear after it
        # takes (torch's own layer_norm would write float32 and leave the cast to that Linear).
        return _autocast_dtype(x) or x.dtype

    def extra_repr(self):
        return f"{tuple(self.normalized_shape)}, eps={self.eps}, libfp8='{self._fp8_name}'"


class LayerNorm(_Norm):
    """LayerNorm over the last dimension by libfp8 (weight and bias, as nn.LayerNorm)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.normalized_shape, self.eps, self.elementwise_affine = (dim,), eps, True


class RMSNorm(_Norm):
    """RMSNorm over the last dimension by libfp8 (weight, as nn.RMSNorm)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.normalized_shape, self.eps, self.elementwise_affine = (dim,), eps, True


class Activation(torch.nn.Module):
    """GELU (tanh approximation) or ReLU inside a libfp8 Sequential, where libfp8 runs it with its
    neighbours (made by convert_model from nn.GELU(approximate="tanh") or nn.ReLU; no parameters).
    Called on its own it computes torch's function."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind  # "GELU" or "ReLU"

    def forward(self, x):
        return torch.nn.functional.gelu(x, approximate="tanh") if self.kind == "GELU" else torch.relu(x)

    def extra_repr(self):
        return f"{self.kind}, libfp8='{self._fp8_name}'"


class _StackRun:
    """Consecutive layers of one libfp8 model run as one stack (fp8_stack_forward_saved, or
    fp8_stack_forward_residual with a residual): a libfp8 Sequential's children, or one libfp8 Linear
    (for residual())."""

    def __init__(self, module):
        seq = isinstance(module, Sequential)
        self.layers = module._layers if seq else [module]  # (the ones with parameters)
        self.first, self.count = (module._first, len(module)) if seq else (module._layer_id, 1)
        self.linear_first = isinstance(module[0] if seq else module, Linear)  # (else the first makes a dx)
        self.out_features = self.layers[-1].out_features if isinstance(self.layers[-1], Linear) else None
        self.what = f"Sequential '{module._fp8_name}'" if seq else f"layer '{module._fp8_name}'"

    def enter(self, x, training):
        """Before a call: libfp8 told of parameter writes, x cast and contiguous, the group entered."""
        any(m._notice_writes() for m in self.layers)  # (stops at the first sync: it covers the group)
        x = self.layers[0]._cast_input(x).contiguous()
        self.layers[0]._group.enter(training)
        return x

    def call(self, x, r, training, offer_base=False):
        """r + the stack(x) (r None: the stack(x)), through autograd where a backward may follow;
        offer_base: the stack may take a residual's gradient (_BaseLink)."""
        if torch.is_grad_enabled() and training:
            params = [p for m in self.layers for p in m._autograd_params()]
            if x.requires_grad or (r is not None and r.requires_grad) or params:
                handoff = _BaseLink.claim(r, x) if r is not None and r is not x else None
                # (x passed once when it is the residual, so that autograd sees one input taking dx)
                y = _StackFunction.apply(self, x, r, handoff, *params)
                if offer_base and r is None and x.requires_grad:
                    _BaseLink.offer(x, y.grad_fn)
                return y
        return self.forward(x, r, False)[0]

    def forward(self, x, r, need_backward):
        """y, and the saved state when a backward follows."""
        group = self.layers[0]._group
        wrap = group.dev.wrap
        act = _autocast_dtype(x) or x.dtype
        saved = _Saved(group.dev)
        if r is None:
            features = self.out_features or x.shape[-1]
            y = torch.empty(x.shape[:-1] + (features,), dtype=act, device=x.device)
            _check(_lib.fp8_stack_forward_saved(group.model.handle, self.first, self.count, wrap(x), wrap(y),
                                                ctypes.byref(saved.handle)))
        else:
            y = torch.empty_like(r, memory_format=torch.contiguous_format)
            _check(_lib.fp8_stack_forward_residual(group.model.handle, self.first, self.count, wrap(x), wrap(r),
                                                   wrap(y), _TORCH_DTYPES[act], ctypes.byref(saved.handle)))
        if not need_backward:
            _lib.fp8_saved_destroy(saved.handle)  # its pool buffers go back now
            saved.handle = None
            return y, None
        return y, saved


class _BaseLink:
    """The gradient of a residual handed to the stack that the residual also went through, so that
    the stack's backward adds it in its first layer's pass (fp8_stack_backward_saved_add) instead of
    autograd summing the two gradients in a pass of its own: in a pre-norm block y = x + proj(attn(
    qkv(x))), residual() hands x's gradient through proj to the qkv stack's backward.

    A stack called on x with autograd offers a link on x (offer); a later residual() with residual x
    claims it (claim) only where its own input depends on that stack's output (found in the autograd
    graph), so that the stack's backward runs after its own and takes the gradient. Its backward
    then keeps the residual's gradient in the link (autograd gets None for it) unless the stack's
    backward has already run. Where the stack's input is not the caller's tensor (a cast), another
    stack took x later, or the dependency is not found, autograd sums as usual.
    What this moves is visible to autograd hooks: a hook on the residual call's node sees None for
    the residual's gradient, one on the stack's node sees it inside dx (a Sequential with backward
    hooks, or with global ones, offers no link). A backward pass that raises between the two
    backwards leaves the kept gradient in the link, where a later pass that runs the stack's backward
    alone would add it: run the forward again after a failed backward."""

    _SEARCH_LIMIT = 64  # autograd nodes searched between the two calls

    def __init__(self):
        self.base, self.claimed, self.done = None, False, False

    @staticmethod
    def offer(x, node):
        link = _BaseLink()
        node.base_link = link
        x._fp8_base_link = link  # (the link refers to neither, so nothing is kept alive by it)

    @staticmethod
    def claim(r, x):
        link = getattr(r, "_fp8_base_link", None)
        if link is None or link.claimed or link.done or not r.requires_grad or x.grad_fn is None:
            return None
        seen, todo = {}, [x.grad_fn]  # (seen holds the nodes: ids of freed wrappers would be reused)
        while todo and len(seen) < _BaseLink._SEARCH_LIMIT:
            node = todo.pop()
            if getattr(node, "base_link", None) is link:
                link.claimed = True
                return link
            for nxt, _ in node.next_functions:
                if nxt is not None and id(nxt) not in seen:
                    seen[id(nxt)] = nxt
                    todo.append(nxt)
        return None

    def keep(self, grad):
        """In the residual's backward: keeps grad for the stack's backward (True), or False where that
        backward already ran. A backward pass that ends without running the stack's did not need x's
        gradient (x is that stack's input): the gradient kept is dropped then."""
        if self.done:
            return False
        self.base = grad
        torch.autograd.Variable._execution_engine.queue_callback(self._drop)
        return True

    def _drop(self):
        self.base = None

    def take(self):
        """In the stack's backward: the residual's gradient kept for it, or None."""
        self.done = True
        base, self.base = self.base, None
        return base


class _StackFunction(torch.autograd.Function):
    """One stack call: fp8_stack_forward_saved / fp8_stack_backward_saved over its layers, the
    parameter gradients accumulated in libfp8's storage, as in _LayerFunction. With a residual r the
    last Linear's GEMM adds it; in the backward r's gradient is dy itself, added in the first layer's
    pass (fp8_stack_backward_saved_add with base dy) when r is x."""

    @staticmethod
    def forward(ctx, run, x, r, handoff, *params):  # pylint: disable=arguments-differ
        y, saved = run.forward(x, r, True)
        ctx.run, ctx.same, ctx.handoff = run, r is x, handoff
        _keep_for_backward(ctx, x, y, saved)
        return y

    @staticmethod
    def backward(ctx, dy):  # pylint: disable=arguments-differ
        run = ctx.run
        _check_backward(ctx, run.what)
        with run.layers[0]._group.dev:
            return _StackFunction._backward(ctx, run, dy)

    @staticmethod
    def _backward(ctx, run, dy):
        group = run.layers[0]._group
        group.dev.follow_stream()
        for m in run.layers:
            m._alias_grads()
        dy = dy.to(ctx.y_dtype).contiguous()
        need_dx = ctx.needs_input_grad[1] or not run.linear_first
        dx = torch.empty(ctx.x_shape, dtype=ctx.x_dtype, device=dy.device) if need_dx else None
        # What dx adds to in the first layer's pass: dy where the residual is x, or a residual's
        # gradient handed to this stack (_BaseLink); libfp8 reads it 16-byte aligned.
        link = getattr(ctx, "base_link", None)
        base = link.take() if link is not None else None
        add_dy = ctx.same and dx is not None
        if add_dy:
            base = dy
        wrap = group.dev.wrap
        if base is not None and dx is not None:
            base = base.to(ctx.x_dtype).contiguous()
            if base.data_ptr() % 16:
                base = base.clone()
            _check(_lib.fp8_stack_backward_saved_add(group.model.handle, ctx.saved.handle, wrap(dy), wrap(base),
                                                     wrap(dx)))
        else:
            _check(_lib.fp8_stack_backward_saved(group.model.handle, ctx.saved.handle, wrap(dy),
                                                 wrap(dx) if dx is not None else None, 0))
        ctx.saved = ctx.x = None
        dr = dy if ctx.needs_input_grad[2] and not add_dy else None
        if dr is not None and ctx.handoff is not None and ctx.handoff.keep(dr):
            dr = None  # (the stack the residual went through adds it)
        return (None, dx if ctx.needs_input_grad[1] else None, dr) + (None,) * (len(ctx.needs_input_grad) - 3)


class Sequential(torch.nn.Sequential):
    """An nn.Sequential whose children libfp8 runs as one stack (made by convert_model from an
    nn.Sequential of Linears, LayerNorms, RMSNorms and GELU(tanh)/ReLU, every one converted): one
    call into libfp8 per forward and per backward, the activations between the layers kept by
    libfp8, a norm or activation handing its output to the FP8 Linear after it in E4M3, and the
    backward of a GELU or ReLU after a Linear folded into that Linear's gradient cast (fp8.h,
    fp8_stack_forward_saved). Same children and names as the nn.Sequential it replaces."""

    def _attach_stack(self, name):
        self._fp8_name = name
        self._layers = [m for m in self if isinstance(m, _Module)]
        self._ids = [m._layer_id for m in self]  # consecutive layers of one libfp8 model
        self._first = self._ids[0]
        self._stack_run = _StackRun(self)

    def __getitem__(self, idx):
        # A slice is torch's nn.Sequential of the same children (libfp8 runs the whole stack only).
        if isinstance(idx, slice):
            return torch.nn.Sequential(collections.OrderedDict(list(self._modules.items())[idx]))
        return super().__getitem__(idx)

    def _is_the_stack(self):
        """Whether the children are still the layers convert_model stacked, with no hooks (which a
        stack's call would skip): else the children run one call each."""
        kids = list(self._modules.values())
        return (len(kids) == len(self._ids) and [getattr(m, "_layer_id", None) for m in kids] == self._ids and
                not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in kids))

    def forward(self, x):  # pylint: disable=arguments-renamed
        if not self._is_the_stack():
            return super().forward(x)
        run = self._stack_run
        # (a backward hook on this module would see a residual's gradient handed to it: none then)
        hooked = bool(self._backward_hooks or getattr(torch.nn.modules.module, "_global_backward_hooks", None))
        with run.layers[0]._group.dev:
            return run.call(run.enter(x, self.training), None, self.training, offer_base=not hooked)


def _residual_run(module):
    """The stack residual() runs for `module` (a libfp8 Linear, or a libfp8 Sequential still the stack
    convert_model made and ending with a Linear, neither hooked), else None."""
    if isinstance(module, Sequential):
        if not (module._is_the_stack() and isinstance(module[-1], Linear)):
            return None
    elif not isinstance(module, Linear):
        return None
    if (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or
            getattr(module, "_backward_pre_hooks", None)):
        return None  # (the module's own call runs its hooks)
    return module._stack_run if isinstance(module, Sequential) else _StackRun(module)


def residual(module, x, residual=None):  # pylint: disable=redefined-outer-name
    """residual + module(x), with residual = x when not given (a pre-norm block: x + f(norm(x))).
    Where `module` is a libfp8 Linear, or a libfp8 Sequential ending with one (convert_model's
    stacks), libfp8 adds the residual in that Linear's GEMM and writes the sum in the residual's
    dtype (float32 or bfloat16: the residual stream) while the layers run in x's (or the autocast)
    dtype; the backward hands dy to the residual and, when the residual is x, adds it in the first
    layer's pass, so neither the sum nor its gradient takes a pass of its own (fp8.h,
    fp8_stack_forward_residual). When the residual is not x but went through a libfp8 stack whose
    output x was computed from (a pre-norm attention block: x + proj(attn(qkv(x)))), its gradient
    is added, where the conditions of _BaseLink hold, in that stack's first layer's pass
    (fp8_stack_backward_saved_add); else autograd sums it. Anything
    else (torch modules, a changed or hooked Sequential, shapes or dtypes libfp8's path does not
    take) is computed as residual + module(x) by torch."""
    r = x if residual is None else residual
    run = _residual_run(module)
    if (run is None or not isinstance(r, torch.Tensor) or r.dtype not in (torch.float32, torch.bfloat16) or
            not r.is_contiguous() or r.device != x.device):
        return r + module(x)
    # (eval mode keeps nothing for a backward, but the residual's gradient is dy: torch's sum there)
    if not module.training and torch.is_grad_enabled() and r.requires_grad:
        return r + module(x)
    # (F32 activations give no BF16 sum: a high-precision GEMM writes its operands' dtype or F32)
    if (not isinstance(x, torch.Tensor) or r.shape != x.shape[:-1] + (run.out_features,) or
            (r.dtype == torch.bfloat16 and (_autocast_dtype(x) or x.dtype) == torch.float32)):
        return r + module(x)
    with run.layers[0]._group.dev:
        x_in = run.enter(x, module.training)
        return run.call(x_in, x_in if x_in is r else r, module.training)


_ACTIVATIONS = {"GELU": _f.ACTIVATION_GELU, "ReLU": _f.ACTIVATION_RELU}


def _activation_kind(m):
    """"GELU" or "ReLU" for a torch activation libfp8 computes the same way, else None."""
    if type(m) is torch.nn.GELU and m.approximate == "tanh":
        return "GELU"
    if type(m) is torch.nn.ReLU:
        return "ReLU"
    return None


# ------------------------------------------------------------------------------------------------
# convert_model
# ------------------------------------------------------------------------------------------------


class ConversionReport:
    """What convert_model did: `converted` [(name, kind)], `skipped` [(name, kind, reason)]."""

    def __init__(self, to_fp8):
        self.to_fp8, self.converted, self.skipped = to_fp8, [], []

    def __str__(self):
        verb = "to libfp8" if self.to_fp8 else "back to torch"
        lines = [f"converted {verb}: {len(self.converted)} modules; skipped: {len(self.skipped)}"]
        lines += [f"  skipped {name} ({kind}): {reason}" for name, kind, reason in self.skipped]
        return "\n".join(lines)

    __repr__ = __str__


def _norm_types():
    kinds = [(torch.nn.LayerNorm, "LayerNorm")]
    if hasattr(torch.nn, "RMSNorm"):
        kinds.append((torch.nn.RMSNorm, "RMSNorm"))
    return kinds


def _why_not(name, module, kind, shared):
    """Why a torch module cannot become a libfp8 one, or None."""
    if len(name.encode()) > 127 or not name:
        return "its name is empty or longer than 127 bytes (libfp8's layer names are 1..127 bytes)"
    params = list(module.parameters(recurse=False))
    for p in params:
        if id(p) in shared:
            return f"a parameter is shared with '{shared[id(p)]}' (tied): libfp8 would own one copy of it"
        if not p.is_floating_point():
            return f"a parameter has dtype {p.dtype}"
    if params and params[0].device.type not in ("cpu", "cuda"):
        return f"it is on {params[0].device}"
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
        return "it has hooks, which the swap would lose"
    if kind == "Linear":
        for what, n in (("in_features", module.in_features), ("out_features", module.out_features)):
            if n % 16:
                return f"{what} = {n} is not a multiple of 16 (FP8 GEMMs need it)"
        return None
    shape = tuple(module.normalized_shape)
    if len(shape) != 1:
        return f"normalized_shape {shape} is not one dimension (libfp8 normalises the last one)"
    if not module.elementwise_affine:
        return "elementwise_affine=False (libfp8's norms have a weight)"
    if kind == "LayerNorm" and module.bias is None:
        return "bias=False (libfp8's LayerNorm has a bias)"
    if not 1 <= shape[0] <= 1 << 20:
        return f"dimension {shape[0]} is outside 1..2^20"
    if kind == "RMSNorm" and module.eps is None:
        return None  # torch's default eps (finfo(float32).eps) is used
    if not module.eps > 0:
        return f"eps = {module.eps} is not > 0"
    return None


def _owners(root):
    """id(parameter) -> the name of every module holding it (to find tied parameters)."""
    owners = {}
    for name, m in root.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(name)
    return owners


def _set_child(root, name, new):
    parent_name, _, leaf = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, leaf, new)


def convert_model(module, recipe=None, to_fp8=True, linear=True, norm=True, small_layers="torch",
                  _convert_linear=None):
    """Swaps, in place, nn.Linear and nn.LayerNorm (and nn.RMSNorm where torch has it) in `module`
    for libfp8's Linear, LayerNorm and RMSNorm (to_fp8=True), or libfp8's back for torch's
    (to_fp8=False), as Accelerate's convert_model. Returns a ConversionReport of what was swapped
    and what was skipped and why (tied parameters, hooks, features not multiples of 16, ...).

    small_layers="torch" (the default) leaves as they are the Linears that the recipe's
    small_layer_fallback would run in high precision at every call (in_features or out_features
    below SMALL_LAYER_MIN_FEATURES), since torch's own module does that without the cost of a call
    into libfp8, and then the norms too when no Linear converts (a libfp8 norm only pays beside
    FP8 Linears); small_layers="libfp8" converts them all.

    An nn.Sequential (other than `module` itself) whose children all convert, GELU(tanh) and ReLU
    included, becomes a libfp8 Sequential that libfp8 runs as one stack (norm -> Linear in E4M3,
    an activation's backward folded into the Linear before it); the report lists it as converted.

    The converted layers of one call (per device) form one libfp8 model, converted under `recipe`
    (default Recipe()): its parameters, initialised from torch's, become torch Parameters over
    libfp8's storage, with torch's names. Move the model to its device (and dtype) before: a
    converted module cannot move. `module` itself is not swapped: pass its parent for a bare layer."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"convert_model: module is {type(module).__name__}; expected a torch.nn.Module")
    for arg, v in (("to_fp8", to_fp8), ("linear", linear), ("norm", norm)):
        if not isinstance(v, bool):
            raise TypeError(f"convert_model: {arg}={v!r}; expected True or False")
    if small_layers not in ("torch", "libfp8"):
        raise ValueError(f"convert_model: small_layers={small_layers!r}; expected 'torch' or 'libfp8'")
    report_ = ConversionReport(to_fp8)
    if not to_fp8:
        _convert_back(module, linear, norm, report_)
        return report_
    recipe = _recipe_arg(recipe, "convert_model")
    if recipe.level == "O3":
        raise ValueError("convert_model: recipe opt_level='O3' is not offered by libfp8.torch (its E4M3 weights "
                         "have no torch Parameter form); expected backend='te' or opt_level 'O1' or 'O2'")
    kinds = ([(torch.nn.Linear, "Linear")] if linear else []) + (_norm_types() if norm else [])
    owners = _owners(module)
    chosen = []  # (name, torch module, kind)
    small = []  # the Linears left to torch as small layers
    for name, m in module.named_modules():
        if isinstance(m, _Module):
            report_.skipped.append((name, type(m).__name__, "already a libfp8 module"))
            continue
        kind = next((k for t, k in kinds if type(m) is t), None)  # subclasses may change forward
        if kind is None:
            continue
        shared = {}
        for p in m.parameters(recurse=False):
            others = owners.get(id(p), set()) - {name}
            if others:
                shared[id(p)] = sorted(others)[0]
        reason = _why_not(name, m, kind, shared)
        if not reason and kind == "Linear" and small_layers == "torch" and recipe.small_layer_fallback:
            least = min(m.in_features, m.out_features)
            if least < _f.SMALL_LAYER_MIN_FEATURES:
                reason = (f"a small layer (min(in_features, out_features) = {least} < {_f.SMALL_LAYER_MIN_FEATURES}): "
                          "the recipe's small_layer_fallback would run it in high precision at every call, which "
                          "torch's own module does without libfp8's call (small_layers='libfp8' converts it)")
                small.append(name)
        if reason:
            report_.skipped.append((name, kind, reason))
        else:
            chosen.append((name, m, kind))
    if small and not any(kind == "Linear" for _, _, kind in chosen):
        report_.skipped += [(name, kind, "no Linear converts (every one is a small layer): a libfp8 norm would only add "
                             "the cost of its call (small_layers='libfp8' converts it)") for name, _, kind in chosen]
        chosen = []
    stacks, chosen = _stacks(module, chosen)
    by_device = {}
    for item in chosen:
        by_device.setdefault(item[3], []).append(item[:3])
    for device, items in by_device.items():
        _build_group(module, device, recipe, items)
        report_.converted += [(name, kind) for name, _, kind in items]
    for name, seq in stacks:  # children converted: the container becomes libfp8's Sequential
        new = Sequential(collections.OrderedDict(seq.named_children()))
        new._attach_stack(name)
        new.train(seq.training)
        _set_child(module, name, new)
        report_.converted.append((name, "Sequential"))
    return report_


def _stacks(root, chosen):
    """The nn.Sequential containers (not root) whose children all convert: every child a chosen
    Linear or norm or a GELU(tanh)/ReLU, each used nowhere else (a module used twice is one layer
    of libfp8, not two), a Linear among them, on one device, no hooks on the container or a child. Returns them [(name, module)] and `chosen` with their activations added, in module
    order, each item with its device: [(name, module, kind, device)]."""
    names = {name: (m, kind) for name, m, kind in chosen}
    uses = collections.Counter(id(m) for _, m in root.named_modules(remove_duplicate=False))
    stacks, acts = [], {}
    for name, seq in root.named_modules():
        if type(seq) is not torch.nn.Sequential or not name or len(seq) < 2:
            continue
        children = list(seq._modules.values())
        if any(uses[id(m)] > 1 or m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
               for m in [seq] + children):
            continue
        kids = [(f"{name}.{k}", m) for k, m in seq.named_children()]
        devices = {next(m.parameters()).device for n, m in kids if n in names}
        linear = any(n in names and names[n][1] == "Linear" for n, _ in kids)
        if linear and len(devices) == 1 and all(n in names or _activation_kind(m) for n, m in kids):
            stacks.append((name, seq))
            device = devices.pop()
            for n, m in kids:
                if n not in names:
                    acts[n] = (m, _activation_kind(m), device)
    items = []
    for name, m in root.named_modules():
        if name in names:
            items.append((name, m, names[name][1], next(m.parameters()).device))
        elif name in acts:
            items.append((name, m, acts[name][1], acts[name][2]))
    return stacks, items


def _build_group(root, device, recipe, items):
    group = _Group(device, recipe)
    with group.dev:  # (the device's context is every group's on it)
        return _fill_group(group, root, device, recipe, items)


def _fill_group(group, root, device, recipe, items):
    model = group.model
    first = []  # the index of each layer's first parameter
    count = 0
    for name, m, kind in items:
        if kind in _ACTIVATIONS:
            layer_id = model.add_activation(name, _ACTIVATIONS[kind])
            names = []
        elif kind == "Linear":
            layer_id = model.add_linear(name, m.in_features, m.out_features, bias=m.bias is not None)
            names = ["weight"] + (["bias"] if m.bias is not None else [])
        elif kind == "LayerNorm":
            layer_id = model.add_layernorm(name, m.normalized_shape[0], float(m.eps))
            names = ["weight", "bias"]
        else:
            eps = m.eps if m.eps is not None else torch.finfo(torch.float32).eps
            layer_id = model.add_rmsnorm(name, m.normalized_shape[0], float(eps))
            names = ["weight"]
        first.append((layer_id, count, names))
        count += len(names)
    _check(_lib.fp8_convert_model(model.handle, recipe._c.handle, None))
    level = _i32()
    _check(_lib.fp8_model_storage_level(model.handle, ctypes.byref(level)))
    group.level = "te" if level.value == 0 else f"O{level.value}"
    for (name, m, kind), (layer_id, index, names) in zip(items, first):
        if kind in _ACTIVATIONS:  # runs only inside its Sequential's stack: nothing to lend
            new = Activation(kind)
            new._fp8_name, new._layer_id = name, layer_id
            new.train(m.training)
            _set_child(root, name, new)
            continue
        new = (Linear(m.in_features, m.out_features) if kind == "Linear" else
               LayerNorm(m.normalized_shape[0], m.eps) if kind == "LayerNorm" else
               RMSNorm(m.normalized_shape[0], m.eps))
        new._attach(group, layer_id, name)
        for k, pname in enumerate(names):  # torch's values into libfp8's storage, in its stored form
            src = getattr(m, pname).detach().to(device="cpu", dtype=torch.float32).contiguous()
            _check(_lib.fp8_model_write_parameter(model.handle, index + k, _f.DTYPE_F32,
                                                  ctypes.c_void_p(src.data_ptr()), src.numel() * 4))
        new._lend_parameters(index, names, frozen={n for n in names if not getattr(m, n).requires_grad})
        new._orig_dtype = next(m.parameters()).dtype
        new.train(m.training)
        group.modules.append(new)
        _set_child(root, name, new)
    return group


def _convert_back(root, linear, norm, report_):
    for name, m in list(root.named_modules()):
        if isinstance(m, Sequential):  # the container first; its children below, by name
            new = torch.nn.Sequential(collections.OrderedDict(m.named_children()))
            new.train(m.training)
            _set_child(root, name, new)
            report_.converted.append((name, "Sequential"))
            continue
        if isinstance(m, Activation):
            new = torch.nn.GELU(approximate="tanh") if m.kind == "GELU" else torch.nn.ReLU()
            new.train(m.training)
            _set_child(root, name, new)
            report_.converted.append((name, m.kind))
            continue
        if not isinstance(m, _Module):
            continue
        kind = type(m).__name__
        if (kind == "Linear" and not linear) or (kind != "Linear" and not norm):
            report_.skipped.append((name, kind, "not chosen (linear/norm)"))
            continue
        p0 = m._lent[0][1]
        dtype, device = m._orig_dtype, p0.device
        if kind == "Linear":
            new = torch.nn.Linear(m.in_features, m.out_features, bias="bias" in m._parameters, device=device,
                                  dtype=dtype)
        elif kind == "LayerNorm":
            new = torch.nn.LayerNorm(m.normalized_shape, eps=m.eps, device=device, dtype=dtype)
        else:
            new = torch.nn.RMSNorm(m.normalized_shape, eps=m.eps, device=device, dtype=dtype)
        frozen = m._frozen()
        with m._group.dev, torch.no_grad():
            m._group.dev.follow_stream()
            for pname, p, *_ in m._lent:
                getattr(new, pname).copy_(p)
                getattr(new, pname).requires_grad_(pname not in frozen)
        new.train(m.training)
        _set_child(root, name, new)
        report_.converted.append((name, kind))


def has_fp8_layers(module):
    """True if `module` holds a libfp8 layer converted to FP8 (Accelerate's
    has_transformer_engine_layers)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"has_fp8_layers: module is {type(module).__name__}; expected a torch.nn.Module")
    for g in _groups(module):
        with g.dev:
            if g.model.has_fp8_layers:
                return True
    return False


def _groups(module):
    seen, out = set(), []
    for m in module.modules():
        if isinstance(m, _Module) and id(m._group) not in seen:
            seen.add(id(m._group))
            out.append(m._group)
    return out


def report(module):
    """libfp8's table of every converted layer (kind, shape, precision of the latest calls, FP8 and
    fallback counts, the latest fallback's reason), per libfp8 model in `module`."""
    texts = []
    for g in _groups(module):
        with g.dev:
            texts.append(g.model.report())
    return "\n".join(texts)


# ------------------------------------------------------------------------------------------------
# load_safetensors
# ------------------------------------------------------------------------------------------------

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def _safetensors_header(path):
    """{name: (dtype, shape, begin, end)} of a safetensors file (offsets from the file's start)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"load_safetensors: {path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        size = f.seek(0, 2)
        if n > size - 8:
            raise ValueError(f"load_safetensors: {path}: header length {n} runs past the file's {size} bytes")
        f.seek(8)
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"load_safetensors: {path}: the header is not JSON ({e})") from None
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        begin, end = (8 + n + o for o in t["data_offsets"])
        if not 8 + n <= begin <= end <= size:
            raise ValueError(f"load_safetensors: {path}: tensor '{name}' has data_offsets outside the file")
        out[name] = (t["dtype"], tuple(t["shape"]), begin, end)
    return out


def load_safetensors(module, path, strict=True):
    """Loads a safetensors file (a Hugging Face checkpoint, torch's dotted names) into `module`,
    converted or not, and returns (missing_keys, unexpected_keys) as load_state_dict does.

    The parameters of each libfp8 model (the layers one convert_model call swapped in) are read by
    libfp8 straight into its storage (fp8_model_import_safetensors_part: rounded to F16 at O1/O2, as
    converting does) where its layers' names in `module` are the names they were converted under and
    the file holds all of them; every other parameter and buffer of the state dict is copied by torch.
    strict: the file and module.state_dict() hold the same names (else RuntimeError naming them).
    Names, shapes and dtypes are checked before anything is written."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"load_safetensors: module is {type(module).__name__}; expected a torch.nn.Module")
    path = str(path)
    header = _safetensors_header(path)
    state = module.state_dict(keep_vars=True)
    missing = [k for k in state if k not in header]
    unexpected = [k for k in header if k not in state]
    if strict and (missing or unexpected):
        raise RuntimeError(f"load_safetensors: {path} does not match the module: missing keys {missing}, "
                           f"unexpected keys {unexpected}")
    for k, t in state.items():
        if k not in header:
            continue
        dtype, shape, begin, end = header[k]
        if dtype not in _ST_DTYPES:
            raise ValueError(f"load_safetensors: tensor '{k}' is {dtype}; expected one of {sorted(_ST_DTYPES)}")
        if shape != tuple(t.shape):
            raise ValueError(f"load_safetensors: tensor '{k}' has shape {list(shape)} in the file, "
                             f"{list(t.shape)} in the module")
        if end - begin != math.prod(shape) * torch.empty(0, dtype=_ST_DTYPES[dtype]).element_size():
            raise ValueError(f"load_safetensors: tensor '{k}' ({dtype} {list(shape)}) has {end - begin} bytes")
    # libfp8's models whose layers all keep their converted names and are all in the file.
    qualified = {id(m): name for name, m in module.named_modules()}
    by_libfp8 = set()
    for g in _groups(module):
        keys = [f"{qualified.get(id(m))}.{n}" for m in g.modules for n, *_ in m._lent]
        if (all(qualified.get(id(m)) == m._fp8_name for m in g.modules) and
                all(k in header and header[k][0] in ("F32", "F16", "BF16") for k in keys)):
            with g.dev:
                g.model.import_safetensors(path, part=True)
            by_libfp8.update(keys)
    with open(path, "rb") as f, torch.no_grad():
        for k, t in state.items():
            if k in by_libfp8 or k not in header:
                continue
            dtype, shape, begin, end = header[k]
            f.seek(begin)
            data = bytearray(f.read(end - begin))
            src = torch.frombuffer(data, dtype=_ST_DTYPES[dtype]) if data else torch.empty(0, dtype=_ST_DTYPES[dtype])
            t.copy_(src.reshape(shape))
    return missing, unexpected


# ------------------------------------------------------------------------------------------------
# Optimizer
# ------------------------------------------------------------------------------------------------

_KINDS = {"sgd": _f.OPTIMIZER_SGD, "adam": _f.OPTIMIZER_ADAM, "adamw": _f.OPTIMIZER_ADAMW}


class Optimizer:
    """SGD, Adam or AdamW over a whole module: libfp8's optimizer at the converted layers' level (te,
    O1, O2: see fp8.h, "Optimizer") and torch's over every other parameter that requires grad, with
    one gradient clip over all of them (max_grad_norm > 0: torch's clip_grad_norm_ rule).

        opt = Optimizer(model, "adamw", lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0)
        loss.backward(); opt.step(); opt.zero_grad()

    The clip runs inside libfp8's update (fp8_optimizer_step_joint: torch's gradients add their
    squared norm, and take the factor back for their own update), so clipping costs a few small
    launches over torch's parameters and no pass over libfp8's. (Layers of one module on several
    devices form several libfp8 models: their joint clip runs as torch's clip_grad_norm_ would.)
    A non-finite gradient skips libfp8's update; torch's gradients are then scaled as
    clip_grad_norm_ would scale them (by 0 for an infinite norm, NaN for a NaN one).
    max_grad_norm may be changed between steps (an attribute, as torch optimizers' hyper-parameters).

    step() and zero_grad() queue work on the current stream without synchronising; set_lr() is
    synchronous for libfp8's part (call it between steps). FP8 weight gradients (O1, O2) are zeroed
    by zero_grad() here, not by torch's module.zero_grad().

    libfp8's optimizer updates every parameter of its model, so a converted layer with a frozen
    parameter (requires_grad=False, before or after convert_model) is refused, at creation and at
    each step, naming it: convert only what trains, or train with a torch optimizer (te).
    state_dict() and load_state_dict() save and restore everything a resumed run needs (libfp8's
    checkpoint of each libfp8 model and torch's optimizer state), for torch.save and torch.load."""

    def __init__(self, module, kind="adamw", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=None,
                 momentum=0.0, max_grad_norm=0.0):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"Optimizer: module is {type(module).__name__}; expected a torch.nn.Module")
        if kind not in _KINDS:
            raise ValueError(f"Optimizer: kind={kind!r}; expected one of 'sgd', 'adam', 'adamw'")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise TypeError(f"Optimizer: betas={betas!r}; expected a pair (beta1, beta2)")
        for arg, v in (("lr", lr), ("eps", eps), ("momentum", momentum), ("max_grad_norm", max_grad_norm)):
            if not isinstance(v, (int, float)) or v < 0 or math.isnan(v):
                raise ValueError(f"Optimizer: {arg}={v!r}; expected a number >= 0")
        if weight_decay is None:
            weight_decay = 0.01 if kind == "adamw" else 0.0
        self.kind, self._max_grad_norm = kind, float(max_grad_norm)
        self.groups = _groups(module)
        self._fp8 = []
        # One libfp8 model: its step clips over everything (fp8_optimizer_step_joint). Several: the
        # clip runs here first, over all of them (_clip_across_models).
        self._joint = len(self.groups) == 1
        attrs = dict(lr=lr, weight_decay=weight_decay, max_grad_norm=self._max_grad_norm if self._joint else 0.0)
        if kind == "sgd":
            attrs["momentum"] = momentum
        else:
            attrs.update(beta1=betas[0], beta2=betas[1], eps=eps)
        self._refuse_frozen()
        for g in self.groups:
            if g.fp8_optimizer is not None and g.fp8_optimizer() is not None:
                raise RuntimeError("Optimizer: the module's libfp8 layers already have an optimizer (one per model)")
        for g in self.groups:
            with g.dev:
                o = _f.Optimizer(g.model, _KINDS[kind], **attrs)
            g.fp8_optimizer = weakref.ref(self)
            self._fp8.append((g, o))
        lent = {id(p) for g in self.groups for m in g.modules for _, p, *_ in m._lent}
        self.torch_params = [p for p in module.parameters() if p.requires_grad and id(p) not in lent]
        self.torch_optimizer = None
        if self.torch_params:
            fused = {}
            if self.torch_params[0].is_cuda and kind != "sgd" and _accepts(torch.optim.AdamW, "fused"):
                fused = {"fused": True}
            if kind == "sgd":
                self.torch_optimizer = torch.optim.SGD(self.torch_params, lr=lr, momentum=momentum,
                                                       weight_decay=weight_decay)
            else:
                cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
                self.torch_optimizer = cls(self.torch_params, lr=lr, betas=tuple(betas), eps=eps,
                                           weight_decay=weight_decay, **fused)
        self._scratch = None
        if self._joint:  # the torch gradients' squared norm in, their clip factor out (kept: wrapped once)
            dev = self.groups[0].dev.device
            self._other_sumsq = torch.zeros(1, dtype=torch.float32, device=dev)
            self._clip_coef = torch.ones(1, dtype=torch.float32, device=dev)

    @property
    def max_grad_norm(self):
        """The clip's global norm (0: no clipping)."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value):
        if not isinstance(value, (int, float)) or value < 0 or math.isnan(value):
            raise ValueError(f"Optimizer: max_grad_norm={value!r}; expected a number >= 0")
        if self._joint:  # libfp8's step clips (synchronous for libfp8's part, as set_lr)
            for g, o in self._fp8:
                with g.dev:
                    o["max_grad_norm"] = float(value)
        self._max_grad_norm = float(value)

    def set_lr(self, lr):
        """The learning rate of every parameter from the next step on (a number >= 0)."""
        if isinstance(lr, torch.Tensor) and lr.numel() == 1:
            lr = lr.item()
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr >= 0 or math.isinf(lr):
            raise ValueError(f"Optimizer: lr={lr!r}; expected a finite number >= 0")
        for g, o in self._fp8:
            with g.dev:
                o["lr"] = float(lr)
        if self.torch_optimizer:
            for pg in self.torch_optimizer.param_groups:
                pg["lr"] = lr

    def _refuse_frozen(self):
        for g in self.groups:
            for m in g.modules:
                frozen = m._frozen()
                if frozen:
                    raise RuntimeError(
                        f"Optimizer: libfp8 layer '{m._fp8_name}': parameter '{frozen[0]}' is frozen (requires_grad="
                        "False), but libfp8's optimizer updates every parameter of its model; convert only the layers "
                        "that train (convert_model on a submodule), or train with a torch optimizer (te)")

    def _fp32_lent(self, g):
        """(module, Parameter, grad view) of a group's FP32 gradients (te: all; O1/O2: biases, norms)."""
        for m in g.modules:
            for _, p, _, gv, *_ in m._lent:
                if gv.dtype == torch.float32:
                    yield m, p, gv

    def _fp8_lent(self, g):
        for m in g.modules:
            for _, p, v, gv, index, handle in m._lent:
                if gv.dtype == torch.uint8:
                    yield index, handle, tuple(v.shape)

    def _decoded(self, g, handle, shape):
        """A float32 scratch view holding FP8 gradient `handle` decoded (fp8_dequantize: codes times its
        scale_inv, read on the device)."""
        n = math.prod(shape)
        if self._scratch is None or self._scratch.numel() < n or self._scratch.device != g.dev.device:
            self._scratch = torch.empty(n, dtype=torch.float32, device=g.dev.device)
        view = self._scratch[:n].view(shape)
        _check(_lib.fp8_dequantize(g.dev.ctx.handle, handle, g.dev.wrap(view)))
        return view

    def _torch_grads(self):
        return _by_device_and_dtype([p.grad for p in self.torch_params if p.grad is not None])

    @staticmethod
    def _sumsq(grads, device):
        """The sum of the squares of torch gradients (grouped by _by_device_and_dtype) on `device`."""
        parts = [n.float().square().to(device) for (_, _), group in grads.items() for n in _norms(group)]
        return torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float32, device=device)

    def _clip_across_models(self):
        """torch's clip_grad_norm_ over every gradient, for a module whose layers form several libfp8
        models (one per device), which no single libfp8 step sees whole, or none."""
        if not self.groups:
            torch.nn.utils.clip_grad_norm_(self.torch_params, self.max_grad_norm)
            return
        device, sq = self.groups[0].dev.device, []
        for g, _ in self._fp8:
            with g.dev:
                g.dev.follow_stream()
                for _, p, gv in self._fp32_lent(g):
                    sq.append(gv.pow(2).sum().to(device))
                for _, handle, shape in self._fp8_lent(g):
                    sq.append(self._decoded(g, handle, shape).pow(2).sum().to(device))
        grads = self._torch_grads()
        total = (torch.stack(sq).sum() + self._sumsq(grads, device)).sqrt()
        coef = torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
        for (dev, dtype), group in grads.items():
            _scale_(group, coef.to(dev, dtype))
        for g, _ in self._fp8:
            c = coef.to(g.dev.device)
            with g.dev:
                for _, _, gv in self._fp32_lent(g):
                    gv.mul_(c)
                for index, handle, shape in self._fp8_lent(g):
                    # grad += (coef - 1) grad: libfp8 requantises the sum in one pass (fp8_model_accumulate_grad).
                    d = self._decoded(g, handle, shape)
                    d.mul_(c - 1)
                    _check(_lib.fp8_model_accumulate_grad(g.model.handle, index, g.dev.wrap(d.view(-1))))

    def step(self):
        self._refuse_frozen()
        for g, _ in self._fp8:
            with g.dev:
                g.close_region()  # a step inside an autocast block: the region's scales update first
                g.dev.follow_stream()
                # A dropped .grad holds nothing of this step: libfp8's must not either.
                for _, p, gv in self._fp32_lent(g):
                    if p.requires_grad and p.grad is None:
                        gv.zero_()
                        p.grad = gv
        clip = self._max_grad_norm > 0
        if clip and not self._joint:
            self._clip_across_models()
        for g, o in self._fp8:  # (each context follows torch's stream since the first loop)
            with g.dev:
                if clip and self._joint:
                    grads = self._torch_grads()
                    self._other_sumsq.copy_(self._sumsq(grads, g.dev.device).reshape(1))
                    _check(_lib.fp8_optimizer_step_joint(o.handle, g.dev.wrap(self._other_sumsq),
                                                         g.dev.wrap(self._clip_coef)))
                    for (dev, dtype), group in grads.items():
                        _scale_(group, self._clip_coef.to(dev, dtype))
                else:
                    o.step()
                # torch sees no write to the lent values: take the versions as they are (libfp8 knows).
                for m in g.modules:
                    m._seen = m._versions()
        if self.torch_optimizer:
            self.torch_optimizer.step()

    def zero_grad(self, set_to_none=True):
        for g, o in self._fp8:
            with g.dev:
                g.dev.follow_stream()
                o.zero_grad()
                for _, p, gv in self._fp32_lent(g):
                    if p.requires_grad:
                        p.grad = gv  # zeroed by libfp8; stays aliased
        if self.torch_optimizer:
            self.torch_optimizer.zero_grad(set_to_none=set_to_none)

    def stats(self):
        """libfp8's optimizer statistics (steps, skipped steps, level, bytes), one per libfp8 model.
        Synchronous."""
        stats = []
        for g, o in self._fp8:
            with g.dev:
                stats.append(o.stats())
        return stats

    def state_dict(self):
        """Everything a resumed run needs, for torch.save: per libfp8 model its checkpoint (fp8.h,
        "Checkpoints": parameters in their stored types, scaling states with their amax histories,
        the step count, m and v, the hyper-parameters) as a uint8 tensor, and torch's optimizer's
        state_dict for the other parameters. Synchronous; closes an open fp8_autocast region of the
        models first, as step() does."""
        blobs = []
        with tempfile.TemporaryDirectory(prefix="libfp8-") as tmp:
            path = os.path.join(tmp, "optimizer.fp8ckpt")
            for g, o in self._fp8:
                with g.dev:
                    g.close_region()
                    g.dev.follow_stream()
                    g.model.save_checkpoint(path, o)
                with open(path, "rb") as f:
                    blobs.append(torch.frombuffer(bytearray(f.read()), dtype=torch.uint8))
        return {"kind": self.kind, "max_grad_norm": self._max_grad_norm, "libfp8": blobs,
                "torch": self.torch_optimizer.state_dict() if self.torch_optimizer is not None else None}

    def load_state_dict(self, state_dict):
        """Restores what state_dict() saved, into an Optimizer of the same kind over a module built and
        converted the same way (recipe, layers, names and shapes; libfp8 checks, and refuses a
        mismatch naming it, leaving that model as it was). The libfp8 layers' parameters take the
        saved values too (they are part of libfp8's checkpoint) and their gradients are zeroed;
        training then goes on bit for bit as it would have. Synchronous."""
        if not isinstance(state_dict, dict) or not {"kind", "libfp8", "torch"} <= set(state_dict):
            raise TypeError("Optimizer.load_state_dict: expected a dict from libfp8.torch.Optimizer.state_dict()")
        if state_dict["kind"] != self.kind:
            raise ValueError(f"Optimizer.load_state_dict: the state is of kind {state_dict['kind']!r}; this optimizer "
                             f"is {self.kind!r}")
        blobs = state_dict["libfp8"]
        if len(blobs) != len(self._fp8):
            raise ValueError(f"Optimizer.load_state_dict: the state holds {len(blobs)} libfp8 models; this optimizer "
                             f"trains {len(self._fp8)}")
        if (state_dict["torch"] is None) != (self.torch_optimizer is None):
            raise ValueError("Optimizer.load_state_dict: " + (
                "the state has no torch optimizer state; this optimizer trains torch parameters"
                if state_dict["torch"] is None else
                "the state has torch optimizer state; this optimizer trains no torch parameter"))
        with tempfile.TemporaryDirectory(prefix="libfp8-") as tmp:
            path = os.path.join(tmp, "optimizer.fp8ckpt")
            for (g, o), blob in zip(self._fp8, blobs):
                if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8:
                    raise TypeError("Optimizer.load_state_dict: state_dict['libfp8'] holds a "
                                    f"{type(blob).__name__}; expected uint8 tensors")
                with open(path, "wb") as f:
                    blob = blob.cpu().contiguous()
                    f.write(ctypes.string_at(blob.data_ptr(), blob.numel()) if blob.numel() else b"")
                with g.dev:
                    g.close_region()
                    g.dev.follow_stream()
                    g.model.load_checkpoint(path, o)
                    # The checkpoint set the model's training mode to the saved one: back to the modules'.
                    _check(_lib.fp8_model_set_training(g.model.handle, int(g.training)))
                    for m in g.modules:
                        m._check_storage()
                        m._seen = m._versions()
        if self.torch_optimizer is not None:
            self.torch_optimizer.load_state_dict(state_dict["torch"])
        self.max_grad_norm = state_dict.get("max_grad_norm", self._max_grad_norm)


def _by_device_and_dtype(tensors):
    groups = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _norms(tensors):
    """The 2-norm of each tensor (all of one device and dtype): torch's foreach kernel where it has one."""
    if hasattr(torch, "_foreach_norm"):
        return list(torch._foreach_norm(tensors))
    return [t.norm() for t in tensors]


def _scale_(tensors, coef):
    """t *= coef (a tensor of their device and dtype) for each tensor, in place."""
    try:
        torch._foreach_mul_(tensors, coef)
    except (AttributeError, TypeError, RuntimeError):  # (a torch without the tensor overload)
        for t in tensors:
            t.mul_(coef)


def _accepts(cls, arg):
    import inspect
    try:
        return arg in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
