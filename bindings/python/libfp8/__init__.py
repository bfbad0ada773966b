"""libfp8 from Python through ctypes: no compiled glue, only the C ABI of include/fp8.h.

(This is the package `libfp8`; bindings/python/fp8.py re-exports it under its old name. PyTorch
integration lives in libfp8.torch.)

The module mirrors the header's constants and wraps the calls in a few small classes that own their
handles. Every failing call raises Fp8Error carrying the status and fp8_last_error_message().

    import libfp8 as fp8
    ctx = fp8.Context(fp8.DEVICE_CPU)
    recipe = fp8.Recipe("fp8_format=E4M3, margin=1")
    print(recipe)                                  # the full text form
    model = fp8.Model(ctx); fc = model.add_linear("fc1", 784, 1024)
    model.convert(recipe)
    with model.autocast(): model.run(x, y)           # FP8 inside, scaling updated on exit
    model.run_backward(dy); opt = fp8.Optimizer(model, fp8.OPTIMIZER_ADAMW, lr=1e-3); opt.step()

Several forwards of one layer can be in flight at once (fp8_layer_forward_saved): each returns a
Saved, differentiated once, in any order, with model.backward_saved(layer_id, saved, dy, dx).

The shared library is found through FP8_LIBRARY (a path), else in the build tree next to this
source (build/release, build/device, build/debug, build), else by the loader's usual search for
libfp8.so.0.

fp8_context_set_allocator is declared here but wrapped only by libfp8.torch (Context.set_allocator
takes ctypes callbacks that the caller keeps alive; libfp8 may call them from any thread that uses
or destroys the context's objects, so they must not raise: return None for "no memory").

As in C, objects are externally synchronised: one thread at a time per Context and what was made
from it (libfp8.torch serialises its own calls per device). libfp8 cannot tell its handles apart,
so every wrapper checks that each object it passes is of the kind the call takes (TypeError naming
the argument otherwise). Objects that own a handle cannot be copied or pickled (a copy would
destroy the handle twice); copy.copy(recipe) clones a Recipe.
"""
import ctypes
import os
import struct



