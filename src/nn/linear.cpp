// The Linear layer, y = x W^T + b, with FP8 GEMMs (TransformerEngine's recipe) and a per-call
// high-precision fallback. One activation dtype A (F32 or BF16) per call: y, dy and dx are A, and x
// is A or an E4M3 hand-off from the layer before. Masters, gradients and the bias stay FP32.
//
//   forward   x -> E4M3 (+ transposed copy for wgrad, one pass)   y = x8 W8^T (+ b), fast accum.
//   backward  dy -> E5M2 under HYBRID (+ transposed copy + bias gradient, one pass)
//             dgrad dx = dy8 W8t^T,  wgrad dW += dy8t x8t^T
// The FP8 copy of W (and its transpose) is made once per weights version, i.e. once per optimizer
// step, and reused by every micro-batch. Under scaling=rowwise or block every cast makes a grid of
// scales (per row, or per 1x128 / 128x128 block: "cell scaling") in the layout cuBLASLt reads, with
// the transposed copies quantised along their own K from the high-precision source. What a backward needs of its forward (the plan, x's
// transposed FP8 copy or its high-precision values) lives in a LinearSaved, so any number of
// forwards can be in flight.
#include <algorithm>
#include <cinttypes>
#include <cstdio>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "nn/layer.hpp"

namespace fp8::nn {

namespace {

// The small-layer rule, measured on an H100 with bench/bench_linear (bench/RESULTS.md, "Linear
// fallback rule"): a step in FP8 was slower than bf16 or no faster below 2^32 multiply-adds per GEMM
// (tokens x in x out) and whenever in or out was 1024 (up to 16384 tokens): the casts and extra
// launches outweigh the faster GEMMs there.
constexpr double kFp8MinMacs = static_cast<double>(FP8_SMALL_LAYER_MIN_MACS);
constexpr int64_t kFp8MinFeatures = FP8_SMALL_LAYER_MIN_FEATURES;

// Which GEMMs of one forward/backward pair run in FP8.
struct Plan {
  bool fprop = false, dgrad = false, wgrad = false;
  std::string reason;  // set when a converted layer under FP8 falls back, in whole or in part
};

// What one forward keeps for its backward. Its buffers come from the model's pool.
struct LinearSaved final : fp8_saved {
  Plan plan;
  int64_t rows = 0;
  fp8_dtype_t act = FP8_DTYPE_BF16;  // x's (wide) and dx's dtype
  fp8_dtype_t out = FP8_DTYPE_BF16;  // y's and dy's: act, or a residual's
  int32_t ndim = 0;
  int64_t y_shape[FP8_MAX_DIMS] = {};
  const void* x_hp = nullptr;  // x in A for a high-precision wgrad: the caller's x or x_copy
  PooledBuffer x_copy;         // an E4M3 hand-off dequantised into A
  PooledBuffer qxt;            // x's transposed E4M3 copy for an FP8 wgrad, its scale_inv behind the codes
  size_t qxt_scale_at = 0;
  uint64_t weights_version = 0;  // the weights the forward used (the dgrad needs the same)
  void release() override {
    x_copy.reset();
    qxt.reset();
  }
  const uint8_t* xt() const { return qxt.get<uint8_t>(); }
  float* xt_scale_inv() const { return reinterpret_cast<float*>(qxt.get<char>() + qxt_scale_at); }
};

class Linear final : public Layer {
 public:
  Linear(std::shared_ptr<Backend> backend, std::string name, int64_t in, int64_t out, bool with_bias)
      : Layer(backend, std::move(name), FP8_LAYER_LINEAR),
        in_(in),
        out_(out),
        bias_(with_bias),
        qw_(backend),
        qwt_(backend),
        w_si_(backend),
        w_hp_(backend),
        b_bf16_(backend),
        w_grid_(backend) {
    const int64_t w_shape[2] = {out, in};
    // The caller initialises the weights; zeros until then keep a forward defined.
    add_parameter("weight", 2, w_shape, 0.0f);
    params_.back().linear_weight = true;
    if (with_bias) add_parameter("bias", 1, &out, 0.0f);
  }

  // FP8 GEMMs need both features to be multiples of 16: other shapes stay in high precision.
  bool fp8_shape() const { return in_ % 16 == 0 && out_ % 16 == 0; }

  std::vector<fp8_role_t> state_roles(const Recipe* recipe) const override {
    if (!recipe || !fp8_shape()) return {};
    return {FP8_ROLE_FORWARD, FP8_ROLE_FORWARD, FP8_ROLE_BACKWARD};  // x, W, dy
  }

  void convert(const Recipe* recipe, States states) noexcept override {
    const bool fp8 = recipe && states.size() == 3;
    s_x_ = fp8 ? std::move(states[0]) : nullptr;
    s_w_ = fp8 ? std::move(states[1]) : nullptr;
    s_dy_ = fp8 ? std::move(states[2]) : nullptr;
    if (fp8) recipe_ = *recipe;
    try {
      stats_.reason.clear();
      if (recipe && !fp8_shape()) {
        const bool in_bad = in_ % 16 != 0;
        char why[200];
        std::snprintf(why, sizeof why, "not converted: %s = %" PRId64 " is not a multiple of 16, which FP8 GEMMs need",
                      in_bad ? "in_features" : "out_features", in_bad ? in_ : out_);
        stats_.reason = why;
      }
    } catch (...) {  // out of host memory for the text: the report goes without it
    }
    converted_ = fp8;
    ++epoch_;
    fp8_weight_ = CopyMark{};
    used_copy_at_ = kNever;
    pinned_ = false;
  }

