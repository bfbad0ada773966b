"""libfp8 from Python through ctypes: no compiled glue, only the C ABI of include/fp8.h.

The module mirrors the header's constants and wraps the calls in a few small classes that own their
handles. Every failing call raises Fp8Error carrying the status and fp8_last_error_message().

    import fp8
    ctx = fp8.Context(fp8.DEVICE_CPU)
    recipe = fp8.Recipe("fp8_format=E4M3, margin=1")
    print(recipe)                                  # the full text form

The shared library is found through FP8_LIBRARY (a path), else the loader's usual search for
libfp8.so.0.
"""
import ctypes
import os
import struct

_lib = ctypes.CDLL(os.environ.get("FP8_LIBRARY", "libfp8.so.0"))

# Pinned values of fp8.h, named as there without the FP8_ prefix (test_fp8.py checks every one
# against the header).
OK = 0
ERR_BUFFER_TOO_SMALL = 13
DEVICE_CPU = -1
DTYPE_F32, DTYPE_F16, DTYPE_BF16, DTYPE_E4M3, DTYPE_E5M2 = 0, 1, 2, 3, 4
ROLE_FORWARD, ROLE_BACKWARD = 0, 1
(RECIPE_BACKEND, RECIPE_OPT_LEVEL, RECIPE_MARGIN, RECIPE_INTERVAL, RECIPE_FP8_FORMAT, RECIPE_AMAX_HISTORY_LEN,
 RECIPE_AMAX_COMPUTE_ALGO, RECIPE_OVERRIDE_FPROP, RECIPE_OVERRIDE_DGRAD, RECIPE_OVERRIDE_WGRAD,
 RECIPE_USE_AUTOCAST_DURING_EVAL, RECIPE_SMALL_LAYER_FALLBACK) = range(12)
FORMAT_E4M3, FORMAT_HYBRID = 0, 1
ACTIVATION_RELU, ACTIVATION_GELU, ACTIVATION_SWIGLU = 0, 1, 2
NORM_LAYERNORM, NORM_RMSNORM = 0, 1

_p = ctypes.c_void_p
_i32, _i64, _u8, _f32, _size = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint8, ctypes.c_float, ctypes.c_size_t


