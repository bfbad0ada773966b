//! The safe layer on the CPU reference backend: errors, recipes, tensors, models, the optimizer,
//! checkpoints, per-layer and saved forwards, data parallelism on threads.

use fp8::*;

fn assert_send<T: Send>() {}
fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn thread_markers() {
    // What fp8.h's threading contract allows (the negative cases are compile_fail doctests in
    // src/lib.rs: tensors, models and optimizers are not Send, nothing is Sync).
    assert_send::<Context>();
    assert_send::<Recipe>();
    assert_send::<Rank>();
    assert_send_sync::<Error>();
}

#[test]
fn errors_carry_status_and_message() {
    let mut r = Recipe::new().unwrap();
    let err = r.parse("no_such_key=1").unwrap_err();
    assert_eq!(err.status(), Status::InvalidArgument);
    assert_eq!(err.code(), sys::FP8_ERR_INVALID_ARGUMENT);
    assert_eq!(err.status_name(), "FP8_ERR_INVALID_ARGUMENT");
    assert!(err.message().contains("no_such_key"), "{err}");
    assert!(err.to_string().starts_with("FP8_ERR_INVALID_ARGUMENT: "), "{err}");
    // The message is this call's, not a later one's.
    let ctx = Context::cpu().unwrap();
    let err2 = Tensor::new(&ctx, DType::F32, &[1; 9]).unwrap_err();
    assert_ne!(err2.message(), err.message());
    assert!(err.message().contains("no_such_key"));
    // The binding's own refusals.
    let err3 = r.parse("margin=1\0").unwrap_err();
    assert_eq!(err3.status(), Status::InvalidArgument);
    assert!(err3.message().contains("NUL"));
    assert_eq!(Status::from_code(0), None);
    assert_eq!(Status::from_code(3), Some(Status::Shape));
    assert_eq!(Status::from_code(99), Some(Status::Unknown(99)));
    assert_eq!(Status::Unknown(99).name(), "FP8_ERR_UNKNOWN");
}

#[test]
fn version_and_devices() {
    assert_eq!(version_number(), sys::FP8_VERSION_NUMBER);
    assert_eq!(version(), format!("{}.{}.{}", sys::FP8_VERSION_MAJOR, sys::FP8_VERSION_MINOR, sys::FP8_VERSION_PATCH));
    let info = device_info(sys::FP8_DEVICE_CPU).unwrap();
    assert_eq!(info.device, sys::FP8_DEVICE_CPU);
    assert!(!info.name.is_empty());
    assert!(device_count().unwrap() >= 0);
    let ctx = Context::cpu().unwrap();
    assert_eq!(ctx.device().unwrap(), sys::FP8_DEVICE_CPU);
    assert!(ctx.stream().unwrap().is_null());
    ctx.synchronize().unwrap();
}

#[test]
fn recipes() {
    let mut r = Recipe::new().unwrap();
    assert_eq!(r.get(RecipeAttr::AmaxHistoryLen).unwrap(), 1024);
    assert_eq!(r.get(RecipeAttr::Fp8Format).unwrap(), sys::FP8_FORMAT_HYBRID as i64);
    r.parse("fp8_format=E4M3, margin=2, amax_compute_algo=max").unwrap();
    assert_eq!(r.get(RecipeAttr::Margin).unwrap(), 2);
    assert_eq!(r.dtype_for(Role::Backward).unwrap(), DType::E4M3);
    r.set(RecipeAttr::Interval, 5).unwrap();
    // Out of range: refused, unchanged.
    let bounds = RecipeAttr::Margin.bounds().unwrap();
    assert_eq!((bounds.min, bounds.max, bounds.default, bounds.key), (0, 32, 0, "margin"));
    assert_eq!(r.set(RecipeAttr::Margin, 33).unwrap_err().status(), Status::InvalidArgument);
    assert_eq!(r.get(RecipeAttr::Margin).unwrap(), 2);
    // Text round trip.
    let text = r.to_text().unwrap();
    assert!(text.contains("margin=2") && text.contains("interval=5"), "{text}");
    let back: Recipe = text.parse().unwrap();
    for attr in RecipeAttr::ALL {
        assert_eq!(back.get(attr).unwrap(), r.get(attr).unwrap(), "{attr:?}");
    }
    assert_eq!(r.to_string(), text);
    // A clone is independent.
    let mut c = r.clone();
    c.set(RecipeAttr::Margin, 0).unwrap();
    assert_eq!(r.get(RecipeAttr::Margin).unwrap(), 2);
    // Moves to another thread (Send).
    let r = std::thread::spawn(move || {
        r.get(RecipeAttr::Margin).unwrap();
        r
    })
    .join()
    .unwrap();
    assert_eq!(r.get(RecipeAttr::Margin).unwrap(), 2);
}

#[test]
fn tensors() {
    let ctx = Context::cpu().unwrap();
    let data: Vec<f32> = (0..12).map(|i| i as f32 * 0.5).collect();
    let mut t = Tensor::from_host(&ctx, DType::F32, &[3, 4], &data).unwrap();
    assert_eq!(t.dtype().unwrap(), DType::F32);
    assert_eq!(t.shape().unwrap(), vec![3, 4]);
    assert_eq!(t.numel().unwrap(), 12);
    assert_eq!(t.nbytes().unwrap(), 48);
    assert_eq!(t.to_vec::<f32>().unwrap(), data);
    // A host buffer of the wrong size is refused and left alone.
    let mut short = [7.0f32; 11];
    assert!(t.copy_to_host(&mut short).is_err());
    assert_eq!(short, [7.0; 11]);
    assert!(t.copy_from_host(&short).is_err());
    assert_eq!(t.to_vec::<u8>().unwrap().len(), 48);
    assert_eq!(t.to_vec::<f64>().unwrap().len(), 6); // 48 bytes hold 6 doubles
    let e = Tensor::new(&ctx, DType::BF16, &[3]).unwrap();
    assert_eq!(e.to_vec::<u32>().unwrap_err().status(), Status::InvalidArgument); // 6 bytes
                                                                                  // 0-d and empty tensors.
    assert_eq!(Tensor::new(&ctx, DType::F32, &[]).unwrap().numel().unwrap(), 1);
    assert_eq!(Tensor::new(&ctx, DType::F32, &[0, 5]).unwrap().numel().unwrap(), 0);
    // Wrapping host memory (CPU backend), checked against the buffer.
    let mut buf = vec![1.0f32; 8];
    {
        let mut w = Tensor::wrap_host(&ctx, DType::F32, &[2, 4], &mut buf).unwrap();
        w.copy_from_host(&[3.0f32; 8]).unwrap();
    }
    assert_eq!(buf, vec![3.0; 8]);
    let mut small = vec![0.0f32; 3];
    assert_eq!(Tensor::wrap_host(&ctx, DType::F32, &[2, 2], &mut small).unwrap_err().status(), Status::Shape);
    // An empty tensor over an empty buffer of any element type (its dangling pointer is not passed).
    let mut none: Vec<u8> = Vec::new();
    assert_eq!(Tensor::wrap_host(&ctx, DType::F32, &[0, 4], &mut none).unwrap().numel().unwrap(), 0);
    assert_eq!(Tensor::wrap_host(&ctx, DType::F32, &[-1], &mut none).unwrap_err().status(), Status::Shape);
    let mut odd = [0u8; 12];
    let start = (0..4).find(|i| (odd.as_ptr() as usize + i) % 4 != 0).unwrap();
    let err = Tensor::wrap_host(&ctx, DType::F32, &[2], &mut odd[start..start + 8]).unwrap_err();
    assert_eq!((err.status(), err.message().contains("aligned")), (Status::InvalidArgument, true));
    // FP8 codes and scale_inv.
    assert_eq!(encode(448.0, DType::E4M3), 0x7E);
    assert_eq!(decode(0x7E, DType::E4M3), 448.0);
    let mut q = Tensor::new(&ctx, DType::E4M3, &[4]).unwrap();
    assert_eq!(q.scale_inv().unwrap(), 1.0);
    q.set_scale_inv(0.5).unwrap();
    assert_eq!(q.scale_inv().unwrap(), 0.5);
    assert_eq!(t.scale_inv().unwrap_err().status(), Status::Dtype);
}

#[test]
fn casts_and_scaling() {
    let ctx = Context::cpu().unwrap();
    let recipe = Recipe::new().unwrap();
    let scaling = Scaling::new(&ctx, &recipe, Role::Forward).unwrap();
    assert_eq!(scaling.dtype().unwrap(), DType::E4M3);
    let x = Tensor::from_host(&ctx, DType::F32, &[2, 3], &[1.0f32, -2.0, 3.0, 0.5, 4.0, -6.0]).unwrap();
    let mut q = Tensor::new(&ctx, DType::E4M3, &[2, 3]).unwrap();
    let mut qt = Tensor::new(&ctx, DType::E4M3, &[3, 2]).unwrap();
    ctx.quantize(&x, &mut q, Some(&mut qt), &scaling).unwrap();
    assert_eq!(scaling.info().unwrap().amax, 6.0);
    let mut back = Tensor::new(&ctx, DType::F32, &[2, 3]).unwrap();
    ctx.dequantize(&q, &mut back).unwrap();
    assert_eq!(back.to_vec::<f32>().unwrap(), vec![1.0, -2.0, 3.0, 0.5, 4.0, -6.0]);
    ctx.scaling_update(&[&scaling], &recipe).unwrap();
    let info = scaling.info().unwrap();
    assert_eq!(info.scale, 448.0 / 6.0);
    assert_eq!(info.update_count, 1);
    assert_eq!(scaling.history().unwrap().len(), 1024);
    // GEMM: D = A B^T in F32.
    let a = Tensor::from_host(&ctx, DType::F32, &[1, 2], &[1.0f32, 2.0]).unwrap();
    let b = Tensor::from_host(&ctx, DType::F32, &[2, 2], &[1.0f32, 0.0, 0.0, 1.0]).unwrap();
    let mut d = Tensor::new(&ctx, DType::F32, &[1, 2]).unwrap();
    ctx.gemm(&a, &b, None, &mut d, None, Some(&GemmOptions { alpha: 2.0, ..GemmOptions::default() })).unwrap();
    assert_eq!(d.to_vec::<f32>().unwrap(), vec![2.0, 4.0]);
    let mut y = Tensor::new(&ctx, DType::F32, &[1, 2]).unwrap();
    ctx.activation_forward(
        Activation::Relu,
        &Tensor::from_host(&ctx, DType::F32, &[1, 2], &[-1.0f32, 2.0]).unwrap(),
        &mut y,
        None,
    )
    .unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![0.0, 2.0]);
}

/// 16 -> 32 -> GELU -> 16, weights from a fixed pattern.
fn small_model(ctx: &Context) -> Model<'_> {
    let mut m = Model::new(ctx).unwrap();
    assert_eq!(m.add_linear("fc1", 16, 32, true).unwrap(), 0);
    assert_eq!(m.add_activation("act", Activation::Gelu).unwrap(), 1);
    assert_eq!(m.add_linear("fc2", 32, 16, true).unwrap(), 2);
    for p in m.parameters().unwrap() {
        let n = p.value.numel().unwrap() as usize;
        let v: Vec<f32> = (0..n).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.02).collect();
        p.value.copy_from_host(&v).unwrap();
    }
    m
}

fn batch(ctx: &Context, seed: usize) -> (Tensor<'_>, Tensor<'_>) {
    let x: Vec<f32> = (0..8 * 16).map(|i| (((i + seed) * 31 % 17) as f32 - 8.0) * 0.1).collect();
    let dy: Vec<f32> = (0..8 * 16).map(|i| (((i + seed) * 13 % 11) as f32 - 5.0) * 0.01).collect();
    (
        Tensor::from_host(ctx, DType::F32, &[8, 16], &x).unwrap(),
        Tensor::from_host(ctx, DType::F32, &[8, 16], &dy).unwrap(),
    )
}