  void scaling_states(std::vector<fp8_scaling*>& out) override {
    if (!converted_) return;
    out.push_back(s_x_.get());
    out.push_back(s_w_.get());
    out.push_back(s_dy_.get());
  }

  fp8_scaling* scaling(int32_t slot) override {
    switch (slot) {
      case FP8_SCALING_INPUT: return s_x_.get();
      case FP8_SCALING_WEIGHT: return s_w_.get();
      case FP8_SCALING_GRAD_OUTPUT: return s_dy_.get();
      default: return nullptr;
    }
  }

  bool saved_current(const Step& step, const fp8_saved& saved) const override {
    return static_cast<const LinearSaved&>(saved).weights_version == weights_version(step);
  }

  void check_dx(const fp8_saved& saved, const fp8_tensor* dx) const override {
    const LinearSaved& s = static_cast<const LinearSaved&>(saved);
    if (dx->dtype != s.act)
      fail(FP8_ERR_DTYPE, "dx has dtype ", dtype_name(dx->dtype), "; layer '", name_, "' expects ", dtype_name(s.act));
    int64_t x_shape[FP8_MAX_DIMS];
    for (int32_t i = 0; i < s.ndim; ++i) x_shape[i] = s.y_shape[i];
    x_shape[s.ndim - 1] = in_;
    require_shape(name_, dx, "dx", s.ndim, x_shape);
    if (s.plan.dgrad && !aligned16(dx->data))
      fail(FP8_ERR_INVALID_ARGUMENT, "dx's data is not 16-byte aligned, which layer '", name_, "''s FP8 dgrad needs");
  }

  int64_t input_features() const override { return in_; }
  int64_t output_features(int64_t) const override { return out_; }
  // Only under delayed scaling: the other recipes take x's scales from x itself, so the layer before
  // hands over a wide x.
  bool takes_fp8_input(const Step& step, int64_t rows) const override {
    return decide(step, rows, true).fprop && scaling() == FP8_SCALING_DELAYED;
  }
  bool takes_folded_input(const Step& step, int64_t rows) const override {
    const Plan p = decide(step, rows, true);
    return step.training && p.fprop && p.wgrad && scaling() == FP8_SCALING_DELAYED;
  }

  std::unique_ptr<fp8_saved> forward(const Step& step, const fp8_tensor* x, fp8_tensor* y,
                                     const FoldedActivation* folded) override {
    return run_forward(step, x, y, folded, nullptr);
  }
  std::unique_ptr<fp8_saved> forward_residual(const Step& step, const fp8_tensor* x, fp8_tensor* y,
                                              const FoldedActivation* folded, const ResidualAdd& r) override {
    return run_forward(step, x, y, folded, &r);
  }

