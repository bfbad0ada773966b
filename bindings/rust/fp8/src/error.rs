//! Errors: the status of the failing call and libfp8's message for it.

use fp8_sys as sys;
use std::ffi::{c_char, CStr};
use std::fmt;

/// What went wrong, as libfp8's status codes say (`FP8_ERR_*`; values pinned by fp8.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Status {
    /// NULL where an object is required, value out of range, unknown key.
    InvalidArgument,
    /// A tensor has a dtype the call does not accept.
    Dtype,
    /// A tensor's shape or size does not fit the call.
    Shape,
    /// The call is not allowed in the object's current state.
    InvalidState,
    /// Host or device allocation failed.
    OutOfMemory,
    /// The CUDA runtime reported an error.
    Cuda,
    /// cuBLASLt reported an error.
    Cublas,
    /// NCCL reported an error.
    Nccl,
    /// A valid request this build or device cannot do.
    Unsupported,
    /// A file could not be opened, read or written.
    Io,
    /// Data failed its integrity checks.
    Corrupt,
    /// Data written by a newer, incompatible format version.
    Version,
    /// A caller's buffer is too small.
    BufferTooSmall,
    /// No CUDA device with that ordinal (or no driver).
    NoDevice,
    /// A bug in libfp8.
    Internal,
    /// A code this binding does not know (from a newer libfp8).
    Unknown(i32),
}

impl Status {
    /// The status of a failing code; `None` for `FP8_OK`.
    pub fn from_code(code: i32) -> Option<Status> {
        Some(match code {
            sys::FP8_OK => return None,
            sys::FP8_ERR_INVALID_ARGUMENT => Status::InvalidArgument,
            sys::FP8_ERR_DTYPE => Status::Dtype,
            sys::FP8_ERR_SHAPE => Status::Shape,
            sys::FP8_ERR_INVALID_STATE => Status::InvalidState,
            sys::FP8_ERR_OUT_OF_MEMORY => Status::OutOfMemory,
            sys::FP8_ERR_CUDA => Status::Cuda,
            sys::FP8_ERR_CUBLAS => Status::Cublas,
            sys::FP8_ERR_NCCL => Status::Nccl,
            sys::FP8_ERR_UNSUPPORTED => Status::Unsupported,
            sys::FP8_ERR_IO => Status::Io,
            sys::FP8_ERR_CORRUPT => Status::Corrupt,
            sys::FP8_ERR_VERSION => Status::Version,
            sys::FP8_ERR_BUFFER_TOO_SMALL => Status::BufferTooSmall,
            sys::FP8_ERR_NO_DEVICE => Status::NoDevice,
            sys::FP8_ERR_INTERNAL => Status::Internal,
            other => Status::Unknown(other),
        })
    }

    /// The raw `fp8_status_t`.
    pub fn code(self) -> i32 {
        match self {
            Status::InvalidArgument => sys::FP8_ERR_INVALID_ARGUMENT,
            Status::Dtype => sys::FP8_ERR_DTYPE,
            Status::Shape => sys::FP8_ERR_SHAPE,
            Status::InvalidState => sys::FP8_ERR_INVALID_STATE,
            Status::OutOfMemory => sys::FP8_ERR_OUT_OF_MEMORY,
            Status::Cuda => sys::FP8_ERR_CUDA,
            Status::Cublas => sys::FP8_ERR_CUBLAS,
            Status::Nccl => sys::FP8_ERR_NCCL,
            Status::Unsupported => sys::FP8_ERR_UNSUPPORTED,
            Status::Io => sys::FP8_ERR_IO,
            Status::Corrupt => sys::FP8_ERR_CORRUPT,
            Status::Version => sys::FP8_ERR_VERSION,
            Status::BufferTooSmall => sys::FP8_ERR_BUFFER_TOO_SMALL,
            Status::NoDevice => sys::FP8_ERR_NO_DEVICE,
            Status::Internal => sys::FP8_ERR_INTERNAL,
            Status::Unknown(code) => code,
        }
    }