fn values(m: &Model<'_>) -> Vec<Vec<f32>> {
    m.parameters().unwrap().iter().map(|p| p.value.to_vec::<f32>().unwrap()).collect()
}

#[test]
fn model_training_surface() {
    let ctx = Context::cpu().unwrap();
    let mut m = small_model(&ctx);
    assert_eq!(m.layer_count().unwrap(), 3);
    assert_eq!(m.find_layer("fc2").unwrap(), 2);
    assert_eq!(m.layer_name(1).unwrap(), "act");
    assert_eq!(m.find_layer("nope").unwrap_err().status(), Status::InvalidArgument);
    let names: Vec<String> = m.parameters().unwrap().into_iter().map(|p| p.name).collect();
    assert_eq!(names, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]);
    let (w, g) = m.parameter("fc1.weight").unwrap();
    assert_eq!(w.shape().unwrap(), vec![32, 16]);
    assert_eq!(g.dtype().unwrap(), DType::F32);
    m.write_parameter(1, &[0.25f32; 32]).unwrap();
    assert_eq!(m.parameter("fc1.bias").unwrap().0.to_vec::<f32>().unwrap(), vec![0.25; 32]);

    let recipe = Recipe::from_text("backend=te, small_layer_fallback=0").unwrap();
    m.convert(&recipe).unwrap();
    assert!(m.has_fp8_layers().unwrap());
    assert_eq!(m.storage_level().unwrap(), 0);
    // Fetched again: the conversion moved the parameter storage (which is why it takes &mut self
    // and the refs fetched before it cannot live across it).
    let g = m.parameter("fc1.weight").unwrap().1;
    let mut opt = Optimizer::new(&m, OptimizerKind::AdamW).unwrap().with(OptimAttr::Lr, 1e-2).unwrap();
    opt.set(OptimAttr::MaxGradNorm, 1.0).unwrap();
    assert_eq!(opt.get(OptimAttr::Lr).unwrap(), 1e-2);
    assert_eq!(opt.set(OptimAttr::Momentum, 0.9).unwrap_err().status(), Status::InvalidArgument);

    let before = values(&m);
    let mut y = Tensor::new(&ctx, DType::F32, &[8, 16]).unwrap();
    let mut dx = Tensor::new(&ctx, DType::F32, &[8, 16]).unwrap();
    for step in 0..3 {
        let (x, dy) = batch(&ctx, step);
        let region = m.autocast().unwrap();
        let pass = m.forward(&x, &mut y).unwrap();
        region.end().unwrap();
        pass.backward(&dy, Some(&mut dx)).unwrap();
        assert!(g.to_vec::<f32>().unwrap().iter().any(|&v| v != 0.0));
        opt.step().unwrap();
        opt.zero_grad().unwrap();
        assert!(g.to_vec::<f32>().unwrap().iter().all(|&v| v == 0.0));
    }
    assert_ne!(values(&m), before);
    let stats = opt.stats().unwrap();
    assert_eq!((stats.steps, stats.skipped_steps, stats.opt_level), (3, 0, 0));
    assert_eq!(stats.parameters, 16 * 32 + 32 + 32 * 16 + 16);
    let report = m.layer_report(0).unwrap();
    assert_eq!(report.kind, LayerKind::Linear);
    assert!(report.converted);
    assert_eq!(report.fprop, Precision::Fp8);
    assert_eq!(report.fp8_calls, 3);
    assert!(m.report().unwrap().contains("fc2"));
    let input = m.scaling_info(0, ScalingSlot::Input).unwrap().unwrap();
    assert!(input.update_count >= 3 && input.scale > 0.0);
    assert!(m.scaling_info(1, ScalingSlot::Input).unwrap().is_none());

    // A backward without a training forward is refused.
    m.set_training(false).unwrap();
    let (x, dy) = batch(&ctx, 9);
    let pass = m.forward(&x, &mut y).unwrap();
    assert_eq!(pass.backward(&dy, None).unwrap_err().status(), Status::InvalidState);
    m.set_training(true).unwrap();
}

#[test]
fn ms_amp_levels_store_fp8() {
    let ctx = Context::cpu().unwrap();
    let mut m = small_model(&ctx);
    m.convert(&Recipe::from_text("backend=msamp, opt_level=O2, small_layer_fallback=0").unwrap()).unwrap();
    assert_eq!(m.storage_level().unwrap(), 2);
    let (w, g) = m.parameter("fc1.weight").unwrap();
    assert_eq!(w.dtype().unwrap(), DType::F16);
    assert_eq!(g.dtype().unwrap(), DType::E5M2);
    let mut opt = Optimizer::new(&m, OptimizerKind::AdamW).unwrap();
    let (x, dy) = batch(&ctx, 0);
    let mut y = Tensor::new(&ctx, DType::F32, &[8, 16]).unwrap();
    m.set_autowrap(true).unwrap();
    m.forward(&x, &mut y).unwrap().backward(&dy, None).unwrap();
    opt.step().unwrap();
    let stats = opt.stats().unwrap();
    assert_eq!(stats.opt_level, 2);
    assert!(stats.training_bytes < stats.parameters * 16);
    // A joint step: the other gradients' squared norm counts in the clip, and the factor comes back.
    let norm = stats.last_grad_norm as f64;
    opt.set(OptimAttr::MaxGradNorm, 0.5 * norm).unwrap();
    let other = Tensor::from_host(&ctx, DType::F32, &[1], &[(3.0 * norm * norm) as f32]).unwrap();
    let mut coef = Tensor::new(&ctx, DType::F32, &[1]).unwrap();
    opt.step_joint(&other, Some(&mut coef)).unwrap();
    let c = coef.to_vec::<f32>().unwrap()[0] as f64;
    assert!((c - 0.25).abs() < 1e-3, "clip factor {c}: expected 0.5 ||g|| / sqrt(4 ||g||^2)");
}