  // y = x W^T + b (+ the residual, which the GEMM adds: y of its dtype, x and dx of r->act).
  std::unique_ptr<fp8_saved> run_forward(const Step& step, const fp8_tensor* x, fp8_tensor* y,
                                         const FoldedActivation* folded, const ResidualAdd* r) {
    require_layer_dtype(name_, y, "y", false);
    const fp8_dtype_t out_dt = y->dtype, act = r ? r->act : out_dt;
    if (out_dt != FP8_DTYPE_F32 && out_dt != FP8_DTYPE_BF16)
      fail(FP8_ERR_DTYPE, "y has dtype ", dtype_name(out_dt), "; layer '", name_, "' writes f32 or bf16");
    if (x->dtype == FP8_DTYPE_E5M2 || (!dtype_is_fp8(x->dtype) && x->dtype != act))
      fail(FP8_ERR_DTYPE, "x has dtype ", dtype_name(x->dtype), " and y ", dtype_name(act), "; layer '", name_,
           "' expects x of y's dtype or an e4m3 hand-off");
    if (x->ndim < 1 || x->cols() != in_)
      fail(FP8_ERR_SHAPE, "x has shape ", shape_string(x->ndim, x->shape), "; layer '", name_, "' expects [.., ", in_,
           "]");
    int64_t y_shape[FP8_MAX_DIMS];
    for (int32_t i = 0; i < x->ndim; ++i) y_shape[i] = x->shape[i];
    y_shape[x->ndim - 1] = out_;
    require_shape(name_, y, "y", x->ndim, y_shape);
    require_disjoint_buffers(name_, x, "x", y, "y");
    const int64_t m = x->rows();

    auto saved = std::make_unique<LinearSaved>();
    LinearSaved& s = *saved;
    // (The residual is the GEMM's C, which FP8 GEMMs need aligned as D.)
    const bool r_aligned = !r || aligned16(r->residual->data);
    s.plan = decide(step, m, aligned16(y->data) && r_aligned && (!dtype_is_fp8(x->dtype) || aligned16(x->data)),
                    !aligned16(y->data) ? "y"
                    : !r_aligned        ? "residual"
                                        : "x");
    const Plan& plan = s.plan;
    s.rows = m;
    s.act = act;
    s.out = out_dt;
    s.ndim = x->ndim;
    std::copy(y_shape, y_shape + x->ndim, s.y_shape);
    s.weights_version = weights_version(step);

    const bool x_fp8 = dtype_is_fp8(x->dtype);
    const bool want_qxt = step.training && plan.wgrad;
    if (folded && !(plan.fprop && want_qxt && !x_fp8 && scaling() == FP8_SCALING_DELAYED))
      fail(FP8_ERR_INTERNAL, "layer '", name_, "' was given an activation to fold it cannot take");
    // x in A for a high-precision fprop or wgrad (the caller's tensor, or the hand-off dequantised).
    const bool need_x_hp = !plan.fprop || (step.training && !plan.wgrad);
    const bool cells = cell_scaling();
    // This call's transient buffers, only where a cast runs (a high-precision call takes none): x's
    // cast and its scales, and cell scaling's workspace (the weight copies' cast may use it first).
    const bool cast_x = (plan.fprop || want_qxt) && (cells || !x_fp8);
    const bool cast_w = needs_fp8_weight(step, plan);
    ScratchLayout lay;
    const size_t at_qx = lay.add(cast_x ? static_cast<size_t>(m * in_) : 0);
    const size_t at_x_si = lay.add(!cast_x ? 0 : cells ? gemm_grid_floats(act_mode(), m, in_) * sizeof(float) : 16);
    const size_t at_ws = lay.add(cells ? std::max(cast_w ? recipe_quantize_workspace(weight_mode(), out_, in_) : 0,
                                                  cast_x ? recipe_quantize_workspace(act_mode(), m, in_) : 0)
                                       : 0);
    char* scratch = lay.base(*step.scratch);
    uint32_t* workspace = reinterpret_cast<uint32_t*>(scratch + at_ws);
    refresh_copies(step, plan, act, out_dt, workspace);

    Backend& be = step.backend;
    const void* x_hp = x->data;
    const uint8_t* qx = static_cast<const uint8_t*>(x->data);
    const float* qx_si = x->scale_inv;
    if (want_qxt) {
      const size_t codes = static_cast<size_t>(m * in_);
      s.qxt_scale_at = scale_inv_offset(codes);
      s.qxt = PooledBuffer(step.pool, s.qxt_scale_at + (cells ? gemm_grid_floats(act_mode(), in_, m) * 4 : 16));
    }
    uint8_t* qxt = want_qxt ? s.qxt.get<uint8_t>() : nullptr;
    // An FP8 x (a caller's E4M3 tensor: the layers before hand over FP8 under delayed scaling only)
    // is dequantised where high precision needs it, and under cell scaling, whose grids come from
    // the values.
    if (x_fp8 && (need_x_hp || cells)) {
      s.x_copy = PooledBuffer(step.pool, static_cast<size_t>(m * in_) * dtype_size(act));
      x_hp = s.x_copy.get();
      be.dequantize({qx, false, tensor_scale(x->scale_inv), s.x_copy.get(), act, m * in_});
    }
    if (cells && (plan.fprop || want_qxt)) {
      float* grid = reinterpret_cast<float*>(scratch + at_x_si);
      uint8_t* out = reinterpret_cast<uint8_t*>(scratch + at_qx);
      cast_cells(be, x_hp, act, m, in_, act_mode(), false, out, grid, qxt, qxt ? s.xt_scale_inv() : nullptr, *s_x_,
                 workspace);
      qx = out;
      qx_si = grid;
    } else if (x_fp8) {
      if (want_qxt) be.transpose({qx, m, in_, qxt, tensor_scale(x->scale_inv), tensor_scale(s.xt_scale_inv())});
    } else if (plan.fprop || want_qxt) {
      float* si = reinterpret_cast<float*>(scratch + at_x_si);
      QuantizeJob q{};
      q.in = x->data;
      q.in_dtype = act;
      q.rows = m;
      q.cols = in_;
      q.out = reinterpret_cast<uint8_t*>(scratch + at_qx);
      q.out_t = qxt;
      q.e5m2 = false;
      // A folded activation's output is cast with the activation's state, as its E4M3 hand-off was.
      fp8_scaling& state = folded ? *folded->state : *s_x_;
      cast_through(q, state);
      if (!state.current) state.pending = true;
      if (folded) {
        q.act = folded->act;
        q.act_forward = true;
      }
      q.out_scale_inv = tensor_scale(si);
      q.out_t_scale_inv = tensor_scale(qxt ? s.xt_scale_inv() : nullptr);
      be.quantize(q);
      qx = q.out;
      qx_si = si;
    }
    if (step.training) s.x_hp = x_hp;
    s.reads_input = step.training && !plan.wgrad && x_hp == x->data;

    GemmJob g{};
    g.m = m;
    g.n = out_;
    g.k = in_;
    g.d = y->data;
    g.d_dtype = out_dt;
    g.alpha = 1.0f;
    g.accumulate = r != nullptr;
    g.c = r ? r->residual->data : nullptr;
    if (plan.fprop && cells) {
      set_fp8_operands(g, qx, FP8_DTYPE_E4M3, gemm_grid(act_mode(), m, in_, const_cast<float*>(qx_si)),
                       qw_.ensure<uint8_t>(0), FP8_DTYPE_E4M3, weight_grid(false));
      g.fast_accumulation = act_mode() == ScaleMode::kRow;  // cuBLASLt refuses it with block scales
      if (bias_) {
        g.bias = b_bf16_.ensure(0);
        g.bias_dtype = FP8_DTYPE_BF16;
      }
    } else if (plan.fprop) {
      set_fp8_operands(g, qx, FP8_DTYPE_E4M3, qx_si, fp8_weight(), FP8_DTYPE_E4M3, w_si_.ensure<float>(0));
      g.fast_accumulation = true;
      if (bias_) {
        g.bias = b_bf16_.ensure(0);
        g.bias_dtype = FP8_DTYPE_BF16;
      }
    } else {
      g.a = x_hp;
      g.b = weight_in(step, act);
      g.a_dtype = g.b_dtype = act;
      if (bias_) {  // (of D's dtype, as cuBLASLt takes it with wide operands)
        g.bias = out_dt == FP8_DTYPE_F32 ? params_[1].value->data : b_bf16_.ensure(0);
        g.bias_dtype = out_dt;
      }
    }
    if (m > 0) be.gemm(g);
    record(step, plan);
    return saved;
  }

