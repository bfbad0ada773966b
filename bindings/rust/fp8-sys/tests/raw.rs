//! The raw layer against the library actually loaded: the version, the status names, the dtype
//! table, one context and one tensor through the raw calls.

use fp8_sys::*;
use std::ffi::CStr;
use std::ptr;

fn text(p: *const std::ffi::c_char) -> String {
    assert!(!p.is_null());
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[test]
fn version_matches_header() {
    assert_eq!(unsafe { fp8_version_number() }, FP8_VERSION_NUMBER);
    let expected = format!("{FP8_VERSION_MAJOR}.{FP8_VERSION_MINOR}.{FP8_VERSION_PATCH}");
    assert_eq!(text(unsafe { fp8_version_string() }), expected);
}

#[test]
fn status_names_match_constants() {
    let codes = [
        (FP8_OK, "FP8_OK"),
        (FP8_ERR_INVALID_ARGUMENT, "FP8_ERR_INVALID_ARGUMENT"),
        (FP8_ERR_DTYPE, "FP8_ERR_DTYPE"),
        (FP8_ERR_SHAPE, "FP8_ERR_SHAPE"),
        (FP8_ERR_INVALID_STATE, "FP8_ERR_INVALID_STATE"),
        (FP8_ERR_OUT_OF_MEMORY, "FP8_ERR_OUT_OF_MEMORY"),
        (FP8_ERR_CUDA, "FP8_ERR_CUDA"),
        (FP8_ERR_CUBLAS, "FP8_ERR_CUBLAS"),
        (FP8_ERR_NCCL, "FP8_ERR_NCCL"),
        (FP8_ERR_UNSUPPORTED, "FP8_ERR_UNSUPPORTED"),
        (FP8_ERR_IO, "FP8_ERR_IO"),
        (FP8_ERR_CORRUPT, "FP8_ERR_CORRUPT"),
        (FP8_ERR_VERSION, "FP8_ERR_VERSION"),
        (FP8_ERR_BUFFER_TOO_SMALL, "FP8_ERR_BUFFER_TOO_SMALL"),
        (FP8_ERR_NO_DEVICE, "FP8_ERR_NO_DEVICE"),
        (FP8_ERR_INTERNAL, "FP8_ERR_INTERNAL"),
    ];
    for (code, name) in codes {
        assert_eq!(text(unsafe { fp8_status_string(code) }), name);
    }
    assert_eq!(text(unsafe { fp8_status_string(1000) }), "FP8_ERR_UNKNOWN");
}

#[test]
fn dtypes() {
    let table = [
        (FP8_DTYPE_F32, 4, "f32"),
        (FP8_DTYPE_F16, 2, "f16"),
        (FP8_DTYPE_BF16, 2, "bf16"),
        (FP8_DTYPE_E4M3, 1, "e4m3"),
        (FP8_DTYPE_E5M2, 1, "e5m2"),
    ];
    for (dtype, size, name) in table {
        assert_eq!(unsafe { fp8_dtype_size(dtype) }, size);
        assert_eq!(text(unsafe { fp8_dtype_name(dtype) }), name);
    }
    assert_eq!(unsafe { fp8_encode(448.0, FP8_DTYPE_E4M3) }, 0x7E);
    assert_eq!(unsafe { fp8_decode(0x7E, FP8_DTYPE_E4M3) }, 448.0);
}

#[test]
fn context_and_tensor_through_the_raw_calls() {
    unsafe {
        let mut ctx: *mut fp8_context_t = ptr::null_mut();
        assert_eq!(fp8_context_create(&mut ctx, FP8_DEVICE_CPU), FP8_OK);
        let shape = [2i64, 3];
        let mut t: *mut fp8_tensor_t = ptr::null_mut();
        assert_eq!(fp8_tensor_create(&mut t, ctx, FP8_DTYPE_F32, 2, shape.as_ptr()), FP8_OK);
        let src = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        assert_eq!(fp8_tensor_copy_from_host(t, src.as_ptr().cast(), 24), FP8_OK);
        let mut dst = [0.0f32; 6];
        assert_eq!(fp8_tensor_copy_to_host(t, dst.as_mut_ptr().cast(), 24), FP8_OK);
        assert_eq!(src, dst);
        // A wrong size is refused, with a message naming the call.
        assert_ne!(fp8_tensor_copy_to_host(t, dst.as_mut_ptr().cast(), 20), FP8_OK);
        assert!(text(fp8_last_error_message()).contains("fp8_tensor_copy_to_host"));
        // Versioned structs through their *_init.
        let mut info = std::mem::zeroed::<fp8_device_info_t>();
        fp8_device_info_init(&mut info);
        assert_eq!(info.struct_size as usize, std::mem::size_of::<fp8_device_info_t>());
        assert_eq!(fp8_device_query(FP8_DEVICE_CPU, &mut info), FP8_OK);
        assert_eq!(info.device, FP8_DEVICE_CPU);
        fp8_tensor_destroy(t);
        fp8_context_destroy(ctx);
        fp8_tensor_destroy(ptr::null_mut()); // NULL does nothing
    }
}