#[test]
fn checkpoints_resume_exactly() {
    let dir = std::env::temp_dir().join(format!("fp8-rust-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.ckpt");
    let ctx = Context::cpu().unwrap();
    let recipe = Recipe::from_text("backend=msamp, opt_level=O1, small_layer_fallback=0").unwrap();
    let train = |m: &Model<'_>, opt: &mut Optimizer<'_>, steps: std::ops::Range<usize>| {
        let mut y = Tensor::new(&ctx, DType::F32, &[8, 16]).unwrap();
        for step in steps {
            let (x, dy) = batch(&ctx, step);
            m.autocast_begin().unwrap();
            let pass = m.forward(&x, &mut y).unwrap();
            m.autocast_end().unwrap();
            pass.backward(&dy, None).unwrap();
            opt.step().unwrap();
            opt.zero_grad().unwrap();
        }
    };
    // Train 2 steps, save, train 2 more: the reference.
    let mut a = small_model(&ctx);
    a.convert(&recipe).unwrap();
    let mut opt_a = Optimizer::new(&a, OptimizerKind::Adam).unwrap();
    train(&a, &mut opt_a, 0..2);
    a.save_checkpoint(&path, Some(&opt_a), false).unwrap();
    train(&a, &mut opt_a, 2..4);
    // A fresh model built and converted the same way, loaded, trained the same 2 steps.
    let saved_recipe = Recipe::from_checkpoint(&path).unwrap();
    assert_eq!(saved_recipe.get(RecipeAttr::OptLevel).unwrap(), 1);
    let mut b = small_model(&ctx);
    b.convert(&saved_recipe).unwrap();
    let mut opt_b = Optimizer::new(&b, OptimizerKind::Adam).unwrap();
    b.load_checkpoint(&path, Some(&mut opt_b)).unwrap();
    train(&b, &mut opt_b, 2..4);
    let bytes = |m: &Model<'_>| -> Vec<Vec<u8>> {
        m.parameters().unwrap().iter().map(|p| p.value.to_vec::<u8>().unwrap()).collect()
    };
    assert_eq!(bytes(&a), bytes(&b));
    assert_eq!(opt_a.stats().unwrap().steps, opt_b.stats().unwrap().steps);
    // A damaged file is refused, nothing changed.
    std::fs::write(&path, b"not a checkpoint").unwrap();
    let before = bytes(&b);
    assert_eq!(b.load_checkpoint(&path, None).unwrap_err().status(), Status::Corrupt);
    assert_eq!(bytes(&b), before);
    assert_eq!(b.load_checkpoint(dir.join("missing"), None).unwrap_err().status(), Status::Io);
    // safetensors round trip.
    let st = dir.join("model.safetensors");
    b.export_safetensors(&st).unwrap();
    let mut c = small_model(&ctx);
    c.convert(&saved_recipe).unwrap();
    c.import_safetensors(&st).unwrap();
    assert_eq!(bytes(&c), bytes(&b));
    let mut d = small_model(&ctx);
    d.convert(&saved_recipe).unwrap();
    d.import_safetensors_part(&st).unwrap();
    assert_eq!(bytes(&d), bytes(&b));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn per_layer_and_saved_forwards() {
    let ctx = Context::cpu().unwrap();
    let mut m = small_model(&ctx);
    let (x, _) = batch(&ctx, 1);
    let mut h = Tensor::new(&ctx, DType::F32, &[8, 32]).unwrap();
    let dh = Tensor::from_host(&ctx, DType::F32, &[8, 32], &[0.01f32; 8 * 32]).unwrap();
    // The convenience pair.
    let pass = m.layer_forward(0, &x, &mut h).unwrap();
    pass.backward(&dh, None).unwrap();
    let g1 = m.parameter("fc1.weight").unwrap().1.to_vec::<f32>().unwrap();
    m.zero_grad().unwrap();
    // Two forwards in flight, differentiated in reverse order: the same gradient twice.
    let mut h2 = Tensor::new(&ctx, DType::F32, &[8, 32]).unwrap();
    let mut s1 = m.forward_saved(0, &x, &mut h).unwrap();
    let mut s2 = m.forward_saved(0, &x, &mut h2).unwrap();
    // Not converted: the weight gradient runs in high precision from x, which the state reads.
    assert!(s1.needs_input().unwrap());
    m.backward_saved(0, &mut s2, &dh, None, DxMode::Write).unwrap();
    assert!(!s2.needs_input().unwrap(), "a consumed state reads nothing");
    m.backward_saved(0, &mut s1, &dh, None, DxMode::Write).unwrap();
    let g2 = m.parameter("fc1.weight").unwrap().1.to_vec::<f32>().unwrap();
    for (a, b) in g1.iter().zip(&g2) {
        assert!((2.0 * a - b).abs() <= 1e-6 * a.abs().max(1e-3), "{a} {b}");
    }
    // A second backward of one forward is refused.
    assert_eq!(m.backward_saved(0, &mut s1, &dh, None, DxMode::Write).unwrap_err().status(), Status::InvalidState);
    // A conversion after the forward. A state borrows x, not the model, so it can live across a
    // conversion (which takes &mut self); libfp8 refuses its backward. Both directions.
    let mut s = m.forward_saved(0, &x, &mut h).unwrap();
    m.convert(&Recipe::from_text("backend=te, small_layer_fallback=0").unwrap()).unwrap();
    let err = m.backward_saved(0, &mut s, &dh, None, DxMode::Write).unwrap_err();
    assert_eq!(err.status(), Status::InvalidState, "{err}");
    let mut s = m.forward_saved(0, &x, &mut h).unwrap();
    m.to_high_precision().unwrap();
    let err = m.backward_saved(0, &mut s, &dh, None, DxMode::Write).unwrap_err();
    assert_eq!(err.status(), Status::InvalidState, "{err}");
    // A fresh forward after the conversion is differentiated as usual.
    let mut s = m.forward_saved(0, &x, &mut h).unwrap();
    m.backward_saved(0, &mut s, &dh, None, DxMode::Write).unwrap();
}

#[test]
fn ranks_on_threads_stay_identical() {
    let contexts = vec![Context::cpu().unwrap(), Context::cpu().unwrap()];
    let mut ranks = Rank::local_group(contexts).unwrap();
    assert_eq!(ranks.len(), 2);
    let results: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter_mut()
            .map(|rank| {
                s.spawn(move || {
                    let ctx = rank.context();
                    assert_eq!(rank.comm().rank().unwrap(), rank.rank());
                    assert_eq!(rank.comm().size().unwrap(), 2);
                    let mut m = small_model(ctx);
                    m.convert(&Recipe::from_text("backend=msamp, opt_level=O3, small_layer_fallback=0").unwrap())
                        .unwrap();
                    m.set_comm(Some(rank.comm())).unwrap();
                    let mut opt = Optimizer::new(&m, OptimizerKind::AdamW).unwrap();
                    let mut y = Tensor::new(ctx, DType::F32, &[8, 16]).unwrap();
                    for step in 0..2 {
                        // Each rank its own data.
                        let (x, dy) = batch(ctx, 10 * step + rank.rank() as usize);
                        let region = m.autocast().unwrap();
                        let pass = m.forward(&x, &mut y).unwrap();
                        region.end().unwrap();
                        pass.backward(&dy, None).unwrap();
                        opt.step().unwrap();
                        opt.zero_grad().unwrap();
                    }
                    let out = m.parameters().unwrap().iter().map(|p| p.value.to_vec::<u8>().unwrap()).collect();
                    drop(opt);
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(results[0], results[1]);
}

/// A pass's backward differentiates its own forward or nothing. libfp8 keeps the latest
/// `fp8_model_forward` and one `fp8_layer_forward` per layer, holding only x's data pointer:
/// before the fix, `pass1.backward` below ran the backward of the second forward, reading its x
/// after the tensor was freed (valgrind: invalid reads in fp8_model_backward and
/// fp8_layer_backward; garbage gradients).
#[test]
fn stale_passes_never_reach_another_forwards_input() {
    let ctx = Context::cpu().unwrap();
    let mut m = Model::new(&ctx).unwrap();
    m.add_linear("fc", 4, 4, false).unwrap();
    m.parameter("fc.weight").unwrap().0.copy_from_host(&[0.5f32; 16]).unwrap();
    let x1 = Tensor::from_host(&ctx, DType::F32, &[1, 4], &[1.0f32; 4]).unwrap();
    let dy = Tensor::from_host(&ctx, DType::F32, &[1, 4], &[1.0f32; 4]).unwrap();
    let mut y = Tensor::new(&ctx, DType::F32, &[1, 4]).unwrap();
    let grad = |m: &Model<'_>| m.parameter("fc.weight").unwrap().1.to_vec::<f32>().unwrap();

    // Whole model: a later forward (its x dropped since) supersedes the pass.
    let pass1 = m.forward(&x1, &mut y).unwrap();
    {
        let x2 = Tensor::from_host(&ctx, DType::F32, &[1, 4], &[7.0f32; 4]).unwrap();
        let mut y2 = Tensor::new(&ctx, DType::F32, &[1, 4]).unwrap();
        m.forward(&x2, &mut y2).unwrap(); // its pass dropped at once
    }
    let err = pass1.backward(&dy, None).unwrap_err();
    assert_eq!(err.status(), Status::InvalidState);
    assert!(err.message().contains("later forward"), "{err}");
    assert_eq!(grad(&m), vec![0.0; 16], "nothing ran");
    // Even a refused later forward supersedes it (libfp8 may have dropped what it kept).
    let pass = m.forward(&x1, &mut y).unwrap();
    let mut wrong = Tensor::new(&ctx, DType::F32, &[1, 5]).unwrap();
    assert!(m.forward(&x1, &mut wrong).is_err());
    assert_eq!(pass.backward(&dy, None).unwrap_err().status(), Status::InvalidState);
    // The latest pass runs: dW = dy^T x1 = 1 everywhere.
    m.forward(&x1, &mut y).unwrap().backward(&dy, None).unwrap();
    assert_eq!(grad(&m), vec![1.0; 16]);
    m.zero_grad().unwrap();

    // Per layer: while a pass is alive the layer's next forward is refused, even where libfp8
    // would replace its kept forward (the weights changed since).
    let lp1 = m.layer_forward(0, &x1, &mut y).unwrap();
    m.write_parameter(0, &[0.25f32; 16]).unwrap();
    {
        let x2 = Tensor::from_host(&ctx, DType::F32, &[1, 4], &[7.0f32; 4]).unwrap();
        let mut y2 = Tensor::new(&ctx, DType::F32, &[1, 4]).unwrap();
        let err = m.layer_forward(0, &x2, &mut y2).unwrap_err();
        assert_eq!(err.status(), Status::InvalidState);
        assert!(err.message().contains("LayerPass"), "{err}");
    }
    // lp1's forward is still the one kept (never x2's): libfp8 refuses it, the weights changed.
    let err = lp1.backward(&dy, None).unwrap_err();
    assert_eq!(err.status(), Status::InvalidState);
    assert!(err.message().contains("changed since this forward"), "{err}");
    assert_eq!(grad(&m), vec![0.0; 16]);
    // Once the pass is gone the layer runs again, and a pass whose forward is kept runs.
    let lp = m.layer_forward(0, &x1, &mut y).unwrap();
    lp.backward(&dy, None).unwrap();
    assert_eq!(grad(&m), vec![1.0; 16]);
}

/// Recipe keys `scaling` and `power_2_scales`, and a model trained under each scaling recipe.
#[test]
fn scaling_recipes_train() {
    let mut r = Recipe::from_text("scaling=block").unwrap();
    assert_eq!(r.get(RecipeAttr::Scaling).unwrap(), sys::FP8_SCALING_BLOCK as i64);
    assert_eq!(r.get(RecipeAttr::PowerOf2Scales).unwrap(), sys::FP8_POWER_2_SCALES_AUTO as i64);
    r.parse("power_2_scales=on, scaling=rowwise").unwrap();
    assert_eq!(r.get(RecipeAttr::PowerOf2Scales).unwrap(), 1);
    assert_eq!(r.get(RecipeAttr::Scaling).unwrap(), sys::FP8_SCALING_ROWWISE as i64);
    assert_eq!(RecipeAttr::Scaling.bounds().unwrap().key, "scaling");
    assert_eq!(RecipeAttr::PowerOf2Scales.bounds().unwrap().key, "power_2_scales");
    let err = r.parse("scaling=sometimes").unwrap_err();
    assert_eq!(err.status(), Status::InvalidArgument);
    assert!(err.message().contains("scaling"), "{err}");
    assert_eq!(r.set(RecipeAttr::PowerOf2Scales, 2).unwrap_err().status(), Status::InvalidArgument);

    let ctx = Context::cpu().unwrap();
    assert_eq!(small_model(&ctx).layer_report(0).unwrap().scaling, -1, "not converted");
    for (text, scaling) in [
        ("scaling=delayed", sys::FP8_SCALING_DELAYED),
        ("scaling=current", sys::FP8_SCALING_CURRENT),
        ("scaling=rowwise", sys::FP8_SCALING_ROWWISE),
        ("scaling=block", sys::FP8_SCALING_BLOCK),
    ] {
        let mut m = small_model(&ctx);
        m.convert(&Recipe::from_text(&format!("{text}, backend=msamp, opt_level=O2, small_layer_fallback=0")).unwrap())
            .unwrap();
        let mut opt = Optimizer::new(&m, OptimizerKind::AdamW).unwrap();
        let before = values(&m);
        let mut y = Tensor::new(&ctx, DType::F32, &[8, 16]).unwrap();
        let (x, dy) = batch(&ctx, 3);
        let region = m.autocast().unwrap();
        let pass = m.forward(&x, &mut y).unwrap();
        region.end().unwrap();
        pass.backward(&dy, None).unwrap();
        opt.step().unwrap();
        let report = m.layer_report(0).unwrap();
        assert_eq!((report.scaling, report.fprop), (scaling, Precision::Fp8), "{text}: {report:?}");
        assert_eq!(opt.stats().unwrap().opt_level, 2);
        assert_ne!(values(&m), before, "{text}");
    }
}

/// fp8_scale_grid_shape, fp8_quantize_scaled and fp8_gemm_scaled.
#[test]
fn scale_grids() {
    assert_eq!(ScaleMode::Row.grid_shape(3, 200).unwrap(), [3, 1]);
    assert_eq!(ScaleMode::Block1x128.grid_shape(3, 200).unwrap(), [2, 3]);
    assert_eq!(ScaleMode::Block128x128.grid_shape(300, 200).unwrap(), [3, 4]);
    assert_eq!(ScaleMode::Row.grid_shape(-1, 4).unwrap_err().status(), Status::Shape);

    let ctx = Context::cpu().unwrap();
    let recipe = Recipe::new().unwrap();
    // a [2, 4] (row amaxes 4 and 0.5) and b [3, 4].
    let a_host = [1.0f32, -4.0, 2.0, 0.5, 0.25, 0.5, -0.125, 0.0];
    let b_host = [1.0f32, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
    let a = Tensor::from_host(&ctx, DType::F32, &[2, 4], &a_host).unwrap();
    let b = Tensor::from_host(&ctx, DType::F32, &[3, 4], &b_host).unwrap();
    let quantize = |t: &Tensor<'_>, rows: i64, mode: ScaleMode, recipe: &Recipe| {
        let mut q = Tensor::new(&ctx, DType::E4M3, &[rows, 4]).unwrap();
        let mut s = Tensor::new(&ctx, DType::F32, &mode.grid_shape(rows, 4).unwrap()).unwrap();
        let mut qt = Tensor::new(&ctx, DType::E4M3, &[4, rows]).unwrap();
        let mut st = Tensor::new(&ctx, DType::F32, &mode.grid_shape(4, rows).unwrap()).unwrap();
        ctx.quantize_scaled(t, mode, recipe, &mut q, &mut s, Some((&mut qt, &mut st))).unwrap();
        (q, s)
    };
    let (qa, sa) = quantize(&a, 2, ScaleMode::Row, &recipe);
    let scales = sa.to_vec::<f32>().unwrap();
    assert_eq!(scales, vec![1.0 / (448.0 / 4.0f32), 1.0 / (448.0 / 0.5f32)]);
    assert_eq!(qa.scale_inv().unwrap(), 1.0, "out's own scale_inv is left alone");
    let codes = qa.to_vec::<u8>().unwrap();
    for (i, &x) in a_host.iter().enumerate() {
        let back = decode(codes[i], DType::E4M3) * scales[i / 4];
        assert!((back - x).abs() <= x.abs() / 16.0, "{i}: {back} vs {x}");
    }
    // power_2_scales=on: every scale a power of two.
    let (_, sp) = quantize(&a, 2, ScaleMode::Row, &Recipe::from_text("power_2_scales=on").unwrap());
    assert!(sp.to_vec::<f32>().unwrap().iter().all(|s| s.log2().fract() == 0.0));
    // The transposed pair is all or nothing in the types; mismatched grids are refused.
    let mut q = Tensor::new(&ctx, DType::E4M3, &[2, 4]).unwrap();
    let mut bad = Tensor::new(&ctx, DType::F32, &[1, 1]).unwrap();
    let err = ctx.quantize_scaled(&a, ScaleMode::Row, &recipe, &mut q, &mut bad, None).unwrap_err();
    assert_eq!(err.status(), Status::Shape);
    assert!(err.message().contains("out_scales"), "{err}");

    // D = A B^T from the grids, against the same product of the decoded operands.
    for (a_mode, b_mode) in [
        (ScaleMode::Row, ScaleMode::Row),
        (ScaleMode::Block1x128, ScaleMode::Block1x128),
        (ScaleMode::Block1x128, ScaleMode::Block128x128),
        (ScaleMode::Block128x128, ScaleMode::Block1x128),
    ] {
        let (qa, sa) = quantize(&a, 2, a_mode, &recipe);
        let (qb, sb) = quantize(&b, 3, b_mode, &recipe);
        let mut d = Tensor::new(&ctx, DType::F32, &[2, 3]).unwrap();
        ctx.gemm_scaled(&qa, a_mode, &sa, &qb, b_mode, &sb, None, &mut d, None).unwrap();
        let got = d.to_vec::<f32>().unwrap();
        for (i, g) in got.iter().enumerate() {
            let want: f32 = (0..4).map(|k| a_host[(i / 3) * 4 + k] * b_host[(i % 3) * 4 + k]).sum();
            assert!((g - want).abs() <= 0.1 * want.abs().max(0.1), "{a_mode:?} x {b_mode:?} [{i}]: {g} vs {want}");
        }
        let mut d2 = Tensor::new(&ctx, DType::F32, &[2, 3]).unwrap();
        let alpha = GemmOptions { alpha: 2.0, ..GemmOptions::default() };
        ctx.gemm_scaled(&qa, a_mode, &sa, &qb, b_mode, &sb, None, &mut d2, Some(&alpha)).unwrap();
        assert_eq!(d2.to_vec::<f32>().unwrap(), got.iter().map(|v| 2.0 * v).collect::<Vec<_>>());
    }
    let (qa, sa) = quantize(&a, 2, ScaleMode::Block128x128, &recipe);
    let (qb, sb) = quantize(&b, 3, ScaleMode::Block128x128, &recipe);
    let mut d = Tensor::new(&ctx, DType::F32, &[2, 3]).unwrap();
    let m = ScaleMode::Block128x128;
    let err = ctx.gemm_scaled(&qa, m, &sa, &qb, m, &sb, None, &mut d, None).unwrap_err();
    assert!(!err.message().is_empty(), "{err}");
}

/* ---- stacks ----------------------------------------------------------------------------------- */

fn bits(t: &Tensor<'_>) -> Vec<u8> {
    t.to_vec::<u8>().unwrap()
}

fn grads(m: &Model<'_>) -> Vec<Vec<u8>> {
    m.parameters().unwrap().iter().map(|p| p.grad.to_vec::<u8>().unwrap()).collect()
}

/// `data` as a tensor of `dtype` (F32, or BF16 by truncating each value's bits).
fn tensor_of<'c>(ctx: &'c Context, dtype: DType, shape: &[i64], data: &[f32]) -> Tensor<'c> {
    match dtype {
        DType::F32 => Tensor::from_host(ctx, dtype, shape, data).unwrap(),
        DType::BF16 => {
            let h: Vec<u16> = data.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
            Tensor::from_host(ctx, dtype, shape, &h).unwrap()
        }
        _ => unreachable!(),
    }
}

fn pattern(n: usize, seed: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|i| (((i + seed) * 29 % 19) as f32 - 9.0) * scale).collect()
}

/// fp8.h: a stack runs its layers "as fp8_model_forward runs the whole model", each layer's y the
/// next one's x; outside FP8 there are no E4M3 hand-offs or folds, so a stack forward and backward
/// are the layers' own calls one by one: the same bits (F32 and BF16 activations).
#[test]
fn stacks_equal_their_layers_outside_fp8() {
    let ctx = Context::cpu().unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let m = small_model(&ctx);
        let x = tensor_of(&ctx, dtype, &[8, 16], &pattern(8 * 16, 1, 0.1));
        let dy = tensor_of(&ctx, dtype, &[8, 16], &pattern(8 * 16, 2, 0.01));
        // Layer by layer.
        let mut h1 = Tensor::new(&ctx, dtype, &[8, 32]).unwrap();
        let mut h2 = Tensor::new(&ctx, dtype, &[8, 32]).unwrap();
        let mut y1 = Tensor::new(&ctx, dtype, &[8, 16]).unwrap();
        let mut s0 = m.forward_saved(0, &x, &mut h1).unwrap();
        let mut s1 = m.forward_saved(1, &h1, &mut h2).unwrap();
        let mut s2 = m.forward_saved(2, &h2, &mut y1).unwrap();
        let mut dh2 = Tensor::new(&ctx, dtype, &[8, 32]).unwrap();
        let mut dh1 = Tensor::new(&ctx, dtype, &[8, 32]).unwrap();
        let mut dx1 = Tensor::new(&ctx, dtype, &[8, 16]).unwrap();
        m.backward_saved(2, &mut s2, &dy, Some(&mut dh2), DxMode::Write).unwrap();
        m.backward_saved(1, &mut s1, &dh2, Some(&mut dh1), DxMode::Write).unwrap();
        m.backward_saved(0, &mut s0, &dh1, Some(&mut dx1), DxMode::Write).unwrap();
        let g1 = grads(&m);
        m.zero_grad().unwrap();
        // The whole model as one stack.
        let mut y2 = Tensor::new(&ctx, dtype, &[8, 16]).unwrap();
        let mut dx2 = Tensor::new(&ctx, dtype, &[8, 16]).unwrap();
        let mut s = m.stack_forward_saved(.., &x, &mut y2).unwrap();
        assert!(s.needs_input().unwrap(), "a high-precision weight gradient reads x");
        m.stack_backward_saved(&mut s, &dy, Some(&mut dx2), DxMode::Write).unwrap();
        assert!(!s.needs_input().unwrap(), "consumed");
        assert_eq!(bits(&y2), bits(&y1), "{dtype:?} y");
        assert_eq!(bits(&dx2), bits(&dx1), "{dtype:?} dx");
        assert_eq!(grads(&m), g1, "{dtype:?} parameter gradients");
        m.zero_grad().unwrap();
        // A part of it (GELU, fc2), from the layers' own h1, without dx.
        let mut y3 = Tensor::new(&ctx, dtype, &[8, 16]).unwrap();
        let mut s = m.stack_forward_saved(1..=2, &h1, &mut y3).unwrap();
        m.stack_backward_saved(&mut s, &dy, None, DxMode::Write).unwrap();
        assert_eq!(bits(&y3), bits(&y1));
        let g3 = grads(&m);
        assert_eq!(g3[2..], g1[2..], "fc2's gradients");
        assert!(g3[0].iter().all(|&b| b == 0), "fc1 is not in the stack");
    }
}

/// Under FP8 (delayed scaling: E4M3 hand-offs, GELU folded into fc2's casts) fp8.h promises the
/// stack "as fp8_model_forward runs the whole model", and the backward as fp8_model_backward: the
/// same bits as a whole-model run of an identical model.
#[test]
fn stack_under_fp8_equals_the_whole_model_run() {
    let ctx = Context::cpu().unwrap();
    let recipe = Recipe::from_text("backend=te, small_layer_fallback=0").unwrap();
    let (mut a, mut b) = (small_model(&ctx), small_model(&ctx));
    a.convert(&recipe).unwrap();
    b.convert(&recipe).unwrap();
    // 16 tokens: a multiple of 16, so the weight gradients run in FP8 too.
    let x = Tensor::from_host(&ctx, DType::F32, &[16, 16], &pattern(16 * 16, 4, 0.1)).unwrap();
    let dy = Tensor::from_host(&ctx, DType::F32, &[16, 16], &pattern(16 * 16, 5, 0.01)).unwrap();
    let new = || Tensor::new(&ctx, DType::F32, &[16, 16]).unwrap();
    let (mut ya, mut yb, mut dxa, mut dxb) = (new(), new(), new(), new());
    let region = a.autocast().unwrap();
    let pass = a.forward(&x, &mut ya).unwrap();
    region.end().unwrap();
    pass.backward(&dy, Some(&mut dxa)).unwrap();
    let region = b.autocast().unwrap();
    let mut s = b.stack_forward_saved(.., &x, &mut yb).unwrap();
    region.end().unwrap();
    // fc1's weight gradient runs in FP8 from x's transposed copy: x is not read again.
    assert!(!s.needs_input().unwrap());
    b.stack_backward_saved(&mut s, &dy, Some(&mut dxb), DxMode::Write).unwrap();
    for layer in [0, 2] {
        let report = b.layer_report(layer).unwrap();
        assert_eq!((report.fprop, report.dgrad, report.wgrad), (Precision::Fp8, Precision::Fp8, Precision::Fp8));
    }
    assert_eq!(bits(&yb), bits(&ya));
    assert_eq!(bits(&dxb), bits(&dxa));
    assert_eq!(grads(&b), grads(&a));
}

/// y = residual + stack(x), in place or not, residual = x with DxMode::AddDy, the `_add` variant,
/// and DxMode on a layer's backward. The sums are one rounding of float(base) + the gradient
/// (fp8.h), so each mode equals DxMode::Accumulate into a dx that held the base: the same bits.
#[test]
fn stack_residuals_and_dx_modes() {
    let ctx = Context::cpu().unwrap();
    let m = small_model(&ctx);
    let (x, dy) = batch(&ctx, 5);
    let r_host = pattern(8 * 16, 3, 0.5);
    let r = Tensor::from_host(&ctx, DType::F32, &[8, 16], &r_host).unwrap();
    let new = |shape: &[i64]| Tensor::new(&ctx, DType::F32, shape).unwrap();
    let host = |t: &Tensor<'_>| t.to_vec::<f32>().unwrap();

    let mut y0 = new(&[8, 16]);
    let mut dx0 = new(&[8, 16]);
    let mut s0 = m.stack_forward_saved(.., &x, &mut y0).unwrap();
    m.stack_backward_saved(&mut s0, &dy, Some(&mut dx0), DxMode::Write).unwrap();
    let g0 = grads(&m);
    m.zero_grad().unwrap();

    // The residual, added by fc2's GEMM (one rounding of the double sum: within an ulp of y0 + r).
    let mut y1 = new(&[8, 16]);
    let mut s1 = m.stack_forward_residual(.., &x, &r, &mut y1, DType::F32).unwrap();
    for ((a, b), c) in host(&y1).iter().zip(host(&y0)).zip(&r_host) {
        assert!((a - (b + c)).abs() <= 1e-6 * (b + c).abs().max(1.0), "{a} vs {b} + {c}");
    }
    let mut y2 = Tensor::from_host(&ctx, DType::F32, &[8, 16], &r_host).unwrap();
    let mut s2 = m.stack_forward_residual_in_place(.., &x, &mut y2, DType::F32).unwrap();
    assert_eq!(bits(&y2), bits(&y1), "residual = y: the same sum");
    // The residual's gradient is dy itself: the stack's backward is the plain stack's.
    let mut dx1 = new(&[8, 16]);
    m.stack_backward_saved(&mut s1, &dy, Some(&mut dx1), DxMode::Write).unwrap();
    assert_eq!(bits(&dx1), bits(&dx0));
    assert_eq!(grads(&m), g0);
    m.stack_backward_saved(&mut s2, &dy, None, DxMode::Write).unwrap();
    m.zero_grad().unwrap();

    // y = x + f(x): the residual is x itself; AddDy makes dx = dy + f's input gradient.
    let mut y3 = new(&[8, 16]);
    let mut s3 = m.stack_forward_residual(.., &x, &x, &mut y3, DType::F32).unwrap();
    let mut dx3 = new(&[8, 16]);
    m.stack_backward_saved(&mut s3, &dy, Some(&mut dx3), DxMode::AddDy).unwrap();
    let mut y4 = new(&[8, 16]);
    let mut s4 = m.stack_forward_residual(.., &x, &x, &mut y4, DType::F32).unwrap();
    let mut dx4 = Tensor::from_host(&ctx, DType::F32, &[8, 16], &host(&dy)).unwrap();
    m.stack_backward_saved(&mut s4, &dy, Some(&mut dx4), DxMode::Accumulate).unwrap();
    assert_eq!(bits(&dx3), bits(&dx4));
    for ((a, b), c) in host(&dx3).iter().zip(host(&dx0)).zip(host(&dy)) {
        assert!((a - (b + c)).abs() <= 1e-6 * (b + c).abs().max(1e-3), "{a} vs {b} + {c}");
    }
    m.zero_grad().unwrap();

    // The _add variant: dx = base + the input gradient.
    let base = Tensor::from_host(&ctx, DType::F32, &[8, 16], &pattern(8 * 16, 7, 0.25)).unwrap();
    let mut y5 = new(&[8, 16]);
    let mut dx5 = new(&[8, 16]);
    let mut s5 = m.stack_forward_saved(.., &x, &mut y5).unwrap();
    m.stack_backward_saved_add(&mut s5, &dy, &base, &mut dx5).unwrap();
    let mut y6 = new(&[8, 16]);
    let mut dx6 = Tensor::from_host(&ctx, DType::F32, &[8, 16], &host(&base)).unwrap();
    let mut s6 = m.stack_forward_saved(.., &x, &mut y6).unwrap();
    m.stack_backward_saved(&mut s6, &dy, Some(&mut dx6), DxMode::Accumulate).unwrap();
    assert_eq!(bits(&dx5), bits(&dx6));

    // A layer's backward: GELU keeps the shape, so AddDy applies to it.
    let h = Tensor::from_host(&ctx, DType::F32, &[8, 32], &pattern(8 * 32, 1, 0.2)).unwrap();
    let dh = Tensor::from_host(&ctx, DType::F32, &[8, 32], &pattern(8 * 32, 2, 0.05)).unwrap();
    let mut out = new(&[8, 32]);
    let (mut a, mut b) = (new(&[8, 32]), Tensor::from_host(&ctx, DType::F32, &[8, 32], &host(&dh)).unwrap());
    let mut sa = m.forward_saved(1, &h, &mut out).unwrap();
    let mut sb = m.forward_saved(1, &h, &mut out).unwrap();
    m.backward_saved(1, &mut sa, &dh, Some(&mut a), DxMode::AddDy).unwrap();
    m.backward_saved(1, &mut sb, &dh, Some(&mut b), DxMode::Accumulate).unwrap();
    assert_eq!(bits(&a), bits(&b));
    assert_eq!(DxMode::default(), DxMode::Write);
    assert_eq!(
        [DxMode::Write.flags(), DxMode::Accumulate.flags(), DxMode::AddDy.flags()],
        [0, sys::FP8_BACKWARD_ACCUMULATE_DX, sys::FP8_BACKWARD_ADD_DY]
    );
}

/// Every refusal of fp8.h's stack contracts comes back as an error and changes nothing.
#[test]
fn stack_refusals() {
    let ctx = Context::cpu().unwrap();
    let mut m = small_model(&ctx);
    let (x, dy) = batch(&ctx, 6);
    let new = |shape: &[i64]| Tensor::new(&ctx, DType::F32, shape).unwrap();
    let mut y = new(&[8, 16]);
    let mut dx = new(&[8, 16]);
    let status = |r: Result<StackSaved<'_>>| r.unwrap_err().status();
    // Ranges.
    assert_eq!(status(m.stack_forward_saved(1..1, &x, &mut y)), Status::InvalidArgument);
    assert_eq!(status(m.stack_forward_saved(2..9, &x, &mut y)), Status::InvalidArgument);
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = m.stack_forward_saved(2..=0, &x, &mut y);
    assert_eq!(status(reversed), Status::InvalidArgument);
    // Shapes, dtypes, the residual's last layer.
    assert_eq!(status(m.stack_forward_saved(0..2, &x, &mut y)), Status::Shape);
    let mut h = new(&[8, 32]);
    let err = m.stack_forward_residual(0..2, &x, &h, &mut new(&[8, 32]), DType::F32).unwrap_err();
    assert_eq!(err.status(), Status::Unsupported, "{err}");
    let r16 = Tensor::new(&ctx, DType::BF16, &[8, 16]).unwrap();
    let mut y16 = Tensor::new(&ctx, DType::BF16, &[8, 16]).unwrap();
    assert_eq!(status(m.stack_forward_residual(.., &x, &r16, &mut y16, DType::F32)), Status::Dtype);
    assert_eq!(status(m.stack_forward_residual(.., &x, &x, &mut y, DType::E4M3)), Status::Dtype);

    // A refused backward runs nothing and leaves the state for a good one.
    let mut s = m.stack_forward_saved(.., &x, &mut y).unwrap();
    let err = m.stack_backward_saved(&mut s, &h, Some(&mut dx), DxMode::Write).unwrap_err();
    assert_eq!(err.status(), Status::Shape, "{err}");
    let err = m.stack_backward_saved(&mut s, &dy, None, DxMode::AddDy).unwrap_err();
    assert_eq!(err.status(), Status::InvalidArgument, "{err}");
    let err = m.stack_backward_saved_add(&mut s, &dy, &h, &mut dx).unwrap_err();
    assert_eq!(err.status(), Status::Shape, "{err}");
    assert!(grads(&m).iter().flatten().all(|&b| b == 0), "nothing ran");
    m.stack_backward_saved(&mut s, &dy, Some(&mut dx), DxMode::Write).unwrap();
    // One backward per forward.
    let err = m.stack_backward_saved(&mut s, &dy, Some(&mut dx), DxMode::Write).unwrap_err();
    assert_eq!(err.status(), Status::InvalidState);
    assert!(err.message().contains("already differentiated"), "{err}");

    // Another model's state.
    let other = small_model(&ctx);
    let mut s = other.stack_forward_saved(.., &x, &mut y).unwrap();
    assert_eq!(m.stack_backward_saved(&mut s, &dy, None, DxMode::Write).unwrap_err().status(), Status::InvalidArgument);
    other.stack_backward_saved(&mut s, &dy, None, DxMode::Write).unwrap();

    // Weights changed since the forward (a write, as an optimizer step).
    let mut s = m.stack_forward_saved(.., &x, &mut y).unwrap();
    m.write_parameter(3, &[0.5f32; 16]).unwrap();
    let err = m.stack_backward_saved(&mut s, &dy, None, DxMode::Write).unwrap_err();
    assert_eq!(err.status(), Status::InvalidState, "{err}");
    // An eval-mode forward keeps nothing to differentiate.
    m.set_training(false).unwrap();
    let mut s = m.stack_forward_saved(.., &x, &mut y).unwrap();
    assert!(!s.needs_input().unwrap());
    m.set_training(true).unwrap();
    assert_eq!(m.stack_backward_saved(&mut s, &dy, None, DxMode::Write).unwrap_err().status(), Status::InvalidState);
    // A conversion after the forward (expressible: the state borrows x, not the model).
    let mut s = m.stack_forward_saved(.., &x, &mut y).unwrap();
    m.convert(&Recipe::from_text("backend=te, small_layer_fallback=0").unwrap()).unwrap();
    assert_eq!(m.stack_backward_saved(&mut s, &dy, None, DxMode::Write).unwrap_err().status(), Status::InvalidState);
    // A state that outlives its model is still dropped safely.
    let s = other.stack_forward_saved(.., &x, &mut h).map(|_| ()).unwrap_err();
    assert_eq!(s.status(), Status::Shape);
    let kept = other.stack_forward_saved(.., &x, &mut y).unwrap();
    drop(other);
    drop(kept);
}

/* ---- DLPack ----------------------------------------------------------------------------------- */

use fp8::dlpack::{self, DLDataType, DLDevice, DLManagedTensor, DLManagedTensorVersioned, DLPackVersion, DLTensor};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A producer's DLTensor header before its pointers are set (`point`): its arrays must first reach
/// their final place (a Box).
fn header(device: DLDevice, dtype: DLDataType, ndim: usize) -> DLTensor {
    DLTensor {
        data: std::ptr::null_mut(),
        device,
        ndim: ndim as i32,
        dtype,
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

/// Points `t` at the producer's data, shape and strides (NULL strides where there are none).
fn point(t: &mut DLTensor, data: *mut std::ffi::c_void, shape: &mut [i64], strides: &mut Option<Vec<i64>>) {
    t.data = data;
    t.shape = shape.as_mut_ptr();
    t.strides = strides.as_mut().map_or(std::ptr::null_mut(), |s| s.as_mut_ptr());
}

/// A producer's tensor, as a framework's to_dlpack makes one: its memory, shape and strides live
/// with the DLManagedTensor, and the deleter counts its calls.
struct Producer {
    managed: DLManagedTensor,
    _shape: Vec<i64>,
    _strides: Option<Vec<i64>>,
    _data: Vec<f32>,
    deleted: Arc<AtomicUsize>,
}

unsafe extern "C" fn delete_producer(m: *mut DLManagedTensor) {
    let p = Box::from_raw((*m).manager_ctx.cast::<Producer>());
    p.deleted.fetch_add(1, Ordering::SeqCst);
}

struct Made {
    managed: *mut DLManagedTensor,
    data: *mut f32,
    deleted: Arc<AtomicUsize>,
}

fn produce(data: Vec<f32>, shape: &[i64], strides: Option<&[i64]>, device: DLDevice, dtype: DLDataType) -> Made {
    let deleted = Arc::new(AtomicUsize::new(0));
    let mut p = Box::new(Producer {
        managed: DLManagedTensor {
            dl_tensor: header(device, dtype, shape.len()),
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_producer),
        },
        _shape: shape.to_vec(),
        _strides: strides.map(<[i64]>::to_vec),
        _data: data,
        deleted: deleted.clone(),
    });
    let data = p._data.as_mut_ptr();
    let Producer { managed, _shape, _strides, .. } = &mut *p;
    point(&mut managed.dl_tensor, data.cast(), _shape, _strides);
    let p = Box::into_raw(p);
    unsafe {
        (*p).managed.manager_ctx = p.cast();
        Made { managed: std::ptr::addr_of_mut!((*p).managed), data, deleted }
    }
}

const CPU: DLDevice = DLDevice { device_type: dlpack::kDLCPU, device_id: 0 };
const F32: DLDataType = DLDataType { code: dlpack::kDLFloat, bits: 32, lanes: 1 };

/// The layouts of fp8::dlpack against the C compiler's, where dlpack/dlpack.h is installed.
#[test]
fn dlpack_layouts_match_c() {
    use std::mem::{align_of, offset_of, size_of};
    let include = std::env::var("DLPACK_INCLUDE").unwrap_or_else(|_| "/usr/include".into());
    if !std::path::Path::new(&include).join("dlpack/dlpack.h").exists() {
        eprintln!("SKIP dlpack_layouts_match_c: no dlpack/dlpack.h under {include}");
        return;
    }
    let dir = std::env::temp_dir().join(format!("fp8-dlpack-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (src, exe) = (dir.join("layout.c"), dir.join("layout"));
    let c_fields = [
        ("DLDevice", "device_type"),
        ("DLDevice", "device_id"),
        ("DLDataType", "code"),
        ("DLDataType", "bits"),
        ("DLDataType", "lanes"),
        ("DLTensor", "data"),
        ("DLTensor", "device"),
        ("DLTensor", "ndim"),
        ("DLTensor", "dtype"),
        ("DLTensor", "shape"),
        ("DLTensor", "strides"),
        ("DLTensor", "byte_offset"),
        ("DLManagedTensor", "dl_tensor"),
        ("DLManagedTensor", "manager_ctx"),
        ("DLManagedTensor", "deleter"),
    ];
    let mut program =
        String::from("#include <stdio.h>\n#include <stddef.h>\n#include <dlpack/dlpack.h>\nint main(void) {\n");
    for s in ["DLDevice", "DLDataType", "DLTensor", "DLManagedTensor"] {
        program += &format!("  printf(\"{s} %zu %zu\\n\", sizeof({s}), _Alignof({s}));\n");
    }
    for (s, f) in c_fields {
        program += &format!("  printf(\"{s}.{f} %zu %zu\\n\", offsetof({s}, {f}), sizeof((({s} *)0)->{f}));\n");
    }
    program += "  printf(\"codes %d %d %d %d %d %d %d\\n\", kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged, kDLInt, kDLUInt, kDLBfloat);\n";
    // DLPack 1.x's versioned struct and flags, and 1.1's FP8 codes, where the header has them.
    // DLPack 1.0 and 1.1 declare `struct DLManagedTensorVersioned` without a typedef, later ones with.
    let c_type = |s: &str| if s == "DLPackVersion" { s.to_string() } else { format!("struct {s}") };
    program += "#ifdef DLPACK_MAJOR_VERSION\n";
    for s in ["DLPackVersion", "DLManagedTensorVersioned"] {
        let t = c_type(s);
        program += &format!("  printf(\"{s} %zu %zu\\n\", sizeof({t}), _Alignof({t}));\n");
    }
    for (s, f) in VERSIONED_FIELDS {
        let t = c_type(s);
        program += &format!("  printf(\"{s}.{f} %zu %zu\\n\", offsetof({t}, {f}), sizeof((({t} *)0)->{f}));\n");
    }
    program += "  printf(\"flags %llu %llu\\n\", (unsigned long long)DLPACK_FLAG_BITMASK_READ_ONLY, (unsigned long long)DLPACK_FLAG_BITMASK_IS_COPIED);\n";
    program += "#if DLPACK_MAJOR_VERSION > 1 || DLPACK_MINOR_VERSION >= 1\n";
    program += "  printf(\"fp8 codes %d %d\\n\", kDLFloat8_e4m3fn, kDLFloat8_e5m2);\n#endif\n#endif\n";
    program += "  return 0;\n}\n";
    std::fs::write(&src, program).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    match std::process::Command::new(&cc).args(["-std=c11", "-I", &include]).arg(&src).arg("-o").arg(&exe).output() {
        Err(e) => {
            eprintln!("SKIP dlpack_layouts_match_c: no C compiler ({cc}: {e})");
            return;
        }
        Ok(o) if !o.status.success() => panic!("{cc}: {}", String::from_utf8_lossy(&o.stderr)),
        Ok(_) => {}
    }
    let out = String::from_utf8(std::process::Command::new(&exe).output().unwrap().stdout).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let sz = |n: usize, a: usize| format!("{n} {a}");
    let mut rust: Vec<String> = vec![
        format!("DLDevice {}", sz(size_of::<DLDevice>(), align_of::<DLDevice>())),
        format!("DLDataType {}", sz(size_of::<DLDataType>(), align_of::<DLDataType>())),
        format!("DLTensor {}", sz(size_of::<DLTensor>(), align_of::<DLTensor>())),
        format!("DLManagedTensor {}", sz(size_of::<DLManagedTensor>(), align_of::<DLManagedTensor>())),
        format!("DLDevice.device_type {} 4", offset_of!(DLDevice, device_type)),
        format!("DLDevice.device_id {} 4", offset_of!(DLDevice, device_id)),
        format!("DLDataType.code {} 1", offset_of!(DLDataType, code)),
        format!("DLDataType.bits {} 1", offset_of!(DLDataType, bits)),
        format!("DLDataType.lanes {} 2", offset_of!(DLDataType, lanes)),
        format!("DLTensor.data {} 8", offset_of!(DLTensor, data)),
        format!("DLTensor.device {} {}", offset_of!(DLTensor, device), size_of::<DLDevice>()),
        format!("DLTensor.ndim {} 4", offset_of!(DLTensor, ndim)),
        format!("DLTensor.dtype {} {}", offset_of!(DLTensor, dtype), size_of::<DLDataType>()),
        format!("DLTensor.shape {} 8", offset_of!(DLTensor, shape)),
        format!("DLTensor.strides {} 8", offset_of!(DLTensor, strides)),
        format!("DLTensor.byte_offset {} 8", offset_of!(DLTensor, byte_offset)),
        format!("DLManagedTensor.dl_tensor {} {}", offset_of!(DLManagedTensor, dl_tensor), size_of::<DLTensor>()),
        format!("DLManagedTensor.manager_ctx {} 8", offset_of!(DLManagedTensor, manager_ctx)),
        format!("DLManagedTensor.deleter {} 8", offset_of!(DLManagedTensor, deleter)),
        format!(
            "codes {} {} {} {} {} {} {}",
            dlpack::kDLCPU,
            dlpack::kDLCUDA,
            dlpack::kDLCUDAHost,
            dlpack::kDLCUDAManaged,
            dlpack::kDLInt,
            dlpack::kDLUInt,
            dlpack::kDLBfloat
        ),
    ];
    if out.lines().any(|l| l.starts_with("DLManagedTensorVersioned ")) {
        rust.extend(versioned_layout_lines());
    } else {
        eprintln!("dlpack_layouts_match_c: {include}/dlpack/dlpack.h is DLPack 0.x (no DLManagedTensorVersioned)");
    }
    if out.lines().any(|l| l.starts_with("fp8 codes ")) {
        rust.push(format!("fp8 codes {} {}", dlpack::kDLFloat8_e4m3fn, dlpack::kDLFloat8_e5m2));
    }
    let c: Vec<&str> = out.lines().collect();
    assert_eq!(c, rust.iter().map(String::as_str).collect::<Vec<_>>());
}

/// DLPack 1.x's structs and fields, as the C layout test prints them.
const VERSIONED_FIELDS: [(&str, &str); 7] = [
    ("DLPackVersion", "major"),
    ("DLPackVersion", "minor"),
    ("DLManagedTensorVersioned", "version"),
    ("DLManagedTensorVersioned", "manager_ctx"),
    ("DLManagedTensorVersioned", "deleter"),
    ("DLManagedTensorVersioned", "flags"),
    ("DLManagedTensorVersioned", "dl_tensor"),
];

/// The Rust side of VERSIONED_FIELDS and the flags, in the C program's order.
fn versioned_layout_lines() -> Vec<String> {
    use std::mem::{align_of, offset_of, size_of};
    type V = DLManagedTensorVersioned;
    vec![
        format!("DLPackVersion {} {}", size_of::<DLPackVersion>(), align_of::<DLPackVersion>()),
        format!("DLManagedTensorVersioned {} {}", size_of::<V>(), align_of::<V>()),
        format!("DLPackVersion.major {} 4", offset_of!(DLPackVersion, major)),
        format!("DLPackVersion.minor {} 4", offset_of!(DLPackVersion, minor)),
        format!("DLManagedTensorVersioned.version {} {}", offset_of!(V, version), size_of::<DLPackVersion>()),
        format!("DLManagedTensorVersioned.manager_ctx {} 8", offset_of!(V, manager_ctx)),
        format!("DLManagedTensorVersioned.deleter {} 8", offset_of!(V, deleter)),
        format!("DLManagedTensorVersioned.flags {} 8", offset_of!(V, flags)),
        format!("DLManagedTensorVersioned.dl_tensor {} {}", offset_of!(V, dl_tensor), size_of::<DLTensor>()),
        format!("flags {} {}", dlpack::DLPACK_FLAG_BITMASK_READ_ONLY, dlpack::DLPACK_FLAG_BITMASK_IS_COPIED),
    ]
}

/// A libfp8 tensor lent out: the metadata fp8.h documents, the memory alive until the deleter runs
/// (after its tensor and even its model are gone), and back into libfp8.
#[test]
fn dlpack_lends_tensors() {
    let ctx = Context::cpu().unwrap();
    let data: Vec<f32> = (0..6).map(|i| i as f32 - 1.5).collect();
    let t = Tensor::from_host(&ctx, DType::F32, &[2, 3], &data).unwrap();
    let lent = t.to_dlpack().unwrap();
    assert_eq!(lent.device(), CPU);
    assert_eq!(lent.dtype(), F32);
    assert_eq!(lent.shape(), [2, 3]);
    assert_eq!(lent.strides(), Some(&[3i64, 1][..]));
    assert_eq!(lent.dl_tensor().byte_offset, 0);
    assert_eq!(lent.data_ptr(), t.data_ptr().unwrap());
    drop(t);
    // SAFETY (test): CPU memory libfp8 keeps until the deleter; 6 floats; nothing writes it.
    let seen = unsafe { std::slice::from_raw_parts(lent.data_ptr().cast::<f32>(), 6) }.to_vec();
    assert_eq!(seen, data);
    let back = Tensor::from_managed(&ctx, lent).unwrap();
    assert_eq!(back.shape().unwrap(), [2, 3]);
    assert_eq!(back.to_vec::<f32>().unwrap(), data);
    // Lent again from a tensor that came in by DLPack, and into another context.
    let other = Context::cpu().unwrap();
    let again = Tensor::from_managed(&other, back.to_dlpack().unwrap()).unwrap();
    drop(back);
    assert_eq!(again.to_vec::<f32>().unwrap(), data);

    // Each dtype's DLPack type; FP8 codes travel as uint8, which libfp8 does not take back.
    for (dtype, code, bits) in [
        (DType::F16, dlpack::kDLFloat, 16),
        (DType::BF16, dlpack::kDLBfloat, 16),
        (DType::E4M3, dlpack::kDLUInt, 8),
        (DType::E5M2, dlpack::kDLUInt, 8),
    ] {
        let t = Tensor::new(&ctx, dtype, &[4]).unwrap();
        let lent = t.to_dlpack().unwrap();
        assert_eq!(lent.dtype(), DLDataType { code, bits, lanes: 1 }, "{dtype:?}");
        if dtype.is_fp8() {
            assert_eq!(Tensor::from_managed(&ctx, lent).unwrap_err().status(), Status::Dtype);
        }
    }
    let scalar = Tensor::from_host(&ctx, DType::F32, &[], &[2.5f32]).unwrap().to_dlpack().unwrap();
    assert_eq!((scalar.shape(), scalar.strides()), (&[][..], Some(&[][..])));
    assert_eq!(Tensor::from_managed(&ctx, scalar).unwrap().to_vec::<f32>().unwrap(), [2.5]);

    // A model's parameter: a view of its storage, kept alive past the model by the consumer.
    let raw;
    let weights: Vec<f32>;
    {
        let m = small_model(&ctx);
        let (w, _) = m.parameter("fc1.weight").unwrap();
        weights = w.to_vec().unwrap();
        let lent = w.to_dlpack().unwrap();
        assert_eq!((lent.shape(), lent.dtype()), (&[32i64, 16][..], F32));
        raw = lent.into_raw(); // the consumer's now
    }
    // SAFETY (test): the consumer's view, valid until its deleter, which runs once.
    unsafe {
        let t = &(*raw).dl_tensor;
        assert_eq!(std::slice::from_raw_parts(t.data.cast::<f32>(), 32 * 16), &weights[..]);
        ((*raw).deleter.unwrap())(raw);
    }
}

/// A producer's tensor taken in: its memory used in place, its deleter run exactly once, when the
/// last holder (the tensor, or a view lent on) lets go; refusals leave it the caller's.
#[test]
fn dlpack_takes_tensors_in() {
    let ctx = Context::cpu().unwrap();
    let made = produce((0..12).map(|i| i as f32).collect(), &[3, 4], None, CPU, F32);
    // SAFETY (test): a valid DLManagedTensor of host memory, handed over once.
    let mut t = unsafe { Tensor::from_dlpack(&ctx, made.managed) }.unwrap();
    assert_eq!(t.shape().unwrap(), [3, 4]);
    assert_eq!(t.data_ptr().unwrap(), made.data.cast());
    assert_eq!(t.to_vec::<f32>().unwrap(), (0..12).map(|i| i as f32).collect::<Vec<_>>());
    t.copy_from_host(&[1.0f32; 12]).unwrap();
    assert_eq!(unsafe { *made.data.add(11) }, 1.0, "the producer's memory, in place");
    let lent = t.to_dlpack().unwrap();
    drop(t);
    assert_eq!(made.deleted.load(Ordering::SeqCst), 0, "a view lent on keeps it");
    drop(lent);
    assert_eq!(made.deleted.load(Ordering::SeqCst), 1);

    // Strides: NULL, compact, anything on a size-1 dimension; and the byte offset.
    let made = produce(vec![0.0, 1.0, 2.0, 3.0], &[1, 3], Some(&[99, 1]), CPU, F32);
    unsafe { (*made.managed).dl_tensor.byte_offset = 4 };
    let managed = unsafe { ManagedTensor::from_raw(made.managed) }.unwrap();
    assert_eq!(managed.strides(), Some(&[99i64, 1][..]));
    let t = Tensor::from_managed(&ctx, managed).unwrap();
    assert_eq!(t.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0]);
    drop(t);
    assert_eq!(made.deleted.load(Ordering::SeqCst), 1);
    let made = produce(vec![0.0; 4], &[1, 4], None, DLDevice { device_type: dlpack::kDLCUDAHost, device_id: 0 }, F32);
    drop(unsafe { Tensor::from_dlpack(&ctx, made.managed) }.unwrap());
    assert_eq!(made.deleted.load(Ordering::SeqCst), 1);
    // A ManagedTensor never handed over runs its deleter when dropped.
    let made = produce(vec![0.0; 4], &[4], None, CPU, F32);
    drop(unsafe { ManagedTensor::from_raw(made.managed) }.unwrap());
    assert_eq!(made.deleted.load(Ordering::SeqCst), 1);
    assert!(unsafe { ManagedTensor::from_raw(std::ptr::null_mut()) }.is_err());

    // Refusals: from_dlpack leaves the tensor the caller's (deleter not run), from_managed drops it.
    let bad = [
        // (shape, strides, device, dtype, offset, status, what the message names)
        (vec![2, 3], Some(vec![1, 2]), CPU, F32, 0, Status::Shape, "strides"),
        (vec![3, 2], Some(vec![4, 2]), CPU, F32, 0, Status::Shape, "contiguous"),
        (
            vec![6],
            None,
            DLDevice { device_type: dlpack::kDLCUDA, device_id: 0 },
            F32,
            0,
            Status::InvalidArgument,
            "kDLCUDA",
        ),
        (
            vec![6],
            None,
            DLDevice { device_type: dlpack::kDLROCM, device_id: 0 },
            F32,
            0,
            Status::InvalidArgument,
            "device",
        ),
        (vec![6], None, CPU, DLDataType { code: dlpack::kDLInt, bits: 32, lanes: 1 }, 0, Status::Dtype, "int32"),
        (vec![6], None, CPU, DLDataType { code: dlpack::kDLUInt, bits: 8, lanes: 1 }, 0, Status::Dtype, "uint8"),
        (vec![3], None, CPU, DLDataType { code: dlpack::kDLFloat, bits: 32, lanes: 2 }, 0, Status::Dtype, "float32x2"),
        (vec![1; 9], None, CPU, F32, 0, Status::Shape, "dimensions"),
        (vec![4], None, CPU, F32, 2, Status::InvalidArgument, "aligned"),
        (vec![-1], None, CPU, F32, 0, Status::Shape, "shape"),
    ];
    for (shape, strides, device, dtype, offset, status, names) in bad {
        let made = produce(vec![0.0; 8], &shape, strides.as_deref(), device, dtype);
        unsafe { (*made.managed).dl_tensor.byte_offset = offset };
        let err = unsafe { Tensor::from_dlpack(&ctx, made.managed) }.unwrap_err();
        assert_eq!(err.status(), status, "{shape:?} {strides:?}: {err}");
        assert!(err.message().contains(names), "{err}");
        assert_eq!(made.deleted.load(Ordering::SeqCst), 0, "still the caller's");
        let err = Tensor::from_managed(&ctx, unsafe { ManagedTensor::from_raw(made.managed) }.unwrap()).unwrap_err();
        assert_eq!(err.status(), status);
        assert_eq!(made.deleted.load(Ordering::SeqCst), 1, "dropped once");
    }
}

/* ---- DLPack 1.x (DLManagedTensorVersioned) ---------------------------------------------------- */

/// A DLPack 1.x producer's tensor: its bytes (8-byte aligned), shape and strides live with the
/// DLManagedTensorVersioned, and the deleter counts its calls.
struct VersionedProducer {
    managed: DLManagedTensorVersioned,
    _shape: Vec<i64>,
    _strides: Option<Vec<i64>>,
    _data: Vec<u64>,
    deleted: Arc<AtomicUsize>,
}

unsafe extern "C" fn delete_versioned_producer(m: *mut DLManagedTensorVersioned) {
    let p = Box::from_raw((*m).manager_ctx.cast::<VersionedProducer>());
    p.deleted.fetch_add(1, Ordering::SeqCst);
}

struct MadeVersioned {
    managed: *mut DLManagedTensorVersioned,
    data: *mut u8,
    deleted: Arc<AtomicUsize>,
}

fn produce_versioned(
    bytes: &[u8],
    shape: &[i64],
    strides: Option<&[i64]>,
    dtype: DLDataType,
    version: DLPackVersion,
    flags: u64,
) -> MadeVersioned {
    let deleted = Arc::new(AtomicUsize::new(0));
    let mut storage = vec![0u64; bytes.len().div_ceil(8).max(1)];
    // SAFETY (test): the storage holds at least bytes.len() bytes.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), storage.as_mut_ptr().cast::<u8>(), bytes.len()) };
    let mut p = Box::new(VersionedProducer {
        managed: DLManagedTensorVersioned {
            version,
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_versioned_producer),
            flags,
            dl_tensor: header(CPU, dtype, shape.len()),
        },
        _shape: shape.to_vec(),
        _strides: strides.map(<[i64]>::to_vec),
        _data: storage,
        deleted: deleted.clone(),
    });
    let data = p._data.as_mut_ptr().cast::<u8>();
    let VersionedProducer { managed, _shape, _strides, .. } = &mut *p;
    point(&mut managed.dl_tensor, data.cast(), _shape, _strides);
    let p = Box::into_raw(p);
    unsafe {
        (*p).managed.manager_ctx = p.cast();
        MadeVersioned { managed: std::ptr::addr_of_mut!((*p).managed), data, deleted }
    }
}

const V1_1: DLPackVersion = DLPackVersion { major: 1, minor: 1 };
const E4M3FN: DLDataType = DLDataType { code: dlpack::kDLFloat8_e4m3fn, bits: 8, lanes: 1 };
const E5M2: DLDataType = DLDataType { code: dlpack::kDLFloat8_e5m2, bits: 8, lanes: 1 };

/// FP8 codes of `values` (distinct per format, so that a mix-up of the two shows).
fn fp8_codes(values: &[f32], dtype: DType) -> Vec<u8> {
    values.iter().map(|&x| encode(x, dtype)).collect()
}

/// The versioned struct's layout, where libfp8 (C++) writes it and Rust reads it: DLPack 1.x's
/// offsets 0/8/16/24/32 on 64-bit, the constants of DLPack 1.1, and a lent struct read back by
/// byte offset.
#[test]
fn dlpack_versioned_layout() {
    use std::mem::{align_of, offset_of, size_of};
    type V = DLManagedTensorVersioned;
    let p = size_of::<*mut std::ffi::c_void>();
    assert_eq!((size_of::<DLPackVersion>(), align_of::<DLPackVersion>()), (8, 4));
    assert_eq!((offset_of!(DLPackVersion, major), offset_of!(DLPackVersion, minor)), (0, 4));
    let offsets = [
        offset_of!(V, version),
        offset_of!(V, manager_ctx),
        offset_of!(V, deleter),
        offset_of!(V, flags),
        offset_of!(V, dl_tensor),
    ];
    assert_eq!(offsets, [0, 8, 8 + p, 8 + 2 * p, 16 + 2 * p]);
    assert_eq!(size_of::<V>(), 16 + 2 * p + size_of::<DLTensor>());
    assert_eq!(align_of::<V>(), align_of::<u64>().max(align_of::<*mut u8>()));
    #[cfg(target_pointer_width = "64")]
    {
        assert_eq!(offsets, [0, 8, 16, 24, 32]);
        assert_eq!((size_of::<DLTensor>(), size_of::<V>()), (48, 80));
    }
    assert_eq!((dlpack::kDLFloat8_e4m3fn, dlpack::kDLFloat8_e5m2), (10, 12));
    assert_eq!((dlpack::DLPACK_FLAG_BITMASK_READ_ONLY, dlpack::DLPACK_FLAG_BITMASK_IS_COPIED), (1, 2));

    // What libfp8 wrote, read at DLPack 1.x's byte offsets rather than through the Rust fields.
    let ctx = Context::cpu().unwrap();
    let t = Tensor::from_host(&ctx, DType::E5M2, &[5], &[1u8, 2, 3, 4, 5]).unwrap();
    let lent = t.to_dlpack_versioned().unwrap();
    let base = lent.as_ptr().cast::<u8>();
    // SAFETY (test): a struct libfp8 allocated with at least these many bytes, alive until dropped.
    unsafe {
        assert_eq!(base.cast::<[u32; 2]>().read_unaligned(), [1, 1], "version 1.1 at 0");
        assert_eq!(base.add(8 + 2 * p).cast::<u64>().read_unaligned(), 0, "flags 0 at 8 + 2p");
        let dl = base.add(16 + 2 * p);
        assert_eq!(dl.cast::<*mut std::ffi::c_void>().read_unaligned(), t.data_ptr().unwrap(), "dl_tensor.data");
        let dtype = dl.add(offset_of!(DLTensor, dtype)).cast::<[u8; 4]>().read_unaligned();
        assert_eq!(dtype[..2], [dlpack::kDLFloat8_e5m2, 8], "dl_tensor.dtype");
        assert!(base.add(8 + p).cast::<Option<unsafe extern "C" fn(*mut V)>>().read_unaligned().is_some());
    }
}

/// E4M3 and E5M2 tensors lent as DLPack 1.x: version 1.1, flags 0, codes 10 and 12, the shape and
/// compact strides; borrowed back as the same dtype over the same bytes (and the other dtypes).
#[test]
fn dlpack_versioned_lends_tensors() {
    let ctx = Context::cpu().unwrap();
    let values = [0.5f32, -1.0, 2.0, 3.5, -0.25, 96.0];
    for (dtype, expect) in [(DType::E4M3, E4M3FN), (DType::E5M2, E5M2)] {
        let codes = fp8_codes(&values, dtype);
        let mut t = Tensor::from_host(&ctx, dtype, &[2, 3], &codes).unwrap();
        t.set_scale_inv(0.5).unwrap();
        let lent = t.to_dlpack_versioned().unwrap();
        assert_eq!(lent.version(), V1_1, "{dtype:?}");
        assert_eq!(lent.flags(), 0);
        assert_eq!(lent.dtype(), expect, "{dtype:?}");
        assert_eq!(lent.device(), CPU);
        assert_eq!(lent.shape(), [2, 3]);
        assert_eq!(lent.strides(), Some(&[3i64, 1][..]));
        assert_eq!(lent.dl_tensor().byte_offset, 0);
        assert_eq!(lent.data_ptr(), t.data_ptr().unwrap());
        let debug = format!("{lent:?}");
        assert!(debug.starts_with("ManagedTensorVersioned") && debug.contains("minor: 1"), "{debug}");
        // The unversioned struct has no FP8 code: uint8 there.
        assert_eq!(t.to_dlpack().unwrap().dtype(), DLDataType { code: dlpack::kDLUInt, bits: 8, lanes: 1 });
        drop(t);
        // SAFETY (test): CPU memory libfp8 keeps until the deleter; 6 bytes; nothing writes it.
        let seen = unsafe { std::slice::from_raw_parts(lent.data_ptr().cast::<u8>(), 6) }.to_vec();
        assert_eq!(seen, codes);

        let back = Tensor::from_managed_versioned(&ctx, lent).unwrap();
        assert_eq!(back.dtype().unwrap(), dtype);
        assert_eq!(back.shape().unwrap(), [2, 3]);
        assert_eq!(back.to_vec::<u8>().unwrap(), codes);
        assert_eq!(back.scale_inv().unwrap(), 1.0, "an FP8 tensor taken in gets a scale_inv of 1.0");
        // And through the raw pointer, as a consumer would hand it over.
        let raw = back.to_dlpack_versioned().unwrap().into_raw();
        // SAFETY (test): libfp8's own struct, handed over once.
        let again = unsafe { Tensor::from_dlpack_versioned(&ctx, raw) }.unwrap();
        drop(back);
        assert_eq!((again.dtype().unwrap(), again.to_vec::<u8>().unwrap()), (dtype, codes));
    }
    let (e4m3, e5m2) = (fp8_codes(&values, DType::E4M3), fp8_codes(&values, DType::E5M2));
    assert_ne!(e4m3, e5m2, "the two formats' codes differ, so a swapped dtype would show");

    // The other dtypes carry the unversioned codes.
    let data: Vec<f32> = (0..6).map(|i| i as f32 * 0.75).collect();
    let t = Tensor::from_host(&ctx, DType::F32, &[3, 2], &data).unwrap();
    let lent = t.to_dlpack_versioned().unwrap();
    assert_eq!((lent.dtype(), lent.strides()), (F32, Some(&[2i64, 1][..])));
    assert_eq!(Tensor::from_managed_versioned(&ctx, lent).unwrap().to_vec::<f32>().unwrap(), data);
    for (dtype, code) in [(DType::F16, dlpack::kDLFloat), (DType::BF16, dlpack::kDLBfloat)] {
        let lent = Tensor::new(&ctx, dtype, &[4]).unwrap().to_dlpack_versioned().unwrap();
        assert_eq!(lent.dtype(), DLDataType { code, bits: 16, lanes: 1 });
        assert_eq!(Tensor::from_managed_versioned(&ctx, lent).unwrap().dtype().unwrap(), dtype);
    }
    let scalar = Tensor::from_host(&ctx, DType::F32, &[], &[2.5f32]).unwrap().to_dlpack_versioned().unwrap();
    assert_eq!((scalar.shape(), scalar.strides()), (&[][..], Some(&[][..])));

    // A model's parameter, kept alive past the model by the consumer.
    let raw;
    let weights: Vec<f32>;
    {
        let m = small_model(&ctx);
        let (w, _) = m.parameter("fc1.weight").unwrap();
        weights = w.to_vec().unwrap();
        let lent = w.to_dlpack_versioned().unwrap();
        assert_eq!((lent.shape(), lent.dtype(), lent.version(), lent.flags()), (&[32i64, 16][..], F32, V1_1, 0));
        raw = lent.into_raw();
    }
    // SAFETY (test): the consumer's view, valid until its deleter, which runs once.
    unsafe {
        let t = &(*raw).dl_tensor;
        assert_eq!(std::slice::from_raw_parts(t.data.cast::<f32>(), 32 * 16), &weights[..]);
        ((*raw).deleter.unwrap())(raw);
    }
}

/// A DLPack 1.x producer's tensor taken in: FP8 by its codes, its memory used in place, its deleter
/// run exactly once, when the last holder lets go.
#[test]
fn dlpack_versioned_takes_tensors_in() {
    let ctx = Context::cpu().unwrap();
    let codes = fp8_codes(&[1.0, -2.0, 0.125, 4.0, 8.0, -0.5, 3.0, 0.0], DType::E4M3);
    let made = produce_versioned(&codes, &[2, 4], None, E4M3FN, DLPackVersion { major: 1, minor: 0 }, 0);
    // SAFETY (test): a valid DLManagedTensorVersioned of host memory, handed over once.
    let mut t = unsafe { Tensor::from_dlpack_versioned(&ctx, made.managed) }.unwrap();
    assert_eq!((t.dtype().unwrap(), t.shape().unwrap()), (DType::E4M3, vec![2, 4]));
    assert_eq!(t.data_ptr().unwrap(), made.data.cast());
    assert_eq!(t.to_vec::<u8>().unwrap(), codes);
    assert_eq!(t.scale_inv().unwrap(), 1.0);
    t.copy_from_host(&[0x38u8; 8]).unwrap();
    assert_eq!(unsafe { *made.data.add(7) }, 0x38, "the producer's memory, in place");
    let lent = t.to_dlpack_versioned().unwrap();
    drop(t);
    assert_eq!(made.deleted.load(Ordering::SeqCst), 0, "a view lent on keeps it");
    drop(lent);
    assert_eq!(made.deleted.load(Ordering::SeqCst), 1, "deleted once, by the last holder");

    // E5M2 through the safe owner; any minor version; IS_COPIED is no refusal; explicit strides.
    let codes = fp8_codes(&[1.0, -2.0, 0.125, 4.0, 8.0, -0.5], DType::E5M2);
    let made = produce_versioned(
        &codes,
        &[3, 2],
        Some(&[2, 1]),
        E5M2,
        DLPackVersion { major: 1, minor: 7 },
        dlpack::DLPACK_FLAG_BITMASK_IS_COPIED,
    );
    let managed = unsafe { ManagedTensorVersioned::from_raw(made.managed) }.unwrap();
    assert_eq!((managed.version(), managed.flags()), (DLPackVersion { major: 1, minor: 7 }, 2));
    assert_eq!((managed.dtype(), managed.shape(), managed.strides()), (E5M2, &[3i64, 2][..], Some(&[2i64, 1][..])));
    let t = Tensor::from_managed_versioned(&ctx, managed).unwrap();
    assert_eq!((t.dtype().unwrap(), t.to_vec::<u8>().unwrap()), (DType::E5M2, codes));
    assert_eq!(made.deleted.load(Ordering::SeqCst), 0);
    drop(t);
    assert_eq!(made.deleted.load(Ordering::SeqCst), 1);

    // float32 bytes.
    let values = [1.5f32, -2.0, 0.25];
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
    let made = produce_versioned(&bytes, &[3], None, F32, V1_1, 0);
    let t = unsafe { Tensor::from_dlpack_versioned(&ctx, made.managed) }.unwrap();
    assert_eq!(t.to_vec::<f32>().unwrap(), values);
    drop(t);
    assert_eq!(made.deleted.load(Ordering::SeqCst), 1);

    // An owner never handed over runs the deleter when dropped, once.
    let made = produce_versioned(&[0; 4], &[4], None, E4M3FN, V1_1, 0);
    drop(unsafe { ManagedTensorVersioned::from_raw(made.managed) }.unwrap());
    assert_eq!(made.deleted.load(Ordering::SeqCst), 1);
    let err = unsafe { ManagedTensorVersioned::from_raw(std::ptr::null_mut()) }.unwrap_err();
    assert_eq!(err.status(), Status::InvalidArgument);
    assert!(err.message().contains("ManagedTensorVersioned::from_raw"), "{err}");
}

/// Refusals of DLPack 1.x tensors: another major version (before anything else is read), a
/// read-only tensor, a type code that is not E4M3 or E5M2; from_dlpack_versioned leaves the tensor
/// the caller's (deleter not run), from_managed_versioned drops it (deleter run once).
#[test]
fn dlpack_versioned_refusals() {
    let ctx = Context::cpu().unwrap();
    let v = |major, minor| DLPackVersion { major, minor };
    let ro = dlpack::DLPACK_FLAG_BITMASK_READ_ONLY;
    let code = |code, bits, lanes| DLDataType { code, bits, lanes };
    let bad = [
        // (version, flags, dtype, status, what the message names)
        (v(2, 0), 0, E4M3FN, Status::Version, "2.0"),
        (v(0, 8), 0, F32, Status::Version, "0.8"),
        // The version is read first: a major version 2 with an unknown dtype is a version refusal.
        (v(2, 0), 0, code(99, 8, 1), Status::Version, "2.0"),
        (V1_1, ro, E4M3FN, Status::InvalidArgument, "read-only"),
        (V1_1, ro | dlpack::DLPACK_FLAG_BITMASK_IS_COPIED, F32, Status::InvalidArgument, "read-only"),
        (V1_1, 0, code(11, 8, 1), Status::Dtype, "code 11"), // float8_e4m3fnuz: not libfp8's E4M3
        (V1_1, 0, code(99, 8, 1), Status::Dtype, "code 99"),
        (V1_1, 0, code(dlpack::kDLFloat8_e4m3fn, 16, 1), Status::Dtype, "code 10 16"),
        (V1_1, 0, code(dlpack::kDLFloat8_e5m2, 8, 2), Status::Dtype, "float8_e5m2x2"),
    ];
    for (version, flags, dtype, status, names) in bad {
        let made = produce_versioned(&[0; 16], &[4], None, dtype, version, flags);
        let err = unsafe { Tensor::from_dlpack_versioned(&ctx, made.managed) }.unwrap_err();
        assert_eq!(err.status(), status, "{version:?} {flags} {dtype:?}: {err}");
        assert!(err.message().contains(names), "{err}");
        assert_eq!(made.deleted.load(Ordering::SeqCst), 0, "still the caller's");
        // SAFETY (test): the struct is laid out as DLPack 1.x's whatever its version says.
        let managed = unsafe { ManagedTensorVersioned::from_raw(made.managed) }.unwrap();
        assert_eq!(Tensor::from_managed_versioned(&ctx, managed).unwrap_err().status(), status);
        assert_eq!(made.deleted.load(Ordering::SeqCst), 1, "dropped once");
    }

    // The unversioned struct takes no FP8 codes (DLPack 0.x has none).
    for dtype in [E4M3FN, E5M2] {
        let made = produce(vec![0.0; 2], &[4], None, CPU, dtype);
        let err = unsafe { Tensor::from_dlpack(&ctx, made.managed) }.unwrap_err();
        assert_eq!(err.status(), Status::Dtype, "{err}");
        drop(unsafe { ManagedTensor::from_raw(made.managed) }.unwrap());
        assert_eq!(made.deleted.load(Ordering::SeqCst), 1);
    }
}