def _find_library():
    if os.environ.get("FP8_LIBRARY"):
        return os.environ["FP8_LIBRARY"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    for build in ("build/release", "build/device", "build/debug", "build"):
        candidate = os.path.join(root, build, "libfp8.so.0")
        if os.path.exists(candidate):
            return candidate
    return "libfp8.so.0"


LIBRARY_PATH = _find_library()
_lib = ctypes.CDLL(LIBRARY_PATH)

# Pinned values of fp8.h, named as there without the FP8_ prefix (test_fp8.py checks every one
# against the header).
VERSION_MAJOR = 0
OK = 0
ERR_BUFFER_TOO_SMALL = 13
DEVICE_CPU = -1
DTYPE_F32, DTYPE_F16, DTYPE_BF16, DTYPE_E4M3, DTYPE_E5M2 = 0, 1, 2, 3, 4
ROLE_FORWARD, ROLE_BACKWARD = 0, 1
(RECIPE_BACKEND, RECIPE_OPT_LEVEL, RECIPE_MARGIN, RECIPE_INTERVAL, RECIPE_FP8_FORMAT, RECIPE_AMAX_HISTORY_LEN,
 RECIPE_AMAX_COMPUTE_ALGO, RECIPE_OVERRIDE_FPROP, RECIPE_OVERRIDE_DGRAD, RECIPE_OVERRIDE_WGRAD,
 RECIPE_USE_AUTOCAST_DURING_EVAL, RECIPE_SMALL_LAYER_FALLBACK, RECIPE_POWER_2_SCALES, RECIPE_SCALING) = range(14)
FORMAT_E4M3, FORMAT_HYBRID = 0, 1
SCALING_DELAYED, SCALING_CURRENT, SCALING_ROWWISE, SCALING_BLOCK = 0, 1, 2, 3
POWER_2_SCALES_AUTO = -1
SCALE_MODE_ROW, SCALE_MODE_BLOCK_1X128, SCALE_MODE_BLOCK_128X128 = 1, 2, 3
ACTIVATION_RELU, ACTIVATION_GELU, ACTIVATION_SWIGLU = 0, 1, 2
NORM_LAYERNORM, NORM_RMSNORM = 0, 1
LAYER_LINEAR, LAYER_LAYERNORM, LAYER_RMSNORM, LAYER_ACTIVATION = 0, 1, 2, 3
SCALING_INPUT, SCALING_WEIGHT, SCALING_GRAD_OUTPUT, SCALING_OUTPUT = 0, 1, 2, 3
OPTIMIZER_SGD, OPTIMIZER_ADAM, OPTIMIZER_ADAMW = 0, 1, 2
BACKEND_AUTO, BACKEND_TE, BACKEND_MSAMP = 0, 1, 2
OPT_O1, OPT_O2, OPT_O3 = 1, 2, 3
STORAGE_VALUES, STORAGE_GRADS, STORAGE_MASTERS = 0, 1, 2
BACKWARD_ACCUMULATE_DX = 1
BACKWARD_ADD_DY = 2
CHECKPOINT_GRADIENTS = 1
DEFAULT_BUCKET_BYTES, MIN_BUCKET_BYTES = 33554432, 256
SMALL_LAYER_MIN_FEATURES, SMALL_LAYER_MIN_MACS = 2048, 4294967296
DEFAULT_COMM_TIMEOUT_S = 600.0
(OPTIM_LR, OPTIM_BETA1, OPTIM_BETA2, OPTIM_EPS, OPTIM_WEIGHT_DECAY, OPTIM_MOMENTUM, OPTIM_MAX_GRAD_NORM,
 OPTIM_ATTR_COUNT) = range(8)

_p = ctypes.c_void_p
_i32, _i64, _u8, _f32, _size = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint8, ctypes.c_float, ctypes.c_size_t


_declared = {}  # name -> (restype, argtypes): test_fp8.py checks each against its prototype in fp8.h


def _declare(name, restype, *argtypes):
    fn = getattr(_lib, name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    _declared[name] = (restype, tuple(argtypes))
    return fn


_declare("fp8_version_string", ctypes.c_char_p)
_declare("fp8_version_number", ctypes.c_uint32)
if _lib.fp8_version_number() // 10000 != VERSION_MAJOR:  # the values pinned above hold within one major version
    raise ImportError(f"libfp8: {LIBRARY_PATH} is libfp8 {_lib.fp8_version_string().decode()}; this binding is for "
                      f"{VERSION_MAJOR}.x")
_declare("fp8_status_string", ctypes.c_char_p, _i32)
_declare("fp8_last_error_message", ctypes.c_char_p)
_declare("fp8_encode", _u8, _f32, _i32)
_declare("fp8_decode", _f32, _u8, _i32)
_declare("fp8_dtype_size", _size, _i32)
for _name, _args in {
    "fp8_context_create": (ctypes.POINTER(_p), _i32),
    "fp8_recipe_create": (ctypes.POINTER(_p),),
    "fp8_recipe_clone": (ctypes.POINTER(_p), _p),
    "fp8_recipe_set_int": (_p, _i32, _i64),
    "fp8_recipe_get_int": (_p, _i32, ctypes.POINTER(_i64)),
    "fp8_recipe_parse": (_p, ctypes.c_char_p),
    "fp8_recipe_to_string": (_p, ctypes.c_char_p, _size, ctypes.POINTER(_size)),
    "fp8_tensor_create": (ctypes.POINTER(_p), _p, _i32, _i32, ctypes.POINTER(_i64)),
    "fp8_tensor_copy_from_host": (_p, _p, _size),
    "fp8_tensor_copy_to_host": (_p, _p, _size),
    "fp8_tensor_get_scale_inv": (_p, ctypes.POINTER(_f32)),
    "fp8_tensor_data": (_p, ctypes.POINTER(_p)),
    "fp8_scaling_create": (ctypes.POINTER(_p), _p, _p, _i32),
    "fp8_scaling_set_scale": (_p, _f32),
    "fp8_scaling_update": (_p, ctypes.POINTER(_p), _i32, _p),
    "fp8_quantize": (_p, _p, _p, _p, _p),
    "fp8_dequantize": (_p, _p, _p),
    "fp8_activation_forward": (_p, _i32, _p, _p, _p),
    "fp8_gemm": (_p, _p, _p, _p, _p, _p, _p),
    "fp8_scale_grid_shape": (_i32, _i64, _i64, ctypes.POINTER(_i64)),
    "fp8_quantize_scaled": (_p, _p, _i32, _p, _p, _p, _p, _p),
    "fp8_gemm_scaled": (_p, _p, _i32, _p, _p, _i32, _p, _p, _p, _p),
    "fp8_tensor_dtype": (_p, ctypes.POINTER(_i32)),
    "fp8_tensor_wrap": (ctypes.POINTER(_p), _p, _i32, _i32, ctypes.POINTER(_i64), _p),
    "fp8_tensor_numel": (_p, ctypes.POINTER(_i64)),
    "fp8_context_device": (_p, ctypes.POINTER(_i32)),
    "fp8_context_set_stream": (_p, _p),
    "fp8_context_get_stream": (_p, ctypes.POINTER(_p)),
    "fp8_context_synchronize": (_p,),
    "fp8_context_set_allocator": (_p, _p, _p, _p),
    "fp8_model_find_layer": (_p, ctypes.c_char_p, ctypes.POINTER(_i32)),
    "fp8_model_layer_count": (_p, ctypes.POINTER(_i32)),
    "fp8_layer_get_report": (_p, _i32, _p),
    "fp8_tensor_shape": (_p, ctypes.POINTER(_i32), ctypes.POINTER(_i64)),
    "fp8_model_create": (ctypes.POINTER(_p), _p),
    "fp8_model_add_linear": (_p, ctypes.c_char_p, _i64, _i64, _i32, ctypes.POINTER(_i32)),
    "fp8_model_add_layernorm": (_p, ctypes.c_char_p, _i64, _f32, ctypes.POINTER(_i32)),
    "fp8_model_add_rmsnorm": (_p, ctypes.c_char_p, _i64, _f32, ctypes.POINTER(_i32)),
    "fp8_model_add_activation": (_p, ctypes.c_char_p, _i32, ctypes.POINTER(_i32)),
    "fp8_model_parameter": (_p, ctypes.c_char_p, ctypes.POINTER(_p), ctypes.POINTER(_p)),
    "fp8_model_weights_changed": (_p,),
    "fp8_model_zero_grad": (_p,),
    "fp8_model_set_training": (_p, _i32),
    "fp8_convert_model": (_p, _p, _p),
    "fp8_model_has_fp8_layers": (_p, ctypes.POINTER(_i32)),
    "fp8_autocast_begin": (_p,),
    "fp8_autocast_end": (_p,),
    "fp8_layer_forward": (_p, _i32, _p, _p),
    "fp8_layer_backward": (_p, _i32, _p, _p),
    "fp8_layer_forward_saved": (_p, _i32, _p, _p, ctypes.POINTER(_p)),
    "fp8_layer_backward_saved": (_p, _i32, _p, _p, _p, ctypes.c_uint32),
    "fp8_stack_forward_saved": (_p, _i32, _i32, _p, _p, ctypes.POINTER(_p)),
    "fp8_stack_forward_residual": (_p, _i32, _i32, _p, _p, _p, _i32, ctypes.POINTER(_p)),
    "fp8_stack_backward_saved": (_p, _p, _p, _p, ctypes.c_uint32),
    "fp8_stack_backward_saved_add": (_p, _p, _p, _p, _p),
    "fp8_model_parameter_count": (_p, ctypes.POINTER(_i32)),
    "fp8_model_parameter_at": (_p, _i32, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(_p), ctypes.POINTER(_p)),
    "fp8_model_write_parameter": (_p, _i32, _i32, _p, _size),
    "fp8_model_storage_level": (_p, ctypes.POINTER(_i32)),
    "fp8_model_flat_storage": (_p, _i32, _i32, ctypes.POINTER(_p), ctypes.POINTER(_size)),
    "fp8_model_report": (_p, ctypes.c_char_p, _size, ctypes.POINTER(_size)),
    "fp8_model_forward": (_p, _p, _p),
    "fp8_model_backward": (_p, _p, _p),
    "fp8_model_set_autowrap": (_p, _i32),
    "fp8_optimizer_create": (ctypes.POINTER(_p), _p, _i32),
    "fp8_optimizer_set_float": (_p, _i32, ctypes.c_double),
    "fp8_optimizer_get_float": (_p, _i32, ctypes.POINTER(ctypes.c_double)),
    "fp8_optimizer_step": (_p,),
    "fp8_optimizer_zero_grad": (_p,),
    "fp8_optimizer_get_stats": (_p, _p),
    "fp8_model_accumulate_grad": (_p, _i32, _p),
    "fp8_checkpoint_save": (_p, _p, ctypes.c_char_p, ctypes.c_uint32),
    "fp8_checkpoint_load": (_p, _p, ctypes.c_char_p),
    "fp8_checkpoint_read_recipe": (ctypes.c_char_p, _p),
    "fp8_model_export_safetensors": (_p, ctypes.c_char_p),
    "fp8_model_import_safetensors": (_p, ctypes.c_char_p),
    "fp8_model_import_safetensors_part": (_p, ctypes.c_char_p),
    "fp8_comm_create_local": (ctypes.POINTER(_p), ctypes.POINTER(_p), _i32),
    "fp8_comm_rank": (_p, ctypes.POINTER(_i32)),
    "fp8_comm_size": (_p, ctypes.POINTER(_i32)),
    "fp8_comm_abort": (_p,),
    "fp8_comm_set_timeout": (_p, ctypes.c_double),
    "fp8_comm_get_timeout": (_p, ctypes.POINTER(ctypes.c_double)),
    "fp8_model_set_comm": (_p, _p),
    "fp8_model_sync_grads": (_p,),
    "fp8_model_set_backward_sync": (_p, _i32),
    "fp8_model_set_bucket_bytes": (_p, _size),
}.items():
    _declare(_name, _i32, *_args)
# Newer calls (DLPack, scaled wraps): declared when the loaded library has them, so that this
# module still loads against an older build; libfp8.torch says what it needs.
for _name, _args in {
    "fp8_tensor_wrap_scaled": (ctypes.POINTER(_p), _p, _i32, _i32, ctypes.POINTER(_i64), _p, _p),
    "fp8_tensor_from_dlpack": (ctypes.POINTER(_p), _p, _p),
    "fp8_tensor_to_dlpack": (_p, ctypes.POINTER(_p)),
    "fp8_tensor_from_dlpack_versioned": (ctypes.POINTER(_p), _p, _p),
    "fp8_tensor_to_dlpack_versioned": (_p, ctypes.POINTER(_p)),
    "fp8_saved_needs_input": (_p, ctypes.POINTER(_i32)),
    "fp8_optimizer_step_joint": (_p, _p, _p),
}.items():
    if hasattr(_lib, _name):
        _declare(_name, _i32, *_args)
for _name in ["fp8_context_destroy", "fp8_recipe_destroy", "fp8_tensor_destroy", "fp8_scaling_destroy",
              "fp8_model_destroy", "fp8_optimizer_destroy", "fp8_saved_destroy", "fp8_comm_destroy"]:
    _declare(_name, None, _p)


class Fp8Error(RuntimeError):
    def __init__(self, status):
        self.status = status
        self.status_name = _lib.fp8_status_string(status).decode()
        super().__init__(f"{self.status_name}: {_lib.fp8_last_error_message().decode()}")


def _check(status):
    if status != OK:
        raise Fp8Error(status)


def _arg(obj, cls, where, optional=False):
    """obj's C handle, once obj is checked to be a `cls` (None allowed where optional): libfp8 cannot
    tell its handles apart, so a handle of another kind (a Model passed as a Tensor) would be read
    as this one. TypeError naming the argument (`where`: "quantize: out") otherwise."""
    if obj is None and optional:
        return None
    if not isinstance(obj, cls):
        names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
        raise TypeError(f"{where} is {type(obj).__name__}; expected a libfp8.{names}" +
                        (" or None" if optional else ""))
    return obj.handle


def _path(path, where):
    """A file name (str, bytes or os.PathLike) as the UTF-8 bytes libfp8 takes."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"{where}: path is {type(path).__name__}; expected a str or os.PathLike")
    return os.fsencode(path)


def version():
    return _lib.fp8_version_string().decode()


def encode(x, dtype=DTYPE_E4M3):
    return _lib.fp8_encode(x, dtype)


def decode(code, dtype=DTYPE_E4M3):
    return _lib.fp8_decode(code, dtype)


class _Handle:
    """Owns one C handle, destroyed with the object. Not copyable: a copy would own the same handle
    and destroy it a second time (Recipe copies through fp8_recipe_clone)."""
    _destroy = None

    def __init__(self):
        self.handle = _p()

    def __del__(self):
        if self._destroy and getattr(self, "handle", None) and self.handle.value:
            getattr(_lib, self._destroy)(self.handle)
            self.handle = _p()

    def __reduce_ex__(self, protocol):
        raise TypeError(f"libfp8.{type(self).__name__} cannot be copied or pickled (it owns a libfp8 handle)")

    def __copy__(self):
        self.__reduce_ex__(0)

    def __deepcopy__(self, memo):
        return self.__copy__()


class Context(_Handle):
    _destroy = "fp8_context_destroy"

    def __init__(self, device=DEVICE_CPU):
        super().__init__()
        self.device = device
        _check(_lib.fp8_context_create(ctypes.byref(self.handle), device))

    def set_stream(self, stream):
        """Later work goes on `stream`, a cudaStream_t as an int (0: the legacy default stream)."""
        _check(_lib.fp8_context_set_stream(self.handle, stream or None))

    def synchronize(self):
        _check(_lib.fp8_context_synchronize(self.handle))

    def set_allocator(self, alloc, free):
        """alloc, free: ALLOC_FN and FREE_FN callbacks (None, None: libfp8's own allocator). The
        context holds them for its whole life, since blocks they gave go back to them."""
        _check(_lib.fp8_context_set_allocator(self.handle, ctypes.cast(alloc, _p) if alloc else None,
                                              ctypes.cast(free, _p) if free else None, None))
        self._allocators = getattr(self, "_allocators", []) + [(alloc, free)]


# fp8_alloc_fn and fp8_free_fn (user, bytes or ptr, device, stream).
ALLOC_FN = ctypes.CFUNCTYPE(_p, _p, _size, _i32, _p)
FREE_FN = ctypes.CFUNCTYPE(None, _p, _p, _i32, _p)


class Recipe(_Handle):
    _destroy = "fp8_recipe_destroy"

    def __init__(self, text=""):
        super().__init__()
        _check(_lib.fp8_recipe_create(ctypes.byref(self.handle)))
        if text:
            self.parse(text)

    def parse(self, text):
        if not isinstance(text, str):
            raise TypeError(f"Recipe.parse: text is {type(text).__name__}; expected a str (\"key=value, ...\")")
        _check(_lib.fp8_recipe_parse(self.handle, text.encode()))

    def __copy__(self):
        """An independent copy (fp8_recipe_clone)."""
        new = Recipe.__new__(Recipe)
        _Handle.__init__(new)
        _check(_lib.fp8_recipe_clone(ctypes.byref(new.handle), self.handle))
        return new

    @classmethod
    def from_checkpoint(cls, path):
        """The recipe a checkpoint's model was converted with (fp8_checkpoint_read_recipe): rebuild
        the model, convert it with this, then load the checkpoint."""
        recipe = cls()
        _check(_lib.fp8_checkpoint_read_recipe(_path(path, "Recipe.from_checkpoint"), recipe.handle))
        return recipe

    def __getitem__(self, attr):
        v = _i64()
        _check(_lib.fp8_recipe_get_int(self.handle, attr, ctypes.byref(v)))
        return v.value

    def __setitem__(self, attr, value):
        _check(_lib.fp8_recipe_set_int(self.handle, attr, value))

    def __str__(self):
        needed = _size()
        status = _lib.fp8_recipe_to_string(self.handle, None, 0, ctypes.byref(needed))
        if status != ERR_BUFFER_TOO_SMALL:
            _check(status)
        buf = ctypes.create_string_buffer(needed.value)
        _check(_lib.fp8_recipe_to_string(self.handle, buf, needed.value, None))
        return buf.value.decode()


class Tensor(_Handle):
    """A tensor of the context's device; data moves through bytes (struct-packed by the caller)."""
    _destroy = "fp8_tensor_destroy"

    def __init__(self, ctx, dtype, shape):
        super().__init__()
        ctx_handle = _arg(ctx, Context, "Tensor: ctx")
        self.ctx, self.dtype, self.shape = ctx, dtype, tuple(shape)
        dims = (_i64 * len(self.shape))(*self.shape)
        _check(_lib.fp8_tensor_create(ctypes.byref(self.handle), ctx_handle, dtype, len(self.shape), dims))
        self.nbytes = _lib.fp8_dtype_size(dtype)
        for d in self.shape:
            self.nbytes *= d

    def write(self, data):
        buf = ctypes.create_string_buffer(bytes(data), len(data))
        _check(_lib.fp8_tensor_copy_from_host(self.handle, buf, len(data)))

    def read(self):
        buf = ctypes.create_string_buffer(self.nbytes)
        _check(_lib.fp8_tensor_copy_to_host(self.handle, buf, self.nbytes))
        return buf.raw

    def write_floats(self, values):
        self.write(struct.pack(f"{len(values)}f", *values))

    def read_floats(self):
        raw = self.read()
        return list(struct.unpack(f"{len(raw) // 4}f", raw))

    @property
    def address(self):
        """The data pointer (device memory on a CUDA context), borrowed from the tensor."""
        data = _p()
        _check(_lib.fp8_tensor_data(self.handle, ctypes.byref(data)))
        return data.value or 0

    @property
    def scale_inv(self):
        v = _f32()
        _check(_lib.fp8_tensor_get_scale_inv(self.handle, ctypes.byref(v)))
        return v.value


class Parameter(Tensor):
    """A model's parameter value or gradient ("<layer>.<param>"), borrowed from the model.

    The C tensor belongs to the model, so it is never destroyed here; its handle lives as long as the
    model, but what it stores follows the model's storage level: fp8_convert_model under an MS-AMP
    recipe makes a Linear weight F16 (O1/O2) or E4M3 (O3) and its gradient FP8. So this object holds
    the Model (which holds its context) and reads handle, dtype, shape and nbytes at every use.
    Write values into any level with Model.write_parameter (write/write_floats copy raw bytes of the
    stored dtype, and an FP8 gradient or O3's E4M3 weight refuses them).
    """
    _destroy = None  # the model's

    def __init__(self, model, name, grad=False):  # pylint: disable=super-init-not-called
        self.model, self.ctx, self.name, self.is_grad = model, model.ctx, name, grad
        self.handle  # an unknown name raises here

    @property
    def handle(self):
        value, grad = _p(), _p()
        _check(_lib.fp8_model_parameter(self.model.handle, self.name.encode(), ctypes.byref(value),
                                        ctypes.byref(grad)))
        return grad if self.is_grad else value

    @property
    def dtype(self):
        dt = _i32()
        _check(_lib.fp8_tensor_dtype(self.handle, ctypes.byref(dt)))
        return dt.value

    @property
    def shape(self):
        ndim, dims = _i32(), (_i64 * 8)()
        _check(_lib.fp8_tensor_shape(self.handle, ctypes.byref(ndim), dims))
        return tuple(dims[:ndim.value])

    @property
    def nbytes(self):
        n = _lib.fp8_dtype_size(self.dtype)
        for d in self.shape:
            n *= d
        return n


class Scaling(_Handle):
    _destroy = "fp8_scaling_destroy"

    def __init__(self, ctx, recipe, role=ROLE_FORWARD):
        super().__init__()
        self.ctx = ctx
        _check(_lib.fp8_scaling_create(ctypes.byref(self.handle), _arg(ctx, Context, "Scaling: ctx"),
                                       _arg(recipe, Recipe, "Scaling: recipe"), role))

    def set_scale(self, scale):
        _check(_lib.fp8_scaling_set_scale(self.handle, scale))


def quantize(ctx, x, out, scaling, out_transposed=None):
    w = "quantize: "
    _check(_lib.fp8_quantize(_arg(ctx, Context, w + "ctx"), _arg(x, Tensor, w + "x"), _arg(out, Tensor, w + "out"),
                             _arg(out_transposed, Tensor, w + "out_transposed", True),
                             _arg(scaling, Scaling, w + "scaling")))


def dequantize(ctx, q, out):
    _check(_lib.fp8_dequantize(_arg(ctx, Context, "dequantize: ctx"), _arg(q, Tensor, "dequantize: q"),
                               _arg(out, Tensor, "dequantize: out")))


def scaling_update(ctx, states, recipe):
    arr = (_p * len(states))(*[_arg(s, Scaling, f"scaling_update: states[{k}]").value for k, s in enumerate(states)])
    _check(_lib.fp8_scaling_update(_arg(ctx, Context, "scaling_update: ctx"), arr, len(states),
                                   _arg(recipe, Recipe, "scaling_update: recipe")))


def gemm(ctx, a, b, d, bias=None, d_scaling=None):
    """d = a * b^T (+ bias), the default options (see fp8_gemm in fp8.h)."""
    w = "gemm: "
    _check(_lib.fp8_gemm(_arg(ctx, Context, w + "ctx"), _arg(a, Tensor, w + "a"), _arg(b, Tensor, w + "b"),
                         _arg(bias, Tensor, w + "bias", True), _arg(d, Tensor, w + "d"),
                         _arg(d_scaling, Scaling, w + "d_scaling", True), None))


def scale_grid_shape(mode, rows, cols):
    """The (2) sizes of the F32 grid of scales of an FP8 operand [rows, cols] in SCALE_MODE_* `mode`
    (fp8_scale_grid_shape: the layout cuBLASLt reads)."""
    shape = (_i64 * 2)()
    _check(_lib.fp8_scale_grid_shape(mode, rows, cols, shape))
    return (shape[0], shape[1])


def quantize_scaled(ctx, x, mode, recipe, out, out_scales, out_transposed=None, out_t_scales=None):
    """x quantised into out with a scale per cell of `mode` (row, 1x128 or 128x128 block), 1/scale of
    each cell into out_scales (a grid of scale_grid_shape(mode, rows, cols)); with out_transposed,
    the [cols, rows] copy along its own rows and its grid (fp8_quantize_scaled)."""
    if (out_transposed is None) != (out_t_scales is None):
        raise ValueError("quantize_scaled: out_transposed and out_t_scales come together; expected both or neither")
    w = "quantize_scaled: "
    _check(_lib.fp8_quantize_scaled(_arg(ctx, Context, w + "ctx"), _arg(x, Tensor, w + "x"), mode,
                                    _arg(recipe, Recipe, w + "recipe"), _arg(out, Tensor, w + "out"),
                                    _arg(out_scales, Tensor, w + "out_scales"),
                                    _arg(out_transposed, Tensor, w + "out_transposed", True),
                                    _arg(out_t_scales, Tensor, w + "out_t_scales", True)))


def gemm_scaled(ctx, a, a_mode, a_scales, b, b_mode, b_scales, d, bias=None):
    """d = a * b^T (+ bias) with grids of scales (fp8_gemm_scaled; the default options)."""
    w = "gemm_scaled: "
    _check(_lib.fp8_gemm_scaled(_arg(ctx, Context, w + "ctx"), _arg(a, Tensor, w + "a"), a_mode,
                                _arg(a_scales, Tensor, w + "a_scales"), _arg(b, Tensor, w + "b"), b_mode,
                                _arg(b_scales, Tensor, w + "b_scales"), _arg(bias, Tensor, w + "bias", True),
                                _arg(d, Tensor, w + "d"), None))


def activation_forward(ctx, activation, x, y, y_scaling=None):
    w = "activation_forward: "
    _check(_lib.fp8_activation_forward(_arg(ctx, Context, w + "ctx"), activation, _arg(x, Tensor, w + "x"),
                                       _arg(y, Tensor, w + "y"), _arg(y_scaling, Scaling, w + "y_scaling", True)))


def _text(call):
    """Runs a (buf, cap, needed) text getter twice: once for the size, once for the text."""
    needed = _size()
    status = call(None, 0, ctypes.byref(needed))
    if status != ERR_BUFFER_TOO_SMALL:
        _check(status)
    buf = ctypes.create_string_buffer(needed.value)
    _check(call(buf, needed.value, None))
    return buf.value.decode()


class Model(_Handle):
    """Named layers with FP32 parameters (see "Models and layers" in fp8.h). Layer methods return ids."""
    _destroy = "fp8_model_destroy"

    def __init__(self, ctx):
        super().__init__()
        self.ctx = ctx
        # The inputs of the latest forwards (per layer id; None for run), which the backward reads:
        # kept alive here, since the C model holds on to their memory until then.
        self._inputs = {}
        _check(_lib.fp8_model_create(ctypes.byref(self.handle), _arg(ctx, Context, "Model: ctx")))

    def _add(self, fn, name, *args):
        layer_id = _i32()
        _check(getattr(_lib, fn)(self.handle, name.encode(), *args, ctypes.byref(layer_id)))
        return layer_id.value

    def add_linear(self, name, in_features, out_features, bias=True):
        return self._add("fp8_model_add_linear", name, in_features, out_features, int(bias))

    def add_layernorm(self, name, dim, eps=1e-5):
        return self._add("fp8_model_add_layernorm", name, dim, eps)

    def add_rmsnorm(self, name, dim, eps=1e-5):
        return self._add("fp8_model_add_rmsnorm", name, dim, eps)

    def add_activation(self, name, activation):
        return self._add("fp8_model_add_activation", name, activation)

    def parameter(self, name):
        """(value, grad) of "<layer>.<param>": Parameter tensors that keep this model alive and always
        refer to its current storage (FP32, or what an MS-AMP conversion made of a Linear weight)."""
        return Parameter(self, name), Parameter(self, name, grad=True)

    def parameter_names(self):
        """Every parameter's name, in the fixed order of fp8_model_parameter_at (its index)."""
        count, names = _i32(), []
        _check(_lib.fp8_model_parameter_count(self.handle, ctypes.byref(count)))
        for i in range(count.value):
            name = ctypes.c_char_p()
            _check(_lib.fp8_model_parameter_at(self.handle, i, ctypes.byref(name), None, None))
            names.append(name.value.decode())
        return names

    def write_parameter(self, name_or_index, values):
        """Writes F32 host values (a list, tuple or array of floats; a buffer of C floats such as
        array('f') goes as it is) into a parameter, named or by index, in whatever form the model
        stores it: as they are at FP32, rounded to nearest even into an F16 weight (O1/O2), into the
        F16 master and its E4M3 copy at O3 (fp8_model_write_parameter)."""
        if isinstance(name_or_index, str):
            names = self.parameter_names()
            if name_or_index not in names:
                self.parameter(name_or_index)  # raises Fp8Error naming it, as fp8_model_parameter does
            index = names.index(name_or_index)
        else:
            index = name_or_index
        try:
            view = memoryview(values)
            data = view.tobytes() if view.format == "f" and view.itemsize == 4 else None
        except TypeError:
            data = None
        if data is None:
            values = list(values)
            data = struct.pack(f"{len(values)}f", *values)
        buf = ctypes.create_string_buffer(data, len(data))
        _check(_lib.fp8_model_write_parameter(self.handle, index, DTYPE_F32, buf, len(data)))

    def storage_level(self):
        """0 (FP32 Linear weights) or OPT_O1..OPT_O3: the level fp8_convert_model set from the recipe
        (backend te: 0; msamp or auto: its opt_level)."""
        level = _i32()
        _check(_lib.fp8_model_storage_level(self.handle, ctypes.byref(level)))
        return level.value

    def flat_storage(self, role, dtype):
        """(address, nbytes) of the model's flat allocation of `role` (STORAGE_VALUES, STORAGE_GRADS,
        STORAGE_MASTERS) holding `dtype`: device memory on a CUDA context, host memory on the CPU
        backend; borrowed from the model (keep it alive while you use the address). (0, 0) when the
        model stores nothing of that kind. A parameter's slice starts at its tensor's address."""
        data, nbytes = _p(), _size()
        _check(_lib.fp8_model_flat_storage(self.handle, role, dtype, ctypes.byref(data), ctypes.byref(nbytes)))
        return (data.value or 0, nbytes.value)

    def convert(self, recipe=None):
        """To FP8 under `recipe`; back to high precision with recipe=None (weights kept)."""
        if recipe is None:
            opts = (ctypes.c_uint32 * 5)(20, 0, 1, 1, 1)  # fp8_convert_options_t with to_fp8 = 0
            _check(_lib.fp8_convert_model(self.handle, None, ctypes.cast(opts, _p)))
        else:
            _check(_lib.fp8_convert_model(self.handle, _arg(recipe, Recipe, "Model.convert: recipe"), None))

    @property
    def has_fp8_layers(self):
        v = _i32()
        _check(_lib.fp8_model_has_fp8_layers(self.handle, ctypes.byref(v)))
        return bool(v.value)

    def train(self, training=True):
        _check(_lib.fp8_model_set_training(self.handle, int(training)))

    def zero_grad(self):
        _check(_lib.fp8_model_zero_grad(self.handle))

    def weights_changed(self):
        _check(_lib.fp8_model_weights_changed(self.handle))

    def autocast(self):
        """with model.autocast(): ... — FP8 inside; the scaling states are updated on exit."""
        model = self

        class _Region:
            def __enter__(self):
                _check(_lib.fp8_autocast_begin(model.handle))

            def __exit__(self, *exc):
                _check(_lib.fp8_autocast_end(model.handle))

        return _Region()

    def set_autowrap(self, on=True):
        """Every forward outside `with model.autocast()` becomes a region of its own (apply_fp8_autowrap)."""
        _check(_lib.fp8_model_set_autowrap(self.handle, int(on)))

    def forward(self, layer_id, x, y):
        """One layer: y = layer(x). x is kept (the layer's backward reads it)."""
        _check(_lib.fp8_layer_forward(self.handle, layer_id, _arg(x, Tensor, "Model.forward: x"),
                                      _arg(y, Tensor, "Model.forward: y")))
        self._inputs[layer_id] = x

    def backward(self, layer_id, dy, dx=None):
        _check(_lib.fp8_layer_backward(self.handle, layer_id, _arg(dy, Tensor, "Model.backward: dy"),
                                       _arg(dx, Tensor, "Model.backward: dx", True)))

    def forward_saved(self, layer_id, x, y):
        """y = layer(x), returning the Saved state of exactly this forward (fp8_layer_forward_saved):
        any number may be in flight, each differentiated once, in any order, by backward_saved."""
        x_handle, y_handle = _arg(x, Tensor, "Model.forward_saved: x"), _arg(y, Tensor, "Model.forward_saved: y")
        saved = Saved(self, layer_id, x)
        _check(_lib.fp8_layer_forward_saved(self.handle, layer_id, x_handle, y_handle, ctypes.byref(saved.handle)))
        if not saved.needs_input:
            saved.x = None  # an FP8 Linear's state kept x's FP8 copy: x may go
        return saved

    def backward_saved(self, layer_id, saved, dy, dx=None, accumulate_dx=False):
        """Backward of the forward that made `saved` (fp8_layer_backward_saved); dx=None only for a
        Linear whose input needs no gradient; accumulate_dx: dx += the input gradient. Consumes
        `saved` (a second backward of it raises FP8_ERR_INVALID_STATE)."""
        w = "Model.backward_saved: "
        _check(_lib.fp8_layer_backward_saved(self.handle, layer_id, _arg(saved, Saved, w + "saved"),
                                             _arg(dy, Tensor, w + "dy"), _arg(dx, Tensor, w + "dx", True),
                                             BACKWARD_ACCUMULATE_DX if accumulate_dx else 0))
        saved.x = None  # consumed: the C state no longer reads x

    def save_checkpoint(self, path, optimizer=None, gradients=False):
        """Everything needed to resume (fp8_checkpoint_save), written atomically."""
        w = "Model.save_checkpoint"
        _check(_lib.fp8_checkpoint_save(self.handle, _arg(optimizer, Optimizer, w + ": optimizer", True),
                                        _path(path, w), CHECKPOINT_GRADIENTS if gradients else 0))

    def load_checkpoint(self, path, optimizer=None):
        """All or nothing (fp8_checkpoint_load)."""
        w = "Model.load_checkpoint"
        _check(_lib.fp8_checkpoint_load(self.handle, _arg(optimizer, Optimizer, w + ": optimizer", True),
                                        _path(path, w)))

    def export_safetensors(self, path):
        _check(_lib.fp8_model_export_safetensors(self.handle, _path(path, "Model.export_safetensors")))

    def import_safetensors(self, path, part=False):
        """Every parameter from a safetensors file; part=True: a file that may hold other tensors
        too (fp8_model_import_safetensors_part). All or nothing."""
        f = _lib.fp8_model_import_safetensors_part if part else _lib.fp8_model_import_safetensors
        _check(f(self.handle, _path(path, "Model.import_safetensors")))

    def run(self, x, y):
        """The whole model, layers in order (fp8_model_forward). x is kept (the backward reads it)."""
        _check(_lib.fp8_model_forward(self.handle, _arg(x, Tensor, "Model.run: x"), _arg(y, Tensor, "Model.run: y")))
        self._inputs[None] = x

    def run_backward(self, dy, dx=None):
        """Backward of the latest run (fp8_model_backward); dx=None when the input needs no gradient."""
        _check(_lib.fp8_model_backward(self.handle, _arg(dy, Tensor, "Model.run_backward: dy"),
                                       _arg(dx, Tensor, "Model.run_backward: dx", True)))

    def report(self):
        return _text(lambda buf, cap, needed: _lib.fp8_model_report(self.handle, buf, cap, needed))

    def set_comm(self, comm):
        """Data-parallel over `comm` (collective: every rank calls it), or single-rank with None."""
        _check(_lib.fp8_model_set_comm(self.handle, _arg(comm, Comm, "Model.set_comm: comm", True)))
        self.comm = comm  # the model uses the communicator until it goes

    def sync_grads(self):
        _check(_lib.fp8_model_sync_grads(self.handle))

    def set_backward_sync(self, on):
        """on: each backward is the step's last, and its buckets are exchanged during it (DDP's default);
        off for all micro-batches of an accumulation but the last (DDP's no_sync)."""
        _check(_lib.fp8_model_set_backward_sync(self.handle, 1 if on else 0))

    def set_bucket_bytes(self, nbytes):
        """Gradient bytes per communication bucket; before set_comm."""
        _check(_lib.fp8_model_set_bucket_bytes(self.handle, nbytes))


class Comm(_Handle):
    """One rank's end of a group (see "Data parallelism" in fp8.h). Comm.local(ctxs) makes every rank
    of a group inside this process, comms[k] on ctxs[k]; each rank's calls then come from its own
    thread (ctypes lets go of the GIL during every call, so ranks on threads run together)."""
    _destroy = "fp8_comm_destroy"

    @classmethod
    def local(cls, ctxs):
        handles = (_p * len(ctxs))()
        ctx_handles = [_arg(c, Context, f"Comm.local: ctxs[{k}]").value for k, c in enumerate(ctxs)]
        _check(_lib.fp8_comm_create_local(handles, (_p * len(ctxs))(*ctx_handles), len(ctxs)))
        comms = []
        for k, ctx in enumerate(ctxs):
            c = cls.__new__(cls)
            _Handle.__init__(c)
            c.handle, c.ctx = _p(handles[k]), ctx
            comms.append(c)
        return comms

    @property
    def rank(self):
        v = _i32()
        _check(_lib.fp8_comm_rank(self.handle, ctypes.byref(v)))
        return v.value

    @property
    def size(self):
        v = _i32()
        _check(_lib.fp8_comm_size(self.handle, ctypes.byref(v)))
        return v.value

    def abort(self):
        _check(_lib.fp8_comm_abort(self.handle))

    @property
    def timeout(self):
        """Seconds a wait for the group may last before the group is aborted (0: forever)."""
        v = ctypes.c_double()
        _check(_lib.fp8_comm_get_timeout(self.handle, ctypes.byref(v)))
        return v.value

    @timeout.setter
    def timeout(self, seconds):
        _check(_lib.fp8_comm_set_timeout(self.handle, float(seconds)))


class Saved(_Handle):
    """What one forward of a layer keeps for its backward (fp8_saved_t), from Model.forward_saved.

    It holds its Model and, where the C backward reads it (needs_input), the forward's input x,
    which must stay unchanged until then (x is let go once the backward has run). fp8_saved_destroy
    runs when this object goes, consumed or not.
    """
    _destroy = "fp8_saved_destroy"

    def __init__(self, model, layer_id, x):
        super().__init__()
        self.model, self.layer_id, self.x = model, layer_id, x

    @property
    def needs_input(self):
        """Whether the backward reads the forward's x (fp8_saved_needs_input)."""
        return saved_needs_input(self.handle)


def saved_needs_input(handle):
    """fp8_saved_needs_input of an fp8_saved_t handle: whether its backward reads the forward's x."""
    v = _i32()
    _check(_lib.fp8_saved_needs_input(handle, ctypes.byref(v)))
    return bool(v.value)


class LayerReport(ctypes.Structure):
    """fp8_layer_report_t."""
    _fields_ = [("struct_size", ctypes.c_uint32), ("kind", _i32), ("converted", _i32), ("fprop", _i32),
                ("dgrad", _i32), ("wgrad", _i32), ("fp8_calls", _i64), ("fallback_calls", _i64),
                ("reason", ctypes.c_char * 200), ("scaling", _i32), ("reserved", _i32)]


def layer_report(model, layer_id):
    r = LayerReport(struct_size=ctypes.sizeof(LayerReport))
    _check(_lib.fp8_layer_get_report(_arg(model, Model, "layer_report: model"), layer_id, ctypes.byref(r)))
    return r


class OptimizerStats(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("steps", _i64), ("skipped_steps", _i64),
                ("last_skipped", _i32), ("last_grad_norm", _f32), ("parameters", _i64), ("state_bytes", _i64),
                ("opt_level", _i32), ("training_bytes", _i64)]


class Optimizer(_Handle):
    """SGD, Adam or AdamW over every parameter of `model` (see "Optimizer" in fp8.h).

        opt = fp8.Optimizer(model, fp8.OPTIMIZER_ADAMW, lr=1e-3, max_grad_norm=1.0)
        opt.step(); opt.zero_grad(); opt["lr"] = 5e-4; opt.stats().skipped_steps
    """
    _destroy = "fp8_optimizer_destroy"
    _attrs = {"lr": OPTIM_LR, "beta1": OPTIM_BETA1, "beta2": OPTIM_BETA2, "eps": OPTIM_EPS,
              "weight_decay": OPTIM_WEIGHT_DECAY, "momentum": OPTIM_MOMENTUM, "max_grad_norm": OPTIM_MAX_GRAD_NORM}

    def __init__(self, model, kind=OPTIMIZER_ADAMW, **attrs):
        super().__init__()
        self.model = model  # the optimizer must not outlive its model
        _check(_lib.fp8_optimizer_create(ctypes.byref(self.handle), _arg(model, Model, "Optimizer: model"), kind))
        for name, value in attrs.items():
            self[name] = value

    def _attr(self, name):
        if name not in self._attrs:
            raise KeyError(f"Optimizer: no hyper-parameter {name!r}; expected one of {', '.join(self._attrs)}")
        return self._attrs[name]

    def __setitem__(self, name, value):
        _check(_lib.fp8_optimizer_set_float(self.handle, self._attr(name), value))

    def __getitem__(self, name):
        v = ctypes.c_double()
        _check(_lib.fp8_optimizer_get_float(self.handle, self._attr(name), ctypes.byref(v)))
        return v.value

    def step(self):
        _check(_lib.fp8_optimizer_step(self.handle))

    def step_joint(self, other_sumsq, clip_coef=None):
        """One step under one clip over the model's gradients and others (fp8_optimizer_step_joint):
        other_sumsq, a one-element F32 Tensor holding their sum of squares; clip_coef (optional) a
        one-element F32 Tensor that receives the clip factor for them (clip_grad_norm_'s, also when
        a non-finite norm skips the step: 0 for inf, NaN for NaN)."""
        w = "Optimizer.step_joint: "
        _check(_lib.fp8_optimizer_step_joint(self.handle, _arg(other_sumsq, Tensor, w + "other_sumsq"),
                                             _arg(clip_coef, Tensor, w + "clip_coef", True)))

    def zero_grad(self):
        _check(_lib.fp8_optimizer_zero_grad(self.handle))

    def stats(self):
        s = OptimizerStats(struct_size=ctypes.sizeof(OptimizerStats))
        _check(_lib.fp8_optimizer_get_stats(self.handle, ctypes.byref(s)))
        return s
