//! The Rust port of the Fashion-MNIST example against the C one: on the CPU reference backend with
//! the same settings both must print the same output (every epoch line and table row, the model
//! report, the data and model lines) except the timings (seconds and samples per second).
//!
//! The C program is FP8_C_EXAMPLE, else build/release/examples/train_fashion_mnist of this
//! repository. The Rust one is built here (`cargo build --example train_fashion_mnist`, the same
//! profile and target directory as this test), so that it is never stale. Without the C program
//! or the data (the C program exits 77), each test prints a line starting with "SKIP:" and passes;
//! CTest's rust_example_matches_c reports that as skipped.

use std::path::{Path, PathBuf};
use std::process::Command;

fn c_example() -> Option<PathBuf> {
    let p = match std::env::var_os("FP8_C_EXAMPLE") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../build/release/examples/train_fashion_mnist"),
    };
    p.exists().then_some(p)
}

/// Builds the example with this test's profile into this test's target directory; its path.
fn rust_example() -> PathBuf {
    // This test runs from <target>/<profile>/deps/.
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>").to_path_buf();
    let target_dir = profile_dir.parent().expect("target").to_path_buf();
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "--offline", "--quiet", "--example", "train_fashion_mnist", "--manifest-path"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", &target_dir);
    if profile_dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    let status = cmd.status().expect("run cargo build --example train_fashion_mnist");
    assert!(status.success(), "cargo build --example train_fashion_mnist failed");
    profile_dir.join("examples").join("train_fashion_mnist")
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn run(program: &Path, args: &[&str]) -> Run {
    let out =
        Command::new(program).args(args).output().unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The output without what differs from run to run: the timing at the end of each epoch line
/// ("   0.28 s      7410 samples/s") and the two timing rows of the table.
fn comparable(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter(|l| !l.starts_with("seconds per epoch") && !l.starts_with("samples per second"))
        .map(|l| match (l.contains("  epoch "), l.rfind("% ")) {
            (true, Some(at)) if l.ends_with(" samples/s") => l[..at + 1].to_string(),
            _ => l.to_string(),
        })
        .collect()
}

fn compare(args: &[&str]) {
    let Some(c) = c_example() else {
        println!("SKIP: the C example is not built (set FP8_C_EXAMPLE or build build/release)");
        return;
    };
    let c_run = run(&c, args);
    if c_run.code == 77 {
        println!("SKIP: {}", c_run.stderr.lines().next().unwrap_or("the C example skipped (exit 77)"));
        return;
    }
    assert_eq!(c_run.code, 0, "{} {args:?} failed:\n{}", c.display(), c_run.stderr);
    let rust = rust_example();
    let r_run = run(&rust, args);
    assert_eq!(r_run.code, 0, "{} {args:?} failed:\n{}", rust.display(), r_run.stderr);

    let (cl, rl) = (comparable(&c_run.stdout), comparable(&r_run.stdout));
    // There must be numbers to compare: epoch lines and the table.
    let epochs = cl.iter().filter(|l| l.contains("  epoch ")).count();
    let table = cl.iter().any(|l| l.starts_with("test accuracy (%)"))
        && cl.iter().any(|l| l.starts_with("final training loss"));
    assert!(epochs >= 1 && table, "the C example printed no epoch lines or no table:\n{}", c_run.stdout);
    let mut diffs = Vec::new();
    for k in 0..cl.len().max(rl.len()) {
        let (a, b) = (cl.get(k).map_or("<none>", |s| s.as_str()), rl.get(k).map_or("<none>", |s| s.as_str()));
        if a != b {
            diffs.push(format!("line {}:\n    C:    {a}\n    Rust: {b}", k + 1));
        }
    }
    assert!(
        diffs.is_empty(),
        "train_fashion_mnist {}: the Rust example's output differs from the C example's in {} line(s):\n{}\n\nC output:\n{}\nRust output:\n{}",
        args.join(" "),
        diffs.len(),
        diffs.join("\n"),
        c_run.stdout,
        r_run.stdout
    );
    println!(
        "train_fashion_mnist {}: the C and Rust examples print the same {} lines ({epochs} epoch lines, the table, \
         the report), timings aside",
        args.join(" "),
        cl.len()
    );
}

#[test]
fn same_numbers_as_c() {
    compare(&["--cpu", "--epochs", "1", "--hidden", "64", "--train-limit", "2048", "--test-limit", "1000"]);
}

#[test]
fn same_numbers_as_c_with_two_ranks_on_threads() {
    compare(&[
        "--cpu",
        "--ranks",
        "2",
        "--epochs",
        "1",
        "--hidden",
        "64",
        "--train-limit",
        "2048",
        "--test-limit",
        "1000",
        "--levels",
        "O1,O3",
    ]);
}

#[test]
fn comparable_drops_only_timings() {
    let line = "bf16  epoch 1/1  loss 1.5886  train acc 54.10%  test acc 72.20%    0.28 s      7410 samples/s";
    assert_eq!(comparable(line), vec!["bf16  epoch 1/1  loss 1.5886  train acc 54.10%  test acc 72.20%"]);
    assert_eq!(comparable("seconds per epoch   0.1\ntest accuracy (%)  72.20"), vec!["test accuracy (%)  72.20"]);
}
