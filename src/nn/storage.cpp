#include "nn/storage.hpp"

#include <algorithm>
#include <utility>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/objects.hpp"
#include "core/optim_rule.hpp"
#include "core/recipe.hpp"
#include "nn/layer.hpp"

namespace fp8::nn {

Arena::Arena(std::shared_ptr<Backend> backend, size_t bytes) : bytes_(bytes) {
  char* data = static_cast<char*>(backend->allocate(bytes));
  memory_ = std::shared_ptr<char>(data, [backend = std::move(backend)](char* p) { backend->release(p); });
}

namespace {

size_t align_up(size_t n) {
  return (n + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
}

constexpr size_t kScaleSlot = 16;  // bytes per tensor in the scale arrays (a GradScales; a scale_inv)
static_assert(sizeof(GradScales) == kScaleSlot, "one GradScales per slot");

// Where one parameter goes in a layout.
struct Placement {
  fp8_dtype_t value_dtype, grad_dtype;
  size_t value_at, grad_at, master_at;  // byte offsets in their arenas
  int64_t lo, hi;                       // the elements whose master this rank keeps (O3)
  bool master;
};

}  // namespace

// The arenas of one layout, and where every parameter sits in them.
struct ParamStore::Arenas {
  size_t values[5] = {}, grads[5] = {}, masters = 0;  // bytes in use
  std::vector<Placement> places;
  std::vector<Bucket> buckets;
  std::vector<int32_t> param_bucket;

