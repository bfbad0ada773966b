//! Trains an MLP on Fashion-MNIST in bf16 and in FP8 at each optimizer level, with libfp8 alone,
//! and compares the runs: the Rust port of examples/train_fashion_mnist.c, through the safe `fp8`
//! crate. It prints the same lines and the same table, and on the CPU reference backend with the
//! same settings the same numbers (tests/example_matches_c.rs checks it).
//!
//!   784 -> fc1 -> LayerNorm -> GELU -> fc2 -> LayerNorm -> GELU -> fc3 -> 10 classes
//!
//! The data are the gzip IDX files of Debian's dataset-fashion-mnist package. Rust's standard
//! library has no inflater and fp8.h offers no data reader, so this program runs the system's
//! `gzip -dc` on each file (the C example reads them with zlib). The loss (softmax cross-entropy)
//! is computed here, on the host, exactly as the C example does (same float and double steps, same
//! splitmix64 initialisation and Fisher-Yates shuffle), so the runs see the same weights and
//! batches.
//!
//!   cargo run --release --example train_fashion_mnist -- [--data DIR] [--epochs N] [--batch N]
//!       [--hidden N] [--lr X] [--seed N] [--train-limit N] [--test-limit N] [--cpu]
//!       [--max-accuracy-gap PP] [--levels te,O1,O2,O3] [--ranks N]
//!
//! As in the C example: on a GPU that can run FP8 it trains the full set; elsewhere it runs on the
//! CPU reference backend with a smaller model, batch and epoch count (and says so). --ranks N
//! trains every run data-parallel over N ranks, each on a thread of its own (`fp8::Rank`). One
//! process per rank (the C example's --rank/--world-size/--id-file and torchrun) is not ported.
//! Missing data files make it exit with status 77; --max-accuracy-gap makes it exit with status 2
//! when an FP8 run's test accuracy trails bf16's by more than PP points.

use fp8::{Activation, Comm, Context, DType, Model, OptimAttr, Optimizer, OptimizerKind, Rank, Recipe, Tensor};
use std::cell::Cell;
use std::io::Write;
use std::process::Command;
use std::sync::{Barrier, Mutex};
use std::time::Instant;

const PIXELS: usize = 784;
const CLASSES: usize = 10;

/* ---- failing ------------------------------------------------------------------------------- */

thread_local! {
    /// With several ranks, the calling thread's rank, for the error messages.
    static RANK: Cell<Option<i32>> = const { Cell::new(None) };
}
static FIRST_FAILURE: Mutex<()> = Mutex::new(());

extern "C" {
    /// libc's _exit: ends the process without running exit handlers, which other ranks' threads,
    /// still inside libfp8, must not see (the C example does the same).
    fn _exit(status: i32) -> !;
}

/// Prints the failed call, its status and libfp8's message, the rank first when there are
/// several, and ends the process (the first rank to fail ends it for all).
fn fail(call: &str, err: &fp8::Error) -> ! {
    match RANK.with(|r| r.get()) {
        None => {
            eprintln!("{call} failed: {err}");
            std::process::exit(1);
        }
        Some(rank) => {
            std::mem::forget(FIRST_FAILURE.lock()); // never unlocked: the others wait here
            eprintln!("rank {rank}: {call} failed: {err}");
            let _ = std::io::stdout().flush();
            unsafe { _exit(1) }
        }
    }
}

macro_rules! check {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(err) => fail(stringify!($e), &err),
        }
    };
}

/* ---- data ---------------------------------------------------------------------------------- */

struct Dataset {
    count: usize,
    pixels: Vec<u8>, // count x 784
    labels: Vec<u8>, // count
}