  bool folds_activation_grad(const fp8_saved& saved, bool dx_wanted) const override {
    const Plan& plan = static_cast<const LinearSaved&>(saved).plan;
    return scaling() == FP8_SCALING_DELAYED && plan.wgrad && (plan.dgrad || !dx_wanted);
  }

  void backward(const Step& step, fp8_saved& saved, const fp8_tensor* dy, fp8_tensor* dx, const void* dx_base,
                const FoldedActivation* folded) override {
    LinearSaved& s = static_cast<LinearSaved&>(saved);
    const fp8_dtype_t act = s.act;
    const int64_t m = s.rows;
    if (dy->dtype != s.out)
      fail(FP8_ERR_DTYPE, "dy has dtype ", dtype_name(dy->dtype), "; layer '", name_, "' expects ", dtype_name(s.out),
           " (the forward's y)");
    require_shape(name_, dy, "dy", s.ndim, s.y_shape);
    if (dx) {
      check_dx(s, dx);
      require_disjoint_buffers(name_, dy, "dy", dx, "dx");
    }
    const Plan& plan = s.plan;
    if (folded && !folds_activation_grad(s, dx != nullptr))
      fail(FP8_ERR_INTERNAL, "layer '", name_, "' was given an activation's gradient it cannot fold");
    Backend& be = step.backend;
    float* dbias = bias_ ? static_cast<float*>(params_[1].grad->data) : nullptr;
    fp8_tensor& grad = *params_[0].grad;
    const bool grad8 = dtype_is_fp8(grad.dtype);
    const bool dgrad8 = dx && plan.dgrad;
    const bool cells = cell_scaling();
    const bool cast_dy = dgrad8 || plan.wgrad;
    const size_t dy_grid = cells ? gemm_grid_floats(act_mode(), m, out_) : 0;
    // This call's transient buffers: dy's casts and their scales, the bias gradient's partials, cell
    // scaling's workspace, and the new dW of an FP8 gradient before it joins what the gradient holds.
    ScratchLayout lay;
    const size_t dy_bytes = cast_dy ? static_cast<size_t>(m * out_) : 0;
    const size_t at_qdy = lay.add(dy_bytes), at_qdyt = lay.add(plan.wgrad ? dy_bytes : 0);
    const size_t at_dy_si = lay.add(!cast_dy ? 0
                                    : cells  ? (dy_grid + gemm_grid_floats(act_mode(), out_, m)) * sizeof(float)
                                             : kScaleSlots * sizeof(float));
    const size_t at_partials = lay.add(dbias ? static_cast<size_t>(bias_grad_partials(m, out_)) * sizeof(float) : 0);
    const size_t at_ws = lay.add(cells ? recipe_quantize_workspace(act_mode(), m, out_) : 0);
    // dW of an FP8 gradient in BF16 where its GEMM can write that (FP8 or BF16 operands; cuBLASLt has
    // no F32 x F32 -> BF16), else F32.
    const fp8_dtype_t dw_dtype = plan.wgrad || act == FP8_DTYPE_BF16 ? FP8_DTYPE_BF16 : FP8_DTYPE_F32;
    const size_t at_dw = lay.add(grad8 && m > 0 ? static_cast<size_t>(out_ * in_) * dtype_size(dw_dtype) : 0);
    // A high-precision GEMM takes dy in x's dtype: a residual's dy of another dtype is converted.
    const bool hp_dy = (dx && !plan.dgrad) || !plan.wgrad;
    const bool convert_dy = s.out != act && hp_dy && m > 0;
    const size_t at_dy_act = lay.add(convert_dy ? static_cast<size_t>(m * out_) * dtype_size(act) : 0);
    char* scratch = lay.base(*step.scratch);
    const void* dy_act = dy->data;
    if (convert_dy) {
      be.convert({dy->data, s.out, scratch + at_dy_act, act, m * out_});
      dy_act = scratch + at_dy_act;
    }
    float* partials = dbias ? reinterpret_cast<float*>(scratch + at_partials) : nullptr;
    uint8_t* qdy = cast_dy ? reinterpret_cast<uint8_t*>(scratch + at_qdy) : nullptr;
    uint8_t* qdyt = plan.wgrad ? reinterpret_cast<uint8_t*>(scratch + at_qdyt) : nullptr;
    float* dy_si = reinterpret_cast<float*>(scratch + at_dy_si);
    float* dyt_si = cells ? dy_si + dy_grid : dy_si + kScaleSlot2;
    if (cells && cast_dy) {
      if (m > 0) {
        cast_cells(be, dy->data, s.out, m, out_, act_mode(), s_dy_->dtype == FP8_DTYPE_E5M2, qdy, dy_si, qdyt, dyt_si,
                   *s_dy_, reinterpret_cast<uint32_t*>(scratch + at_ws));
        if (dbias) be.bias_grad({dy->data, s.out, m, out_, dbias, partials});
      }
    } else if (cast_dy) {
      QuantizeJob q{};
      q.in = dy->data;
      q.in_dtype = s.out;
      q.rows = m;
      q.cols = out_;
      q.out = qdy;
      q.out_t = qdyt;
      q.e5m2 = s_dy_->dtype == FP8_DTYPE_E5M2;
      cast_through(q, *s_dy_);
      if (m > 0 && !s_dy_->current) s_dy_->pending = true;
      q.out_scale_inv = tensor_scale(dy_si);
      q.out_t_scale_inv = tensor_scale(qdyt ? dyt_si : nullptr);
      q.dbias = dbias;
      q.dbias_partials = partials;
      if (folded) {  // dy is the activation's output gradient: the cast makes the activation's dx
        q.act_x = folded->x;
        q.act = folded->act;
      }
      if (m > 0) be.quantize(q);
    } else if (dbias && m > 0) {
      be.bias_grad({dy->data, s.out, m, out_, dbias, partials});
    }

    if (dx && m > 0) {  // dx [m, in] (+)= dy [m, out] . W [out, in]
      GemmJob g{};
      g.m = m;
      g.n = in_;
      g.k = out_;
      g.d = dx->data;
      g.d_dtype = act;
      g.alpha = 1.0f;
      g.accumulate = dx_base != nullptr;
      g.c = dx_base;
      if (dgrad8 && cells) {
        set_fp8_operands(g, qdy, s_dy_->dtype, gemm_grid(act_mode(), m, out_, dy_si), qwt_.ensure<uint8_t>(0),
                         FP8_DTYPE_E4M3, weight_grid(true));
      } else if (dgrad8) {
        set_fp8_operands(g, qdy, s_dy_->dtype, dy_si, qwt_.ensure<uint8_t>(0), FP8_DTYPE_E4M3, w_si_.ensure<float>(0));
      } else {
        g.a = dy_act;
        g.b = weight_in(step, act);
        g.a_dtype = g.b_dtype = act;
        g.b_transposed = true;  // W is [out][in] = [k][n]
      }
      be.gemm(g);
    }

    if (m > 0) {  // dW [out, in] += dy^T [out, m] . x [m, in]
      // An FP8 gradient (O1..O3) takes the new dW from the call's scratch, rounded to BF16 where it
      // can be (half the bytes for the GEMM to write and the two passes to read), in one
      // requantising pass.
      GemmJob g{};
      g.m = out_;
      g.n = in_;
      g.k = m;
      g.d = grad8 ? scratch + at_dw : grad.data;
      g.d_dtype = grad8 ? dw_dtype : FP8_DTYPE_F32;
      g.alpha = 1.0f;
      g.accumulate = !grad8;
      if (plan.wgrad && cells) {
        set_fp8_operands(g, qdyt, s_dy_->dtype, gemm_grid(act_mode(), out_, m, dyt_si), s.xt(), FP8_DTYPE_E4M3,
                         gemm_grid(act_mode(), in_, m, s.xt_scale_inv()));
      } else if (plan.wgrad) {
        set_fp8_operands(g, qdyt, s_dy_->dtype, dyt_si, s.xt(), FP8_DTYPE_E4M3, s.xt_scale_inv());
      } else {
        g.a = dy_act;
        g.b = s.x_hp;
        g.a_dtype = g.b_dtype = act;
        g.a_transposed = true;  // dy is [m][out] = [k][m']
        g.b_transposed = true;  // x is [m][in] = [k][n]
      }
      be.gemm(g);
      if (grad8)
        be.grad_accumulate({static_cast<uint8_t*>(grad.data), grad.dtype == FP8_DTYPE_E5M2, g.d, out_ * in_,
                            params_[0].grad_scales(), nullptr, dw_dtype});
    }
  }