    /// libfp8's name for it (`fp8_status_string`): "FP8_ERR_SHAPE", "FP8_ERR_UNKNOWN" for codes
    /// the library does not know.
    pub fn name(self) -> &'static str {
        // SAFETY: fp8_status_string is thread safe and returns static storage, never NULL.
        unsafe { static_str(sys::fp8_status_string(self.code())) }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A failed call: its status and the message libfp8 gave for it (`fp8_last_error_message()`,
/// read right after the call on the same thread), or the binding's own message for a request it
/// refused before calling libfp8 (a name with a NUL byte, a host buffer of the wrong size).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    status: Status,
    message: String,
}

impl Error {
    /// The error of a call that just returned `code` on this thread (not FP8_OK).
    pub(crate) fn last(code: i32) -> Error {
        // SAFETY: never NULL; valid until the next failing call on this thread, and copied here.
        let message = unsafe { c_text(sys::fp8_last_error_message()) };
        Error { status: Status::from_code(code).unwrap_or(Status::Unknown(code)), message }
    }

    pub(crate) fn new(status: Status, message: impl Into<String>) -> Error {
        Error { status, message: message.into() }
    }

    pub fn status(&self) -> Status {
        self.status
    }

    /// The raw `fp8_status_t`.
    pub fn code(&self) -> i32 {
        self.status.code()
    }

    /// libfp8's name of the status ("FP8_ERR_SHAPE").
    pub fn status_name(&self) -> &'static str {
        self.status.name()
    }

    /// What was wrong, naming the function and the argument.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status.name(), self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Ok for FP8_OK; else the error with this thread's message, captured now.
pub(crate) fn check(code: sys::fp8_status_t) -> Result<()> {
    if code == sys::FP8_OK {
        Ok(())
    } else {
        Err(Error::last(code))
    }
}

/// The object a successful `fp8_*_create` (named `call`) returned: never NULL by fp8.h's
/// conventions, and an `Internal` error rather than a panic if a library breaks them.
pub(crate) fn created<T>(raw: *mut T, call: &str) -> Result<std::ptr::NonNull<T>> {
    std::ptr::NonNull::new(raw)
        .ok_or_else(|| Error::new(Status::Internal, format!("{call} returned FP8_OK without an object")))
}

/// A copy of a NUL-terminated string (lossy for invalid UTF-8); "" for NULL.
pub(crate) unsafe fn c_text(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

/// A string in libfp8's static storage.
pub(crate) unsafe fn static_str(p: *const c_char) -> &'static str {
    if p.is_null() {
        ""
    } else {
        CStr::from_ptr(p).to_str().unwrap_or("")
    }
}

/// A C string for libfp8, refusing interior NUL bytes.
pub(crate) fn c_string(s: &str, what: &str) -> Result<std::ffi::CString> {
    std::ffi::CString::new(s)
        .map_err(|_| Error::new(Status::InvalidArgument, format!("{what} {s:?} contains a NUL byte")))
}

/// A file name for libfp8 (UTF-8, as fp8.h asks).
pub(crate) fn c_path(path: &std::path::Path) -> Result<std::ffi::CString> {
    let text = path
        .to_str()
        .ok_or_else(|| Error::new(Status::InvalidArgument, format!("path {} is not UTF-8", path.display())))?;
    c_string(text, "path")
}

/// Text from a (buf, cap, needed) getter: asks for the size, then fills a buffer of it.
pub(crate) fn read_text(mut call: impl FnMut(*mut c_char, usize, *mut usize) -> sys::fp8_status_t) -> Result<String> {
    let mut needed = 0usize;
    let status = call(std::ptr::null_mut(), 0, &mut needed);
    if status != sys::FP8_ERR_BUFFER_TOO_SMALL {
        check(status)?;
    }
    let mut buf = vec![0u8; needed.max(1)];
    check(call(buf.as_mut_ptr().cast(), buf.len(), std::ptr::null_mut()))?;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_with_ok_is_an_internal_error_not_a_panic() {
        let err = created(std::ptr::null_mut::<u8>(), "fp8_tensor_create").unwrap_err();
        assert_eq!(err.status(), Status::Internal);
        assert!(err.message().contains("fp8_tensor_create"), "{err}");
        let mut x = 0u8;
        assert!(created(&mut x as *mut u8, "fp8_tensor_create").is_ok());
    }
}