fn big_endian32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// Reads a gzip IDX file whose magic is `magic` (2051 images, 2049 labels) through `gzip -dc`;
/// returns the payload and the item count, or exits with a message that says what to do.
fn read_idx(dir: &str, name: &str, magic: u32) -> (Vec<u8>, usize) {
    let path = format!("{dir}/{name}");
    if std::fs::File::open(&path).is_err() {
        eprintln!(
            "cannot open {path}\nInstall the data (sudo apt-get install dataset-fashion-mnist) or pass --data DIR."
        );
        std::process::exit(77);
    }
    let out = match Command::new("gzip").arg("-dc").arg(&path).output() {
        Ok(out) => out,
        Err(e) => {
            eprintln!("cannot run `gzip -dc {path}` to decompress it: {e}");
            std::process::exit(1);
        }
    };
    if !out.status.success() {
        eprintln!("`gzip -dc {path}` failed: {}", String::from_utf8_lossy(&out.stderr).trim());
        std::process::exit(1);
    }
    let data = out.stdout;
    let header_bytes = if magic == 2051 { 16 } else { 8 };
    if data.len() < header_bytes || big_endian32(&data) != magic {
        eprintln!("{path} is not an IDX file with magic {magic}");
        std::process::exit(1);
    }
    let items = big_endian32(&data[4..]) as usize;
    if magic == 2051 && (big_endian32(&data[8..]) != 28 || big_endian32(&data[12..]) != 28) {
        eprintln!("{path} holds {}x{} images; expected 28x28", big_endian32(&data[8..]), big_endian32(&data[12..]));
        std::process::exit(1);
    }
    let bytes = items * if magic == 2051 { PIXELS } else { 1 };
    if data.len() < header_bytes + bytes {
        eprintln!("{path}: truncated (expected {bytes} bytes of data)");
        std::process::exit(1);
    }
    (data[header_bytes..header_bytes + bytes].to_vec(), items)
}

fn load(dir: &str, images: &str, labels: &str, limit: i64) -> Dataset {
    let (pixels, count) = read_idx(dir, images, 2051);
    let (labels_data, n_labels) = read_idx(dir, labels, 2049);
    if n_labels != count {
        eprintln!("{images} has {count} images but {labels} has {n_labels} labels");
        std::process::exit(1);
    }
    let count = if limit > 0 && (limit as usize) < count { limit as usize } else { count };
    Dataset { count, pixels, labels: labels_data }
}

/* ---- small helpers ------------------------------------------------------------------------- */

/// splitmix64.
fn rng_next(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9E3779B97F4A7C15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
    z ^ (z >> 31)
}

fn rng_uniform(s: &mut u64) -> f64 {
    (rng_next(s) >> 11) as f64 / 9007199254740992.0
}

/// Round to nearest even.
fn bf16_from_float(f: f32) -> u16 {
    let mut u = f.to_bits();
    if (u & 0x7FFFFFFF) > 0x7F800000 {
        return ((u >> 16) | 0x40) as u16;
    }
    u = u.wrapping_add(0x7FFF + ((u >> 16) & 1));
    (u >> 16) as u16
}

fn float_from_bf16(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

fn bf16_tensor(ctx: &Context, rows: usize, cols: usize) -> Tensor<'_> {
    check!(Tensor::new(ctx, DType::BF16, &[rows as i64, cols as i64]))
}

/// Fashion-MNIST's pixel mean and standard deviation (of x / 255 over the training set).
fn fill_batch(d: &Dataset, index: &[i64], x: &mut [u16]) {
    for (i, &ix) in index.iter().enumerate() {
        let image = &d.pixels[ix as usize * PIXELS..(ix as usize + 1) * PIXELS];
        for (p, &v) in image.iter().enumerate() {
            x[i * PIXELS + p] = bf16_from_float(((v as f64 / 255.0 - 0.2860) / 0.3530) as f32);
        }
    }
}

/// Softmax cross-entropy of bf16 logits: returns the summed loss, writes dlogits = (p - onehot) / n
/// in bf16 (the mean's gradient) when dlogits is given, and counts correct argmaxes.
fn cross_entropy(
    logits: &[u16],
    labels: &[u8],
    index: &[i64],
    mut dlogits: Option<&mut [u16]>,
    correct: &mut i64,
) -> f64 {
    let n = index.len();
    let mut loss = 0.0f64;
    for i in 0..n {
        let mut z = [0.0f64; CLASSES];
        let (mut max, mut sum) = (f64::NEG_INFINITY, 0.0f64);
        let mut best = 0;
        let y = labels[index[i] as usize] as usize;
        for c in 0..CLASSES {
            z[c] = float_from_bf16(logits[i * CLASSES + c]) as f64;
            if z[c] > max {
                max = z[c];
                best = c;
            }
        }
        for zc in z {
            sum += (zc - max).exp();
        }
        loss += sum.ln() - (z[y] - max);
        *correct += (best == y) as i64;
        if let Some(d) = dlogits.as_deref_mut() {
            for c in 0..CLASSES {
                let onehot = if c == y { 1.0 } else { 0.0 };
                d[i * CLASSES + c] = bf16_from_float((((z[c] - max).exp() / sum - onehot) / n as f64) as f32);
            }
        }
    }
    loss
}