 private:
  static constexpr uint64_t kNever = ~uint64_t{0};
  // The scale_inv of a cast and of its transposed copy, each in its own 16-byte slot.
  static constexpr size_t kScaleSlot2 = 4, kScaleSlots = 8;

  static void set_fp8_operands(GemmJob& g, const void* a, fp8_dtype_t at, const ScaleDesc& a_si, const void* b,
                               fp8_dtype_t bt, const ScaleDesc& b_si) {
    g.a = a;
    g.a_dtype = at;
    g.a_scale_inv = a_si;
    g.b = b;
    g.b_dtype = bt;
    g.b_scale_inv = b_si;
  }
  static void set_fp8_operands(GemmJob& g, const void* a, fp8_dtype_t at, const float* a_si, const void* b,
                               fp8_dtype_t bt, const float* b_si) {
    set_fp8_operands(g, a, at, tensor_scale(a_si), b, bt, tensor_scale(b_si));
  }

  // The recipe's scaling (FP8_SCALING_*), and whether it makes grids of scales (rowwise, block).
  int64_t scaling() const { return converted_ ? recipe_.get(FP8_RECIPE_SCALING) : FP8_SCALING_DELAYED; }
  bool cell_scaling() const { return scaling() == FP8_SCALING_ROWWISE || scaling() == FP8_SCALING_BLOCK; }
  // The scale mode of x and dy (and their transposed copies), and of W (and its transpose).
  ScaleMode act_mode() const { return scaling() == FP8_SCALING_BLOCK ? ScaleMode::kBlock1x128 : ScaleMode::kRow; }
  ScaleMode weight_mode() const {
    return scaling() == FP8_SCALING_BLOCK ? ScaleMode::kBlock128x128 : ScaleMode::kRow;
  }
  // The grid of the weight copy ([out, in], fprop's b) or of its transpose ([in, out], dgrad's b).
  ScaleDesc weight_grid(bool transposed) {
    const size_t first = gemm_grid_floats(weight_mode(), out_, in_);
    float* p = w_grid_.ensure<float>((first + gemm_grid_floats(weight_mode(), in_, out_)) * sizeof(float));
    return transposed ? gemm_grid(weight_mode(), in_, out_, p + first) : gemm_grid(weight_mode(), out_, in_, p);
  }