def _declare(name, restype, *argtypes):
    fn = getattr(_lib, name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


_declare("fp8_version_string", ctypes.c_char_p)
_declare("fp8_status_string", ctypes.c_char_p, _i32)
_declare("fp8_last_error_message", ctypes.c_char_p)
_declare("fp8_encode", _u8, _f32, _i32)
_declare("fp8_decode", _f32, _u8, _i32)
_declare("fp8_dtype_size", _size, _i32)
for _name, _args in {
    "fp8_context_create": (ctypes.POINTER(_p), _i32),
    "fp8_recipe_create": (ctypes.POINTER(_p),),
    "fp8_recipe_set_int": (_p, _i32, _i64),
    "fp8_recipe_get_int": (_p, _i32, ctypes.POINTER(_i64)),
    "fp8_recipe_parse": (_p, ctypes.c_char_p),
    "fp8_recipe_to_string": (_p, ctypes.c_char_p, _size, ctypes.POINTER(_size)),
    "fp8_tensor_create": (ctypes.POINTER(_p), _p, _i32, _i32, ctypes.POINTER(_i64)),
    "fp8_tensor_copy_from_host": (_p, _p, _size),
    "fp8_tensor_copy_to_host": (_p, _p, _size),
    "fp8_tensor_get_scale_inv": (_p, ctypes.POINTER(_f32)),
    "fp8_scaling_create": (ctypes.POINTER(_p), _p, _p, _i32),
    "fp8_scaling_set_scale": (_p, _f32),
    "fp8_scaling_update": (_p, ctypes.POINTER(_p), _i32, _p),
    "fp8_quantize": (_p, _p, _p, _p, _p),
    "fp8_dequantize": (_p, _p, _p),
    "fp8_activation_forward": (_p, _i32, _p, _p, _p),
    "fp8_gemm": (_p, _p, _p, _p, _p, _p, _p),
}.items():
    _declare(_name, _i32, *_args)
for _name in ["fp8_context_destroy", "fp8_recipe_destroy", "fp8_tensor_destroy", "fp8_scaling_destroy"]:
    _declare(_name, None, _p)


class Fp8Error(RuntimeError):
    def __init__(self, status):
        self.status = status
        self.status_name = _lib.fp8_status_string(status).decode()
        super().__init__(f"{self.status_name}: {_lib.fp8_last_error_message().decode()}")


def _check(status):
    if status != OK:
        raise Fp8Error(status)


def version():
    return _lib.fp8_version_string().decode()


def encode(x, dtype=DTYPE_E4M3):
    return _lib.fp8_encode(x, dtype)


def decode(code, dtype=DTYPE_E4M3):
    return _lib.fp8_decode(code, dtype)


class _Handle:
    _destroy = None

    def __init__(self):
        self.handle = _p()

    def __del__(self):
        if getattr(self, "handle", None) and self.handle.value:
            getattr(_lib, self._destroy)(self.handle)
            self.handle = _p()


class Context(_Handle):
    _destroy = "fp8_context_destroy"

    def __init__(self, device=DEVICE_CPU):
        super().__init__()
        _check(_lib.fp8_context_create(ctypes.byref(self.handle), device))


class Recipe(_Handle):
    _destroy = "fp8_recipe_destroy"

    def __init__(self, text=""):
        super().__init__()
        _check(_lib.fp8_recipe_create(ctypes.byref(self.handle)))
        if text:
            self.parse(text)

    def parse(self, text):
        _check(_lib.fp8_recipe_parse(self.handle, text.encode()))

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
        self.ctx, self.dtype, self.shape = ctx, dtype, tuple(shape)
        dims = (_i64 * len(shape))(*shape)
        _check(_lib.fp8_tensor_create(ctypes.byref(self.handle), ctx.handle, dtype, len(shape), dims))
        self.nbytes = _lib.fp8_dtype_size(dtype)
        for d in shape:
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
    def scale_inv(self):
        v = _f32()
        _check(_lib.fp8_tensor_get_scale_inv(self.handle, ctypes.byref(v)))
        return v.value


class Scaling(_Handle):
    _destroy = "fp8_scaling_destroy"

    def __init__(self, ctx, recipe, role=ROLE_FORWARD):
        super().__init__()
        self.ctx = ctx
        _check(_lib.fp8_scaling_create(ctypes.byref(self.handle), ctx.handle, recipe.handle, role))

    def set_scale(self, scale):
        _check(_lib.fp8_scaling_set_scale(self.handle, scale))


def quantize(ctx, x, out, scaling, out_transposed=None):
    _check(_lib.fp8_quantize(ctx.handle, x.handle, out.handle, out_transposed.handle if out_transposed else None,
                             scaling.handle))


def dequantize(ctx, q, out):
    _check(_lib.fp8_dequantize(ctx.handle, q.handle, out.handle))


def scaling_update(ctx, states, recipe):
    arr = (_p * len(states))(*[s.handle.value for s in states])
    _check(_lib.fp8_scaling_update(ctx.handle, arr, len(states), recipe.handle))


def gemm(ctx, a, b, d, bias=None, d_scaling=None):
    """d = a * b^T (+ bias), the default options (see fp8_gemm in fp8.h)."""
    _check(_lib.fp8_gemm(ctx.handle, a.handle, b.handle, bias.handle if bias else None, d.handle,
                         d_scaling.handle if d_scaling else None, None))


def activation_forward(ctx, activation, x, y, y_scaling=None):
    _check(_lib.fp8_activation_forward(ctx.handle, activation, x.handle, y.handle,
                                       y_scaling.handle if y_scaling else None))