/// C's printf("%.*f") for finite values and glibc's spelling of the others.
fn fixed(x: f64, width: usize, precision: usize) -> String {
    let s = if x.is_nan() {
        if x.is_sign_negative() {
            "-nan".to_string()
        } else {
            "nan".to_string()
        }
    } else if x.is_infinite() {
        if x < 0.0 {
            "-inf".to_string()
        } else {
            "inf".to_string()
        }
    } else {
        format!("{x:.precision$}")
    };
    format!("{s:>width$}")
}

/// C's printf("%g") (6 significant digits).
fn general(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return fixed(x, 0, 0);
    }
    let p = 6i32;
    let e = format!("{:.*e}", (p - 1) as usize, x);
    let (mantissa, exponent) = e.split_once('e').unwrap();
    let exponent: i32 = exponent.parse().unwrap();
    let strip = |s: &str| -> String {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s.to_string()
        }
    };
    if exponent < -4 || exponent >= p {
        format!("{}e{}{:02}", strip(mantissa), if exponent < 0 { '-' } else { '+' }, exponent.abs())
    } else {
        strip(&format!("{:.*}", (p - 1 - exponent) as usize, x))
    }
}

/* ---- the model and one training run -------------------------------------------------------- */

#[derive(Clone, Copy)]
struct Settings {
    epochs: i32,
    batch: i32,
    hidden: i32,
    lr: f64,
    seed: u64,
}

#[derive(Clone, Default)]
struct RunResult {
    test_accuracy: f64,
    final_loss: f64,
    seconds_per_epoch: f64,
    samples_per_second: f64,
    bytes_per_parameter: f64,
    checksum: u64, // of the weights at the end (weights_checksum)
    report: String,
}

/// The FP8 runs: a name for --levels and the table, and the recipe text that selects it.
struct Level {
    name: &'static str,
    recipe: &'static str,
}
const LEVELS: [Level; 4] = [
    Level { name: "te", recipe: "backend=te" },
    Level { name: "O1", recipe: "backend=msamp, opt_level=O1" },
    Level { name: "O2", recipe: "backend=msamp, opt_level=O2" },
    Level { name: "O3", recipe: "backend=msamp, opt_level=O3" },
];

/// The ranks as this process sees them: one alone, or several on threads meeting at the end of
/// each epoch with their summed loss and correct count ([(epoch - 1) * size + rank]).
struct Group {
    size: usize,
    threads: bool,
    epoch: Barrier,
    loss: Mutex<Vec<f64>>,
    correct: Mutex<Vec<i64>>,
}

fn build_model<'c>(ctx: &'c Context, s: &Settings) -> Model<'c> {
    let h = s.hidden as i64;
    let mut rng = s.seed;
    let mut m = check!(Model::new(ctx));
    check!(m.add_linear("fc1", PIXELS as i64, h, true));
    check!(m.add_layernorm("ln1", h, 1e-5));
    check!(m.add_activation("gelu1", Activation::Gelu));
    check!(m.add_linear("fc2", h, h, true));
    check!(m.add_layernorm("ln2", h, 1e-5));
    check!(m.add_activation("gelu2", Activation::Gelu));
    check!(m.add_linear("fc3", h, CLASSES as i64, true));
    // PyTorch's default Linear initialisation: U(-1/sqrt(in), 1/sqrt(in)) for weights and biases.
    // LayerNorms keep gamma = 1, beta = 0.
    for i in 0..check!(m.parameter_count()) {
        let p = check!(m.parameter_at(i));
        if !p.name.starts_with("fc") {
            continue;
        }
        let fan_in = if p.name.as_bytes()[2] == b'1' { PIXELS as f64 } else { h as f64 };
        let n = check!(p.value.numel()) as usize;
        let v: Vec<f32> = (0..n).map(|_| ((2.0 * rng_uniform(&mut rng) - 1.0) / fan_in.sqrt()) as f32).collect();
        check!(p.value.copy_from_host(&v));
    }
    m
}