  // One cast under cell scaling: in [rows, cols] -> out with `grid` (and out_t [cols, rows], quantised
  // along its own K, with grid_t, when out_t is set), grids as gemm_grid lays them out; cells whose
  // amax is not finite are counted in `state`.
  void cast_cells(Backend& be, const void* in, fp8_dtype_t dt, int64_t rows, int64_t cols, ScaleMode mode, bool e5m2,
                  uint8_t* out, float* grid, uint8_t* out_t, float* grid_t, fp8_scaling& state, uint32_t* workspace) {
    RecipeQuantizeJob j{};
    j.in = in;
    j.in_dtype = dt;
    j.rows = rows;
    j.cols = cols;
    j.e5m2 = e5m2;
    j.margin = static_cast<int32_t>(recipe_.get(FP8_RECIPE_MARGIN));
    j.pow2_scales = recipe_.power_2_scales();
    j.out = out;
    j.out_scale_inv = gemm_grid(mode, rows, cols, grid);
    if (out_t) {
      j.out_t = out_t;
      j.out_t_scale_inv = gemm_grid(mode, cols, rows, grid_t);
    }
    j.nonfinite_cells = reinterpret_cast<int64_t*>(&state.state->nonfinite_count);
    if (recipe_quantize_workspace(mode, rows, cols) > 0) j.workspace = workspace;
    be.recipe_quantize(j);
  }

  // The rule of fp8.h (fp8_layer_forward): FP8 when the model is converted and FP8 is on, except
  // where the shape, alignment (`misaligned` names the tensor unless `aligned`) or size forbids it
  // or the recipe overrides a GEMM.
  Plan decide(const Step& step, int64_t m, bool aligned, const char* misaligned = "") const {
    Plan p;
    if (!converted_ || !step.fp8) return p;
    char why[200] = "";
    const double macs = static_cast<double>(m) * static_cast<double>(in_) * static_cast<double>(out_);
    if (!aligned) {
      std::snprintf(why, sizeof why, "%s's data is not 16-byte aligned, which FP8 GEMMs need", misaligned);
    } else if (recipe_.get(FP8_RECIPE_SMALL_LAYER_FALLBACK) && (macs < kFp8MinMacs || std::min(in_, out_) < kFp8MinFeatures)) {
      if (macs < kFp8MinMacs)
        std::snprintf(why, sizeof why, "small: %" PRId64 " tokens x %" PRId64 " x %" PRId64
                      " is below 2^32 multiply-adds, where FP8 starts to pay off", m, in_, out_);
      else
        std::snprintf(why, sizeof why, "small: %s = %" PRId64 " is below %" PRId64 ", where FP8 starts to pay off",
                      in_ < kFp8MinFeatures ? "in_features" : "out_features", std::min(in_, out_), kFp8MinFeatures);
    }
    else if (cell_scaling() && m % 8 != 0)  // cuBLASLt's limit for per-row and block scales
      std::snprintf(why, sizeof why, "%" PRId64 " tokens is not a multiple of 8, which GEMMs with %s scales need", m,
                    scaling() == FP8_SCALING_BLOCK ? "block" : "per-row");
    if (why[0]) {
      p.reason = why;
      return p;
    }
    p.fprop = !recipe_.get(FP8_RECIPE_OVERRIDE_FPROP);
    p.dgrad = !recipe_.get(FP8_RECIPE_OVERRIDE_DGRAD);
    p.wgrad = !recipe_.get(FP8_RECIPE_OVERRIDE_WGRAD);
    if (p.wgrad && m % 16 != 0) {
      p.wgrad = false;
      std::snprintf(why, sizeof why, "wgrad in high precision: %" PRId64 " tokens is not a multiple of 16", m);
      p.reason = why;
    }
    return p;
  }

