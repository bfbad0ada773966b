//! Cargo passes link arguments of a build script only to the targets of its own package, so the
//! rpath fp8-sys's build script sets for its tests is added here again for this package's tests
//! and examples, from the directory fp8-sys found libfp8 in (DEP_FP8_LIB_DIR, as `links = "fp8"`
//! exports it): they then run without LD_LIBRARY_PATH.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_FP8_LIB_DIR");
    if let Ok(dir) = std::env::var("DEP_FP8_LIB_DIR") {
        if !dir.is_empty() {
            // Tests, examples, binaries and benchmarks of this package.
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
    }
}