fn evaluate(ctx: &Context, m: &Model<'_>, test: &Dataset) -> f64 {
    const EVAL_BATCH: usize = 1000;
    let mut x = vec![0u16; EVAL_BATCH * PIXELS];
    let mut logits = vec![0u16; EVAL_BATCH * CLASSES];
    let index: Vec<i64> = (0..test.count as i64).collect();
    let mut correct = 0i64;
    check!(m.set_training(false));
    for i in (0..test.count).step_by(EVAL_BATCH) {
        let n = (test.count - i).min(EVAL_BATCH);
        let mut xt = bf16_tensor(ctx, n, PIXELS);
        let mut yt = bf16_tensor(ctx, n, CLASSES);
        fill_batch(test, &index[i..i + n], &mut x);
        check!(xt.copy_from_host(&x[..n * PIXELS]));
        check!(m.forward(&xt, &mut yt)); // FP8 is off in eval (use_autocast_during_eval = 0)
        check!(yt.copy_to_host(&mut logits[..n * CLASSES]));
        cross_entropy(&logits, &test.labels, &index[i..i + n], None, &mut correct);
    }
    check!(m.set_training(true));
    100.0 * correct as f64 / test.count as f64
}

/// FNV-1a over the bytes of every parameter's value as stored (F32, F16 or E4M3): ranks that
/// hold the same weights give the same number.
fn weights_checksum(m: &Model<'_>) -> u64 {
    let mut h: u64 = 14695981039346656037;
    for i in 0..check!(m.parameter_count()) {
        let p = check!(m.parameter_at(i));
        for b in check!(p.value.to_vec::<u8>()) {
            h = (h ^ b as u64).wrapping_mul(1099511628211);
        }
    }
    h
}