  void record(const Step& step, const Plan& p) {
    stats_.fprop = p.fprop;
    stats_.dgrad = step.training ? p.dgrad : -1;
    stats_.wgrad = step.training ? p.wgrad : -1;
    if (converted_ && step.fp8) {  // (an unconverted layer keeps the reason convert() gave)
      if (p.fprop || (step.training && (p.dgrad || p.wgrad))) ++stats_.fp8_calls;
      if (!p.reason.empty()) ++stats_.fallback_calls;
      stats_.reason = p.reason;
    }
  }

  // Whether a call of this plan reads the FP8 weight copies (fprop, or dgrad when training).
  static bool needs_fp8_weight(const Step& step, const Plan& p) { return p.fprop || (step.training && p.dgrad); }

  // The FP8 weight (and its transpose) once per weights version; the weight in the activation dtype
  // and the bf16 bias when a GEMM takes them. The weight is FP32, F16 (O1/O2) or already E4M3 (O3:
  // only its transpose is made).
  void refresh_copies(const Step& step, const Plan& p, fp8_dtype_t act, fp8_dtype_t out_dt, uint32_t* workspace) {
    const uint64_t version = weights_version(step);
    Backend& be = step.backend;
    const fp8_tensor& w = *params_[0].value;
    const int64_t n = out_ * in_;
    const bool w8 = needs_fp8_weight(step, p);
    if (w8 && cell_scaling() && !fp8_weight_.current(step, version)) {
      // From the weight in high precision (O3's E4M3 weight dequantised), both layouts in one cast.
      const bool wide = !dtype_is_fp8(w.dtype);
      const void* src = wide ? w.data : weight_in(step, act);
      const ScaleDesc g = weight_grid(false), gt = weight_grid(true);
      cast_cells(be, src, wide ? w.dtype : act, out_, in_, weight_mode(), false,
                 qw_.ensure<uint8_t>(static_cast<size_t>(n)), g.ptr, qwt_.ensure<uint8_t>(static_cast<size_t>(n)),
                 gt.ptr, *s_w_, workspace);
      fp8_weight_.made(version, step.capture_id);
    } else if (w8 && !fp8_weight_.current(step, version)) {
      // Under delayed scaling the copies of every layer that is due are made together, this one's
      // among them unless it did not use one at this or the previous weights version (its first
      // FP8 call) or its scale is pinned.
      if (groups_weight_copies(step)) make_weight_copies(step);
      if (!fp8_weight_.current(step, version)) {
        if (w.dtype == FP8_DTYPE_E4M3) {
          float* si = w_si_.ensure<float>(kScaleSlots * sizeof(float));
          be.transpose({static_cast<const uint8_t*>(w.data), out_, in_, qwt_.ensure<uint8_t>(static_cast<size_t>(n)),
                        tensor_scale(w.scale_inv), tensor_scale(si)});
        } else {
          be.quantize(weight_cast());
          weight_cast_queued();
        }
        fp8_weight_.made(version, step.capture_id);
      }
    }
    if (w8) used_copy_at_ = step.weights_version;
    if (!p.fprop || (step.training && !p.dgrad)) weight_in(step, act);
    const bool bf16_bias = bias_ && (p.fprop || out_dt == FP8_DTYPE_BF16);  // (cuBLASLt's FP8 bias is bf16)
    if (bf16_bias && !bf16_bias_.current(step, version)) {
      be.convert({params_[1].value->data, FP8_DTYPE_F32, b_bf16_.ensure(static_cast<size_t>(out_) * 2), FP8_DTYPE_BF16,
                  out_});
      bf16_bias_.made(version, step.capture_id);
    }
  }

  // The cast of the weight (FP32 or F16) into its FP8 copy and the copy's transpose, through the
  // pinned state after a checkpoint load, else the layer's; weight_cast_queued once it is queued.
  QuantizeJob weight_cast() {
    const int64_t n = out_ * in_;
    const fp8_tensor& w = *params_[0].value;
    float* si = w_si_.ensure<float>(kScaleSlots * sizeof(float));  // scale_inv, and at kScaleSlot2 the scale
    QuantizeJob q{};
    q.in = w.data;
    q.in_dtype = w.dtype;
    q.rows = out_;
    q.cols = in_;
    q.out = qw_.ensure<uint8_t>(static_cast<size_t>(n));
    q.out_t = qwt_.ensure<uint8_t>(static_cast<size_t>(n));
    q.e5m2 = false;
    cast_through(q, pinned_ ? *pinned_w_ : *s_w_);
    q.out_scale_inv = tensor_scale(si);
    q.out_t_scale_inv = tensor_scale(si);
    q.out_scale = tensor_scale(si + kScaleSlot2);
    return q;
  }
  // The layer's own state recorded an amax (a pinned one records none, and is used once: its
  // memory stays until the next pin, as the queued cast reads it).
  void weight_cast_queued() {
    if (!pinned_ && !s_w_->current) s_w_->pending = true;
    pinned_ = false;
  }

