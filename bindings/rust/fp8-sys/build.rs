//! Finds libfp8 and links it: FP8_LIB_DIR if set, else the directory `pkg-config --libs-only-L fp8`
//! names when pkg-config finds fp8, else this repository's build/release. Emits an rpath to that
//! directory so that this crate's tests run without LD_LIBRARY_PATH, and passes the directory on
//! to dependents as DEP_FP8_LIB_DIR (cargo does not forward link arguments to other packages, so
//! the `fp8` crate's build script adds the same rpath for its own tests and examples).
use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=FP8_LIB_DIR");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo:rerun-if-changed=build.rs");

    let (dir, from) = if let Some(dir) = env::var_os("FP8_LIB_DIR").filter(|d| !d.is_empty()) {
        (Some(PathBuf::from(dir)), "FP8_LIB_DIR")
    } else if let Some(dir) = pkg_config_dir() {
        (dir, "pkg-config")
    } else {
        let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
        (Some(manifest.join("../../../build/release")), "the repository's build/release")
    };

    match dir {
        Some(dir) => {
            let dir = dir.canonicalize().unwrap_or(dir);
            if !dir.join("libfp8.so").exists() && !dir.join("libfp8.dylib").exists() {
                println!(
                    "cargo:warning=libfp8 not found in {} (from {from}); build it (cmake --build build/release) \
                     or set FP8_LIB_DIR",
                    dir.display()
                );
            }
            println!("cargo:rerun-if-changed={}", dir.join("libfp8.so").display());
            println!("cargo:rustc-link-search=native={}", dir.display());
            // For this crate's own tests; the `fp8` crate repeats it from DEP_FP8_LIB_DIR.
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
            println!("cargo:lib_dir={}", dir.display());
        }
        // pkg-config found fp8 in a directory the linker searches anyway: no -L, no rpath.
        None => println!("cargo:lib_dir="),
    }
    // The shared library (the directory may hold libfp8.a too).
    println!("cargo:rustc-link-lib=dylib=fp8");
}

/// `Some(Some(dir))`: pkg-config found fp8 in `dir`; `Some(None)`: found, without a -L (a system
/// directory); `None`: pkg-config is missing or does not know fp8.
fn pkg_config_dir() -> Option<Option<PathBuf>> {
    let out = Command::new("pkg-config").args(["--libs-only-L", "fp8"]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    Some(text.split_whitespace().find_map(|w| w.strip_prefix("-L")).map(PathBuf::from))
}