  // With `shares` (nranks > 0) the parameters are grouped into buckets, and at O3 this rank keeps
  // the masters of its piece of each bucket of the E4M3 weights.
  Arenas(const std::vector<Parameter*>& params, int32_t level, fp8_dtype_t grad8, Shares shares) {
    const auto is_msamp = [&](const Parameter* p) { return p->linear_weight && level > 0; };
    const auto grad_dtype = [&](const Parameter* p) { return is_msamp(p) ? grad8 : FP8_DTYPE_F32; };
    if (shares.nranks > 0) {
      // The buckets: parameters in order, closed once their gradients reach bucket_bytes.
      size_t filled = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        if (filled == 0) buckets.push_back({static_cast<int32_t>(i), static_cast<int32_t>(i)});
        buckets.back().last = static_cast<int32_t>(i) + 1;
        param_bucket.push_back(static_cast<int32_t>(buckets.size()) - 1);
        filled += align_up(static_cast<size_t>(params[i]->value->numel) * dtype_size(grad_dtype(params[i])));
        if (filled >= shares.bucket_bytes) filled = 0;
      }
    }
    const size_t unit = static_cast<size_t>(std::max(shares.nranks, 1)) * kSliceAlign;
    for (Bucket& b : buckets) {  // the FP8 ranges first: a master's share depends on its bucket's size
      b.fp8_at = grads[grad8];
      b.f32_at = grads[FP8_DTYPE_F32];
      for (int32_t i = b.first; i < b.last; ++i) {
        const size_t n = static_cast<size_t>(params[static_cast<size_t>(i)]->value->numel);
        if (grad_dtype(params[static_cast<size_t>(i)]) == grad8)
          grads[grad8] += align_up(n);
        else
          grads[FP8_DTYPE_F32] += align_up(n * sizeof(float));
      }
      grads[grad8] = (grads[grad8] + unit - 1) / unit * unit;
      b.fp8_bytes = grads[grad8] - b.fp8_at;
      b.f32_bytes = grads[FP8_DTYPE_F32] - b.f32_at;
    }
    std::fill(std::begin(grads), std::end(grads), size_t{0});
    for (size_t i = 0; i < params.size(); ++i) {
      const Parameter* p = params[i];
      Placement pl{};
      const bool msamp = is_msamp(p);
      pl.value_dtype = !msamp ? FP8_DTYPE_F32 : level == 3 ? FP8_DTYPE_E4M3 : FP8_DTYPE_F16;
      pl.grad_dtype = grad_dtype(p);
      pl.master = msamp && level == 3;
      const size_t n = static_cast<size_t>(p->value->numel);
      if (!buckets.empty() && buckets[static_cast<size_t>(param_bucket[i])].first == static_cast<int32_t>(i)) {
        const Bucket& b = buckets[static_cast<size_t>(param_bucket[i])];
        grads[grad8] = b.fp8_at;  // (the E4M3 weights are laid out as their FP8 gradients)
        if (level == 3) values[FP8_DTYPE_E4M3] = b.fp8_at;
      }
      pl.value_at = values[pl.value_dtype];
      values[pl.value_dtype] += align_up(n * dtype_size(pl.value_dtype));
      pl.grad_at = grads[pl.grad_dtype];
      grads[pl.grad_dtype] += align_up(n * dtype_size(pl.grad_dtype));
      pl.master_at = masters;
      pl.lo = 0;
      pl.hi = static_cast<int64_t>(n);
      if (pl.master && !buckets.empty()) {
        const Bucket& b = buckets[static_cast<size_t>(param_bucket[i])];
        const size_t piece = b.piece(shares.nranks);
        const size_t own_lo = b.fp8_at + piece * static_cast<size_t>(shares.rank), own_hi = own_lo + piece;
        const size_t at = pl.value_at;
        pl.lo = static_cast<int64_t>(std::min(n, std::max(own_lo, at) - at));
        pl.hi = std::max(pl.lo, static_cast<int64_t>(std::min(n, std::max(own_hi, at) - at)));
      }
      if (pl.master) masters += align_up(static_cast<size_t>(pl.hi - pl.lo) * 2);
      places.push_back(pl);
    }
    if (!buckets.empty()) {  // (the last bucket's padding belongs to the arenas)
      grads[grad8] = buckets.back().fp8_at + buckets.back().fp8_bytes;
      if (level == 3) values[FP8_DTYPE_E4M3] = grads[grad8];
    }
  }
};

namespace {

// Carries one parameter's value (with O3's master and scale_inv) and gradient (with its scales)
// from where they are now into the slices at value/grad/master/value_scale_inv/grad_scales.
// `master` is indexed by element: it holds [pl.lo, pl.hi), and so does p.master where p is O3 now.
void transfer(Backend& be, const std::shared_ptr<Backend>& owner, const Parameter& p, const Placement& pl, char* value,
              char* grad, uint16_t* master, float* value_scale_inv, GradScales* grad_scales) {
  const fp8_tensor& v = *p.value;
  const fp8_tensor& g = *p.grad;
  const int64_t n = v.numel;
  // The value: from its high-precision form (F32, F16, or O3's F16 master).
  const void* hp = v.dtype == FP8_DTYPE_E4M3 ? static_cast<const void*>(p.master) : v.data;
  const fp8_dtype_t hp_dtype = v.dtype == FP8_DTYPE_E4M3 ? FP8_DTYPE_F16 : v.dtype;
  if (pl.value_dtype == v.dtype && v.dtype == FP8_DTYPE_E4M3) {
    be.copy(value, v.data, static_cast<size_t>(n));
    be.copy(master + pl.lo, p.master + pl.lo, static_cast<size_t>(pl.hi - pl.lo) * 2);
    be.copy(value_scale_inv, v.scale_inv, sizeof(float));
  } else if (pl.value_dtype == FP8_DTYPE_E4M3) {
    // O3: the master rounds the value to F16; the E4M3 copy is scaled by the master's amax, as the
    // optimizer's later steps scale it (promote_compact). The whole master is made here; this rank
    // keeps its share of it.
    const Arena full(owner, static_cast<size_t>(n) * 2);
    be.convert({hp, hp_dtype, full.data(), FP8_DTYPE_F16, n});
    const Arena amax(owner, sizeof(float));
    be.amax({full.data(), FP8_DTYPE_F16, n, reinterpret_cast<float*>(amax.data()), nullptr});
    float p_amax = 0.0f;
    be.copy_to_host(&p_amax, amax.data(), sizeof p_amax);
    Recipe plain;
    const auto state = make_scaling(owner, plain, FP8_ROLE_FORWARD, bound_scale(448.0, p_amax));
    QuantizeJob q{};
    q.in = full.data();
    q.in_dtype = FP8_DTYPE_F16;
    q.rows = 1;
    q.cols = n;
    q.out = reinterpret_cast<uint8_t*>(value);
    q.state = state->state;
    q.out_scale_inv = tensor_scale(value_scale_inv);
    be.quantize(q);
    be.copy(master + pl.lo, full.data() + pl.lo * 2, static_cast<size_t>(pl.hi - pl.lo) * 2);
    be.synchronize();  // before `state` and `full` go
  } else {
    be.convert({hp, hp_dtype, value, pl.value_dtype, n});
  }
  // The gradient, what it holds so far included.
  const bool from8 = dtype_is_fp8(g.dtype), to8 = dtype_is_fp8(pl.grad_dtype);
  const GradScales* from_scales = from8 ? p.grad_scales() : nullptr;
  if (g.dtype == pl.grad_dtype) {
    be.copy(grad, g.data, g.nbytes());
    if (to8) be.copy(grad_scales, from_scales, sizeof(GradScales));
  } else if (!to8) {  // FP8 -> F32
    be.dequantize({static_cast<const uint8_t*>(g.data), g.dtype == FP8_DTYPE_E5M2,
                   tensor_scale(&from_scales->scale_inv), grad, FP8_DTYPE_F32, n});
  } else {  // F32 (or the other FP8 format, through F32) -> FP8, by one requantising accumulation
    Arena widened;
    const float* f32 = static_cast<const float*>(g.data);
    if (from8) {
      widened = Arena(owner, static_cast<size_t>(n) * sizeof(float));
      be.dequantize({static_cast<const uint8_t*>(g.data), g.dtype == FP8_DTYPE_E5M2,
                     tensor_scale(&from_scales->scale_inv), widened.data(), FP8_DTYPE_F32, n});
      f32 = reinterpret_cast<const float*>(widened.data());
    }
    be.zero(grad, static_cast<size_t>(n));
    be.zero(grad_scales, sizeof(GradScales));
    be.grad_accumulate({reinterpret_cast<uint8_t*>(grad), pl.grad_dtype == FP8_DTYPE_E5M2, f32, n, grad_scales});
    if (from8) be.synchronize();  // before `widened` goes
  }
}

const char* const kFp8GradRefusal =
    "this FP8 gradient keeps its per-tensor amax with it (MS-AMP level); add to it with fp8_model_accumulate_grad, "
    "clear it with fp8_model_zero_grad";
const char* const kO3WeightRefusal =
    "at O3 the model's F16 master is the weight and this E4M3 tensor its copy; write the weights with "
    "fp8_model_write_parameter, or load them with fp8_model_import_safetensors or fp8_checkpoint_load";

}  // namespace

void ParamStore::layout(const std::vector<Parameter*>& params, int32_t level, fp8_dtype_t grad_dtype, bool slack) {
  Backend& be = *backend_;
  be.join_side();  // (the gradients carried over are whole: no exchange is still writing them)
  if (level == 0) grad_dtype = FP8_DTYPE_E5M2;  // (no FP8 gradients: one canonical value)
  const Arenas want(params, level, grad_dtype, shares_);
  const size_t scale_bytes = params.size() * kScaleSlot;
  // Appending to the layout in place: same level, every parameter already stored sits where the
  // new layout puts it, and the arenas have room.
  // Without `slack` the arenas must fit exactly (a converted model keeps no room it cannot use).
  auto fits = [&](const Arena& a, size_t need) { return slack ? a.bytes() >= need : a.bytes() == need; };
  bool in_place = level == level_ && grad_dtype == grad_dtype_ && shares_ == applied_ &&
                  fits(grad_scales_, scale_bytes) && fits(value_scales_, scale_bytes) && fits(masters_, want.masters);
  for (int d = 0; in_place && d < 5; ++d) in_place = fits(values_[d], want.values[d]) && fits(grads_[d], want.grads[d]);
  for (size_t i = 0; in_place && i < params.size(); ++i) {
    const Parameter& p = *params[i];
    const Placement& pl = want.places[i];
    in_place = p.value->owns_data || (p.value->data == values_[pl.value_dtype].data() + pl.value_at &&
                                      p.value->dtype == pl.value_dtype && p.grad->dtype == pl.grad_dtype);
  }
  if (masters_sharded() && !in_place)
    fail(FP8_ERR_INVALID_STATE, "the model's F16 master weights are sharded over its ", applied_.nranks,
         " ranks (O3, data-parallel), so this rank holds only its share of them; changing the layers, the level or "
         "the communicator would need the other shares. Save a checkpoint and load it into a model built anew");
  auto grow = [&](size_t bytes) { return slack ? 2 * bytes : bytes; };
  Arena values[5], grads[5], masters, grad_scales, value_scales;
  Arena* v = values_;
  Arena* g = grads_;
  Arena* mas = &masters_;
  Arena* gs = &grad_scales_;
  Arena* vs = &value_scales_;
  if (!in_place) {  // a new set of arenas, filled below, committed at the end
    for (int d = 0; d < 5; ++d) {
      if (want.values[d]) {
        values[d] = Arena(backend_, grow(want.values[d]));
        be.zero(values[d].data(), values[d].bytes());  // the padding between slices stays zero
      }
      if (want.grads[d]) {
        grads[d] = Arena(backend_, grow(want.grads[d]));
        be.zero(grads[d].data(), grads[d].bytes());  // (the padding stays zero)
      }
    }
    if (want.masters) {
      masters = Arena(backend_, grow(want.masters));
      be.zero(masters.data(), masters.bytes());
    }
    if (scale_bytes) {
      grad_scales = Arena(backend_, grow(scale_bytes));
      value_scales = Arena(backend_, grow(scale_bytes));
      be.zero(grad_scales.data(), grad_scales.bytes());
      be.zero(value_scales.data(), value_scales.bytes());
    }
    v = values, g = grads, mas = &masters, gs = &grad_scales, vs = &value_scales;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const Parameter& p = *params[i];
    if (in_place && !p.value->owns_data) continue;
    const Placement& pl = want.places[i];
    transfer(be, backend_, p, pl, v[pl.value_dtype].data() + pl.value_at, g[pl.grad_dtype].data() + pl.grad_at,
             pl.master ? reinterpret_cast<uint16_t*>(mas->data() + pl.master_at) - pl.lo : nullptr,
             reinterpret_cast<float*>(vs->data() + i * kScaleSlot),
             reinterpret_cast<GradScales*>(gs->data() + i * kScaleSlot));
  }
  be.synchronize();  // every transfer has read its source before the sources go

  // Commit (nothing below throws).
  for (size_t i = 0; i < params.size(); ++i) {
    Parameter& p = *params[i];
    const Placement& pl = want.places[i];
    fp8_tensor& value = *p.value;
    fp8_tensor& grad = *p.grad;
    value.keeper.reset();  // (a new layer's own memory, or the old arena's share)
    grad.keeper.reset();
    be.release(value.scale_inv_allocation);
    be.release(grad.scale_inv_allocation);
    value.owns_data = grad.owns_data = false;
    value.scale_inv_allocation = grad.scale_inv_allocation = nullptr;
    value.dtype = pl.value_dtype;
    value.data = v[pl.value_dtype].data() + pl.value_at;
    value.keeper = v[pl.value_dtype].memory();
    value.scale_inv =
        pl.value_dtype == FP8_DTYPE_E4M3 ? reinterpret_cast<float*>(vs->data() + i * kScaleSlot) : nullptr;
    value.write_refusal = pl.value_dtype == FP8_DTYPE_E4M3 ? kO3WeightRefusal : nullptr;
    grad.dtype = pl.grad_dtype;
    grad.data = g[pl.grad_dtype].data() + pl.grad_at;
    grad.keeper = g[pl.grad_dtype].memory();
    grad.scale_inv = dtype_is_fp8(pl.grad_dtype) ? reinterpret_cast<float*>(gs->data() + i * kScaleSlot) : nullptr;
    grad.write_refusal = dtype_is_fp8(pl.grad_dtype) ? kFp8GradRefusal : nullptr;
    p.master = pl.master ? reinterpret_cast<uint16_t*>(mas->data() + pl.master_at) - pl.lo : nullptr;
    p.owned_lo = pl.lo;
    p.owned_hi = pl.hi;
  }
  if (!in_place) {
    for (int d = 0; d < 5; ++d) values_[d] = std::move(values[d]), grads_[d] = std::move(grads[d]);
    masters_ = std::move(masters);
    grad_scales_ = std::move(grad_scales);
    value_scales_ = std::move(value_scales);
  }
  for (int d = 0; d < 5; ++d) used_values_[d] = want.values[d], used_grads_[d] = want.grads[d];
  used_masters_ = want.masters;
  used_scales_ = scale_bytes;
  level_ = level;
  grad_dtype_ = grad_dtype;
  applied_ = shares_;
  buckets_ = want.buckets;
  param_bucket_ = want.param_bucket;
  ++generation_;
}

void ParamStore::flat(int32_t role, fp8_dtype_t dtype, void** data, size_t* bytes) const {
  const Arena* a = role == kMasters ? (dtype == FP8_DTYPE_F16 ? &masters_ : nullptr)
                                    : (role == kValues ? &values_[dtype] : &grads_[dtype]);
  const size_t used = role == kMasters ? used_masters_ : role == kValues ? used_values_[dtype] : used_grads_[dtype];
  *data = a && used ? a->data() : nullptr;
  *bytes = a && used ? used : 0;
}

std::vector<std::pair<void*, size_t>> ParamStore::arenas() const {
  std::vector<std::pair<void*, size_t>> out;
  const auto add = [&](const Arena& a, size_t used) {
    if (used) out.emplace_back(a.data(), used);
  };
  if (!masters_sharded()) add(masters_, used_masters_);  // (sharded: each rank's share is its own)
  add(grad_scales_, used_scales_);
  add(value_scales_, used_scales_);
  for (int d = 0; d < 5; ++d) add(values_[d], used_values_[d]), add(grads_[d], used_grads_[d]);
  return out;
}

void ParamStore::zero_grads() {
  for (int d = 0; d < 5; ++d) backend_->zero(grads_[d].data(), used_grads_[d]);
  backend_->zero(grad_scales_.data(), used_scales_);
}

}  // namespace fp8::nn