  // Whether the layer's weight copy can be made in a group: a cast (FP32 or F16 weight) under delayed
  // scaling with the layer's own state, and a copy that stays current once made (an eager call
  // after captured optimizer steps remakes its copy at every call).
  bool groups_weight_copies(const Step& step) const {
    return converted_ && scaling() == FP8_SCALING_DELAYED && !pinned_ && params_[0].value->dtype != FP8_DTYPE_E4M3 &&
           !(step.steps_replayed && step.capture_id == 0);
  }

  // Due: the layer used its copy at this weights version or the one before (so a layer that stops
  // running FP8 is cast once more at most), and the copy is not current.
  bool stage_weight_copy(const Step& step, std::vector<QuantizeJob>& jobs) override {
    if (!groups_weight_copies(step) || used_copy_at_ == kNever || used_copy_at_ + 1 < step.weights_version ||
        fp8_weight_.current(step, weights_version(step)))
      return false;
    jobs.push_back(weight_cast());
    return true;
  }
  void weight_copy_made(const Step& step) override {
    weight_cast_queued();
    fp8_weight_.made(weights_version(step), step.capture_id);
  }

  bool weight_copy_scale(uint64_t model_version, float* scale) const override {
    if (!converted_ || cell_scaling() || params_[0].value->dtype == FP8_DTYPE_E4M3 ||
        fp8_weight_.version != weights_version(model_version))
      return false;
    backend_->copy_to_host(scale, w_si_.get<float>() + kScaleSlot2, sizeof(float));
    return true;
  }

  // (Under the other recipes the copy's scales follow from the weights alone: nothing to pin.)
  void pin_weight_copy_scale(float scale) override {
    pinned_ = scale > 0.0f && scaling() == FP8_SCALING_DELAYED;
    if (pinned_) pinned_w_ = new_state(recipe_, FP8_ROLE_FORWARD, scale);
  }

  // The weight in the activation dtype `act` for a high-precision GEMM: the value itself, or a copy
  // made once per weights version and dtype (a backward remakes it when another forward in flight
  // used another dtype since).
  const void* weight_in(const Step& step, fp8_dtype_t act) {
    const fp8_tensor& w = *params_[0].value;
    if (w.dtype == act) return w.data;
    const uint64_t version = weights_version(step);
    if (!hp_weight_.current(step, version) || hp_weight_dtype_ != act) {
      const int64_t n = out_ * in_;
      void* out = w_hp_.ensure(static_cast<size_t>(n) * dtype_size(act));
      if (dtype_is_fp8(w.dtype))
        step.backend.dequantize({static_cast<const uint8_t*>(w.data), false, tensor_scale(w.scale_inv), out, act, n});
      else
        step.backend.convert({w.data, w.dtype, out, act, n});
      hp_weight_.made(version, step.capture_id);
      hp_weight_dtype_ = act;
    }
    return w_hp_.get();
  }
  const uint8_t* fp8_weight() {
    const fp8_tensor& w = *params_[0].value;
    return w.dtype == FP8_DTYPE_E4M3 ? static_cast<const uint8_t*>(w.data) : qw_.ensure<uint8_t>(0);
  }

  int64_t in_, out_;
  bool bias_;
  Recipe recipe_;
  std::unique_ptr<fp8_scaling> s_x_, s_w_, s_dy_;
  DeviceBuffer qw_, qwt_, w_si_;  // FP8 weight, its transpose, their scale_inv (and the scale)
  std::unique_ptr<fp8_scaling> pinned_w_;  // the next weight copy's state after a checkpoint load,
  bool pinned_ = false;                    // until that copy is made
  DeviceBuffer w_hp_, b_bf16_;  // the weight in the activation dtype (when the value is not), the bf16 bias
  // Which weights a copy was made from, and in which CUDA graph capture. A captured sequence never
  // relies on a copy made outside it (its replays come after weights changed by steps the capture
  // cannot see), so the first forward of a capture remakes the copies; later micro-batches of the
  // same capture reuse them, as eager ones do.
  struct CopyMark {
    uint64_t version = kNever, capture = 0;
    bool current(const Step& step, uint64_t v) const {
      if (step.steps_replayed && step.capture_id == 0) return false;
      return version == v && capture == step.capture_id;
    }
    void made(uint64_t v, uint64_t capture_id) { version = v, capture = capture_id; }
  };
  CopyMark fp8_weight_, hp_weight_, bf16_bias_;
  uint64_t used_copy_at_ = kNever;  // the model's weights version at the last call that read the FP8 copy
  fp8_dtype_t hp_weight_dtype_ = FP8_DTYPE_F32;
  DeviceBuffer w_grid_;  // cell scaling: the grids of the weight copy and of its transpose
};

}  // namespace

void make_weight_copies(const Step& step) {
  std::vector<QuantizeJob> jobs;
  std::vector<Layer*> staged;
  for (const auto& layer : step.layers)
    if (layer->stage_weight_copy(step, jobs)) staged.push_back(layer.get());
  if (jobs.empty()) return;
  step.backend.quantize_group(jobs.data(), jobs.size());
  for (Layer* layer : staged) layer->weight_copy_made(step);  // (only once the casts are queued)
}

std::unique_ptr<Layer> make_linear(std::shared_ptr<Backend> backend, std::string name, int64_t in_features,
                                   int64_t out_features, bool with_bias) {
  return std::make_unique<Linear>(std::move(backend), std::move(name), in_features, out_features, with_bias);
}

}  // namespace fp8::nn