/// One run on one rank: bf16 when level is None, else FP8 at that level. Rank 0 prints and
/// evaluates.
#[allow(clippy::too_many_arguments)]
fn train(
    rank: usize,
    ctx: &Context,
    comm: Option<&Comm<'_>>,
    g: &Group,
    s: &Settings,
    train_set: &Dataset,
    test: &Dataset,
    level: Option<&Level>,
) -> RunResult {
    let fp8 = level.is_some();
    let lead = rank == 0;
    let label = level.map_or("bf16", |l| l.name);
    // This rank's share of every batch: b examples from rank * b. The last partial batch is dropped.
    let b = s.batch as usize / g.size;
    let steps = train_set.count / s.batch as usize;
    let mut m = build_model(ctx, s);
    let mut x = bf16_tensor(ctx, b, PIXELS);
    let mut y = bf16_tensor(ctx, b, CLASSES);
    let mut dy = bf16_tensor(ctx, b, CLASSES);
    let mut xh = vec![0u16; b * PIXELS];
    let mut yh = vec![0u16; b * CLASSES];
    let mut dyh = vec![0u16; b * CLASSES];
    let mut order: Vec<i64> = (0..train_set.count as i64).collect();
    let mut shuffle_rng = s.seed ^ 0x5EED;
    let mut total_seconds = 0.0f64;
    let mut r = RunResult::default();

    if let Some(level) = level {
        // TransformerEngine's recipe as Accelerate configures it, except that these layers are
        // too small for FP8 to pay off on an H100, where libfp8 would run them in bf16 by itself:
        // the small-layer fallback is turned off so that this run really trains in FP8.
        let mut recipe = check!(Recipe::new());
        check!(recipe.parse("fp8_format=HYBRID, small_layer_fallback=0"));
        check!(recipe.parse(level.recipe));
        check!(m.convert(&recipe)); // Linear, LayerNorm and activation layers
    }
    // Data-parallel from here (collective: every rank, converted the same way, before its optimizer).
    if let Some(comm) = comm {
        check!(m.set_comm(Some(comm)));
        // One backward per step: each gradient bucket is exchanged as soon as the backward wrote it.
        check!(m.set_backward_sync(true));
    }
    let mut opt = check!(Optimizer::new(&m, OptimizerKind::AdamW));
    check!(opt.set(OptimAttr::Lr, s.lr));
    check!(opt.set(OptimAttr::MaxGradNorm, 1.0));

    for epoch in 1..=s.epochs {
        let (mut loss, mut correct) = (0.0f64, 0i64);
        let mut seen = steps * b;
        let start = Instant::now();
        for i in (1..train_set.count).rev() {
            // Fisher-Yates, the same order for every run and rank
            let j = (rng_next(&mut shuffle_rng) % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        for step in 0..steps {
            let at = step * s.batch as usize + rank * b;
            let index = &order[at..at + b];
            fill_batch(train_set, index, &mut xh);
            check!(x.copy_from_host(&xh));
            if fp8 {
                check!(m.autocast_begin()); // contextual_fp8_autocast
            }
            let pass = check!(m.forward(&x, &mut y));
            if fp8 {
                check!(m.autocast_end()); // one batched update of the forward scaling states
            }
            check!(y.copy_to_host(&mut yh));
            // The mean over this rank's b examples; the step averages it over the ranks: the batch's mean.
            loss += cross_entropy(&yh, &train_set.labels, index, Some(&mut dyh), &mut correct);
            check!(dy.copy_from_host(&dyh));
            check!(pass.backward(&dy, None)); // updates the gradient scaling states at its end
            check!(opt.step()); // averages the gradients across the ranks first
            check!(opt.zero_grad());
        }
        check!(ctx.synchronize());
        if g.threads {
            // rank 0 adds up every rank's examples
            let at = (epoch as usize - 1) * g.size;
            g.loss.lock().unwrap()[at + rank] = loss;
            g.correct.lock().unwrap()[at + rank] = correct;
            g.epoch.wait();
            loss = g.loss.lock().unwrap()[at..at + g.size].iter().sum();
            correct = g.correct.lock().unwrap()[at..at + g.size].iter().sum();
            seen = steps * s.batch as usize;
        }
        let seconds = start.elapsed().as_secs_f64();
        total_seconds += seconds;
        if !lead {
            continue;
        }
        r.report = check!(m.report()); // what training did, before eval
        let accuracy = evaluate(ctx, &m, test); // rank 0's model: every rank's weights
        r.final_loss = loss / seen as f64;
        r.test_accuracy = accuracy;
        println!(
            "{:<4}  epoch {}/{}  loss {}  train acc {}%  test acc {}%  {} s  {} samples/s",
            label,
            epoch,
            s.epochs,
            fixed(r.final_loss, 0, 4),
            fixed(100.0 * correct as f64 / seen as f64, 5, 2),
            fixed(accuracy, 5, 2),
            fixed(seconds, 6, 2),
            fixed((steps * s.batch as usize) as f64 / seconds, 8, 0)
        );
        let _ = std::io::stdout().flush();
    }
    r.seconds_per_epoch = total_seconds / s.epochs as f64;
    r.samples_per_second = (steps * s.batch as usize) as f64 / r.seconds_per_epoch;
    let st = check!(opt.stats());
    if st.skipped_steps != 0 && lead {
        println!("{}  {} steps skipped for non-finite gradients", label, st.skipped_steps);
    }
    r.bytes_per_parameter = st.training_bytes as f64 / st.parameters as f64;
    r.checksum = weights_checksum(&m);
    r
}

/// One run on every rank (on their threads with --ranks N) and rank 0's result. With ranks on
/// threads, also says whether they ended with the same weights; sets `differ` if not.
#[allow(clippy::too_many_arguments)]
fn run(
    g: &Group,
    ranks: &mut [Rank],
    single: Option<&Context>,
    s: &Settings,
    train_set: &Dataset,
    test: &Dataset,
    level: Option<&Level>,
    differ: &mut bool,
) -> RunResult {
    if let Some(ctx) = single {
        return train(0, ctx, None, g, s, train_set, test, level);
    }
    let results: Vec<RunResult> = std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .iter_mut()
            .map(|r| {
                scope.spawn(move || {
                    RANK.with(|c| c.set(Some(r.rank())));
                    train(r.rank() as usize, r.context(), Some(r.comm()), g, s, train_set, test, level)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank's thread panicked")).collect()
    });
    let same = results.iter().all(|r| r.checksum == results[0].checksum);
    println!(
        "{:<4}  weights identical on all {} ranks: {}",
        level.map_or("bf16", |l| l.name),
        g.size,
        if same { "yes" } else { "no" }
    );
    let _ = std::io::stdout().flush();
    if !same {
        *differ = true;
    }
    results.into_iter().next().unwrap()
}

/* ---- main ---------------------------------------------------------------------------------- */

/// The value of option `name` at args[*i] ("--name value" or "--name=value"), if it is that option.
fn option(args: &[String], i: &mut usize, name: &str) -> Option<String> {
    let a = &args[*i];
    let rest = a.strip_prefix(name)?;
    if let Some(v) = rest.strip_prefix('=') {
        return Some(v.to_string());
    }
    if !rest.is_empty() {
        return None;
    }
    if *i + 1 >= args.len() {
        eprintln!("{name} needs a value");
        std::process::exit(1);
    }
    *i += 1;
    Some(args[*i].clone())
}

/// C's atoll: the leading whole number, 0 if there is none.
fn leading_int(s: &str) -> i64 {
    let t = s.trim_start();
    let end = t
        .char_indices()
        .find(|&(k, c)| !(c.is_ascii_digit() || (k == 0 && (c == '-' || c == '+'))))
        .map_or(t.len(), |(k, _)| k);
    t[..end].parse().unwrap_or(0)
}

fn whole_number(name: &str, v: &str) -> usize {
    match v.parse::<u64>() {
        Ok(n) if n <= 1 << 30 => n as usize,
        _ => {
            eprintln!("{name} {v}: expected a whole number");
            std::process::exit(1);
        }
    }
}

fn print_row(
    label: &str,
    width: usize,
    precision: usize,
    value: fn(&RunResult) -> f64,
    bf16: &RunResult,
    runs: &[Option<RunResult>],
) {
    print!("\n{label:<26} {}", fixed(value(bf16), width, precision));
    for r in runs.iter().flatten() {
        print!(" {}", fixed(value(r), width, precision));
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mut data =
        std::env::var("FASHION_MNIST_DIR").unwrap_or_else(|_| "/usr/share/datasets/fashion-mnist".to_string());
    let (mut epochs, mut batch, mut hidden): (Option<String>, Option<String>, Option<String>) = (None, None, None);
    let mut s = Settings { epochs: 0, batch: 0, hidden: 0, lr: 1e-3, seed: 1234 };
    let (mut train_limit, mut test_limit) = (0i64, 0i64);
    let mut force_cpu = false;
    let mut ranks = 1usize;
    let mut max_gap = -1.0f64;
    let mut chosen = [true; 4];

    let mut i = 1;
    while i < args.len() {
        if args[i] == "--cpu" {
            force_cpu = true;
        } else if let Some(v) = option(&args, &mut i, "--data") {
            data = v;
        } else if let Some(v) = option(&args, &mut i, "--epochs") {
            epochs = Some(v);
        } else if let Some(v) = option(&args, &mut i, "--batch") {
            batch = Some(v);
        } else if let Some(v) = option(&args, &mut i, "--hidden") {
            hidden = Some(v);
        } else if let Some(v) = option(&args, &mut i, "--lr") {
            s.lr = v.trim().parse().unwrap_or(0.0);
        } else if let Some(v) = option(&args, &mut i, "--seed") {
            s.seed = v.trim().parse().unwrap_or(0);
        } else if let Some(v) = option(&args, &mut i, "--train-limit") {
            train_limit = leading_int(&v);
        } else if let Some(v) = option(&args, &mut i, "--test-limit") {
            test_limit = leading_int(&v);
        } else if let Some(v) = option(&args, &mut i, "--max-accuracy-gap") {
            max_gap = v.trim().parse().unwrap_or(0.0);
        } else if let Some(v) = option(&args, &mut i, "--ranks") {
            ranks = whole_number("--ranks", &v);
        } else if let Some(v) = option(&args, &mut i, "--levels") {
            let names: Vec<&str> = v.split(',').collect();
            for (k, level) in LEVELS.iter().enumerate() {
                chosen[k] = names.contains(&level.name);
            }
            if !chosen.iter().any(|&c| c) {
                eprintln!("--levels {v} names no level; expected a comma-separated list of te, O1, O2, O3");
                std::process::exit(1);
            }
        } else if ["--rank", "--world-size", "--id-file"]
            .iter()
            .any(|o| args[i] == *o || args[i].starts_with(&format!("{o}=")))
        {
            eprintln!(
                "{}: one process per rank is not in the Rust port; use --ranks N (threads) or the C example",
                args[i]
            );
            std::process::exit(1);
        } else {
            eprintln!("unknown argument '{}' (see the comment at the top of train_fashion_mnist.rs)", args[i]);
            std::process::exit(1);
        }
        i += 1;
    }
    if ranks < 1 {
        eprintln!("--ranks must be at least 1");
        std::process::exit(1);
    }
    for env in ["FP8_WORLD_SIZE", "WORLD_SIZE"] {
        if std::env::var(env).ok().and_then(|v| v.parse::<i64>().ok()).is_some_and(|n| n > 1) {
            eprintln!(
                "{env} asks for one process per rank, which the Rust port does not do: use --ranks N or the C example"
            );
            std::process::exit(1);
        }
    }
    let size = ranks;

    let devices = check!(fp8::device_count());
    let info = if devices > 0 { fp8::device_info(0).ok() } else { None };
    let on_gpu = !force_cpu && info.as_ref().is_some_and(|i| i.fp8_gemm);
    // --ranks N: GPUs 0 .. N-1 if each can run FP8, else all on GPU 0.
    let mut gpus = 0usize;
    if on_gpu {
        gpus = 1;
        while gpus < size && (gpus as i32) < devices {
            match fp8::device_info(gpus as i32) {
                Ok(other) if other.fp8_gemm => gpus += 1,
                _ => break,
            }
        }
    }
    // Defaults: on the CPU reference backend a smaller model and fewer epochs (the full set still).
    s.epochs = epochs.map_or(if on_gpu { 5 } else { 1 }, |v| leading_int(&v) as i32);
    s.batch = batch.map_or(if on_gpu { 256 } else { 128 }, |v| leading_int(&v) as i32);
    s.hidden = hidden.map_or(if on_gpu { 1024 } else { 128 }, |v| leading_int(&v) as i32);
    #[allow(clippy::neg_cmp_op_on_partial_ord)] // as the C example: a NaN lr is refused too
    let bad_lr = !(s.lr > 0.0);
    if s.epochs < 1 || s.batch < 1 || s.hidden < 1 || bad_lr {
        eprintln!("--epochs, --batch, --hidden and --lr must be positive");
        std::process::exit(1);
    }
    if s.batch as usize % size != 0 {
        eprintln!(
            "--batch {} does not split evenly over {size} ranks (each takes batch / ranks examples of every batch): pass a multiple of {size}",
            s.batch
        );
        std::process::exit(1);
    }

    let train_set = load(&data, "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", train_limit);
    let test = load(&data, "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", test_limit);
    if train_set.count < s.batch as usize {
        eprintln!("--batch {} is larger than the {} training images", s.batch, train_set.count);
        std::process::exit(1);
    }

    // The contexts: one alone, or a rank each (context and communicator) for the threads.
    let device_of = |k: usize| {
        if !on_gpu {
            fp8::sys::FP8_DEVICE_CPU
        } else if gpus >= size {
            k as i32
        } else {
            0
        }
    };
    let (single, mut held) = if size == 1 {
        (Some(check!(Context::new(device_of(0)))), Vec::new())
    } else {
        let contexts: Vec<Context> = (0..size).map(|k| check!(Context::new(device_of(k)))).collect();
        // NCCL on a GPU each, else the in-process transport
        (None, check!(Rank::local_group(contexts)))
    };
    let g = Group {
        size,
        threads: size > 1,
        epoch: Barrier::new(size),
        loss: Mutex::new(vec![0.0; s.epochs as usize * size]),
        correct: Mutex::new(vec![0; s.epochs as usize * size]),
    };

    let name = info.as_ref().map_or(String::new(), |i| i.name.clone());
    if on_gpu {
        if size == 1 {
            println!("device: {name} (GPU 0)");
        } else if gpus >= size {
            println!("device: {name} (GPUs 0-{}, one per rank)", size - 1);
        } else {
            println!(
                "device: {name} (GPU 0)\nnote: {size} ranks but {gpus} GPU(s) that can run FP8: the ranks share GPU 0 and exchange through host memory (libfp8's in-process transport: slow, but the same results)"
            );
        }
    } else {
        println!(
            "device: libfp8's CPU reference backend ({}); smaller settings unless given: hidden {}, batch {}, {} epoch(s)",
            if force_cpu { "--cpu" } else { "no CUDA GPU that can run FP8 here" },
            s.hidden,
            s.batch,
            s.epochs
        );
    }
    println!("data: {data} ({} training, {} test images)", train_set.count, test.count);
    if size > 1 {
        println!(
            "data parallel: {size} ranks ({}), each taking {} consecutive examples of every shuffled batch of {}; rank 0 evaluates",
            if on_gpu && gpus >= size {
                "threads of this process, joined by NCCL"
            } else {
                "threads of this process, joined by libfp8's in-process transport"
            },
            s.batch as usize / size,
            s.batch
        );
    }
    println!(
        "model: 784 -> {} -> LayerNorm -> GELU -> {} -> LayerNorm -> GELU -> 10; AdamW lr {}, clip 1.0, batch {}, {} epoch(s), seed {}\n",
        s.hidden,
        s.hidden,
        general(s.lr),
        s.batch,
        s.epochs,
        s.seed
    );

    let mut differ = false;
    let bf16 = run(&g, &mut held, single.as_ref(), &s, &train_set, &test, None, &mut differ);
    let mut runs: Vec<Option<RunResult>> = vec![None, None, None, None];
    for (k, level) in LEVELS.iter().enumerate() {
        if chosen[k] {
            runs[k] = Some(run(&g, &mut held, single.as_ref(), &s, &train_set, &test, Some(level), &mut differ));
        }
    }

    print!("\n{:<26} {:>10}", "", "bf16");
    for (k, level) in LEVELS.iter().enumerate() {
        if chosen[k] {
            print!(" {:>10}", level.name);
        }
    }
    print_row("test accuracy (%)", 10, 2, |r| r.test_accuracy, &bf16, &runs);
    print_row("final training loss", 10, 4, |r| r.final_loss, &bf16, &runs);
    print_row("training bytes / parameter", 10, 1, |r| r.bytes_per_parameter, &bf16, &runs);
    print_row("seconds per epoch", 10, 3, |r| r.seconds_per_epoch, &bf16, &runs);
    print_row("samples per second", 10, 0, |r| r.samples_per_second, &bf16, &runs);
    println!(
        "\n(bf16: FP32 weights and AdamW states; bytes count weights, masters, gradients and Adam's m and v, biases and norms included)"
    );
    if let Some(k) = (0..LEVELS.len()).rev().find(|&k| chosen[k]) {
        print!(
            "\nFP8 model at {}, per layer, as its last training step ran (evaluation runs in bf16, as Accelerate's use_autocast_during_eval = 0 asks):\n{}",
            LEVELS[k].name,
            runs[k].as_ref().unwrap().report
        );
    }

    drop(held); // communicators, then contexts
    drop(single);
    let mut failed = false;
    for (k, level) in LEVELS.iter().enumerate() {
        if let Some(r) = &runs[k] {
            if max_gap >= 0.0 && bf16.test_accuracy - r.test_accuracy > max_gap {
                println!(
                    "FAIL: FP8 at {}: test accuracy {:.2} points below bf16 (allowed: {max_gap:.2})",
                    level.name,
                    bf16.test_accuracy - r.test_accuracy
                );
                failed = true;
            }
        }
    }
    if differ {
        println!("FAIL: the ranks ended a run with different weights (see above)");
        failed = true;
    }
    let _ = std::io::stdout().flush();
    std::process::exit(if failed { 2 } else { 0 });
}
