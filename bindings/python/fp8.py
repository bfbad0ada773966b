"""The ctypes binding's old name: everything of the package `libfp8` (bindings/python/libfp8),
private names included, so that `import fp8` keeps working."""
import libfp8 as _libfp8

globals().update({k: v for k, v in vars(_libfp8).items() if not (k.startswith("__") and k.endswith("__"))})
