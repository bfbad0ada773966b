#include "dist/data_parallel.hpp"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/objects.hpp"
#include "nn/model.hpp"
#include "optim/optimizer.hpp"

namespace fp8::dist {

namespace {

// Every rank's `bytes` of host data, in rank order, through the backend's memory.
std::vector<unsigned char> gather_host(Transport& t, const std::shared_ptr<Backend>& be, const void* mine,
                                       size_t bytes) {
  const size_t n = static_cast<size_t>(t.size());
  std::vector<unsigned char> out(n * bytes);
  if (!bytes) return out;
  nn::Arena staging(be, n * bytes);
  char* slot = staging.data() + static_cast<size_t>(t.rank()) * bytes;
  be->copy_from_host(slot, mine, bytes);
  t.all_gather(slot, staging.data(), bytes);
  be->copy_to_host(out.data(), staging.data(), n * bytes);  // (waits for the collective)
  t.check();
  return out;
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h | 1;  // 0 is kept for "no such item"
}

// What must be the same on every rank, one line per item, in a fixed order.
std::vector<std::string> describe(const fp8_model& m, const char* optimizer_kind) {
  std::vector<std::string> items;
  items.push_back("recipe " + (m.recipe ? m.recipe->to_string() : std::string("none (not converted)")));
  items.push_back("storage level " + std::to_string(m.store ? m.store->level() : 0));
  items.push_back(std::string("training ") + (m.training ? "on" : "off") + ", autowrap " + (m.autowrap ? "on" : "off"));
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const nn::Layer& l = *m.layers[i];
    std::ostringstream os;
    os << "layer " << i << " '" << l.name() << "' (" << nn::kind_name(l.kind()) << (l.converted() ? ", converted" : "")
       << ")";
    for (const nn::Parameter& p : l.parameters())
      os << " " << p.name << " " << shape_string(p.value->ndim, p.value->shape) << " " << dtype_name(p.value->dtype);
    items.push_back(os.str());
  }
  if (optimizer_kind) items.push_back(std::string("optimizer ") + optimizer_kind);
  return items;
}

}  // namespace

void require_same_model(Transport& t, const fp8_model& m, const char* optimizer_kind, const char* when) {
  const std::shared_ptr<Backend>& be = m.backend;
  const std::vector<std::string> items = describe(m, optimizer_kind);
  const uint64_t count = items.size();
  const auto counts = gather_host(t, be, &count, sizeof count);
  uint64_t most = 0;
  for (int32_t k = 0; k < t.size(); ++k) {
    uint64_t c;
    std::memcpy(&c, counts.data() + k * sizeof c, sizeof c);
    most = std::max(most, c);
  }
  std::vector<uint64_t> hashes(most, 0);
  for (size_t i = 0; i < items.size(); ++i) hashes[i] = fnv1a(items[i]);
  const auto all = gather_host(t, be, hashes.data(), most * sizeof(uint64_t));
  const auto hash_of = [&](int32_t rank, uint64_t i) {
    uint64_t h;
    std::memcpy(&h, all.data() + (rank * most + i) * sizeof h, sizeof h);
    return h;
  };
  for (uint64_t i = 0; i < most; ++i) {
    int32_t differs = -1;
    for (int32_t k = 1; k < t.size() && differs < 0; ++k)
      if (hash_of(k, i) != hash_of(0, i)) differs = k;
    if (differs < 0) continue;
    // Every rank reaches this point with the same i and rank: fetch both texts and refuse alike.
    constexpr size_t kText = 240;
    char text[kText] = {};
    const std::string mine = i < items.size() ? items[i] : "(nothing: fewer layers)";
    std::memcpy(text, mine.data(), std::min(mine.size(), kText - 1));
    const auto texts = gather_host(t, be, text, kText);
    const auto text_of = [&](int32_t rank) {
      return std::string(reinterpret_cast<const char*>(texts.data()) + rank * kText);
    };
    fail(FP8_ERR_INVALID_STATE, when, ": the ranks' models differ; rank 0 has ", text_of(0), ", rank ", differs,
         " has ", text_of(differs), ". Every rank must build, convert and optimise the same model");
  }
}

void broadcast_model(Transport& t, fp8_model& m) {
  if (m.store)
    for (const auto& [data, bytes] : m.store->arenas()) t.broadcast(data, bytes, 0);
  std::vector<fp8_scaling*> states;
  for (auto& l : m.layers) l->scaling_states(states);
  for (fp8_scaling* s : states)
    t.broadcast(s->state, sizeof(ScalingHeader) + sizeof(float) * static_cast<size_t>(s->history_len), 0);
  ++m.weights_version;  // the layers remake their FP8 weight copies from the new values
  for (nn::Parameter* p : nn::all_parameters(m)) ++p->value->version;
}

// ---- the amax agreement ---------------------------------------------------------------------------

struct ModelComm::Plan {
  uint64_t generation = ~uint64_t{0};
  // FP8 gradients: the arena and this rank's share of it.
  uint8_t* codes = nullptr;
  size_t piece = 0;
  bool e5m2 = false;
  int32_t tensor_count = 0;
  nn::Arena recv, mean, sender_scales, amax, chunks;
  int64_t chunk_count = 0;
  // FP32 gradients.
  float* f32 = nullptr;
  size_t f32_count = 0;
  // The scaling states' amaxes, gathered.
  nn::Arena amaxes;
  size_t amax_count = 0;
};

ModelComm::ModelComm() = default;
ModelComm::~ModelComm() = default;

namespace {

ModelComm::Plan& plan_of(fp8_model& m) {
  if (!m.comm->plan) m.comm->plan = std::make_unique<ModelComm::Plan>();
  return *m.comm->plan;
}

}  // namespace

void reduce_amax(Transport& t, fp8_model& m, const std::vector<fp8_scaling*>& states) {
  t.check();
  if (states.empty() || t.size() == 1) return;  // (one rank's amaxes are the maxima)
  Backend& be = *m.backend;
  ModelComm::Plan& plan = plan_of(m);
  if (plan.amax_count < states.size())  // (the same on every rank: agreed before the reduce)
    all_or_none(
        t, m.backend, "the amax agreement's buffer",
        [&] {
          plan.amaxes = nn::Arena(m.backend, states.size() * sizeof(uint32_t));
          plan.amax_count = states.size();
        },
        [] {});
  // Slot 0 of each state, in the model's order (the same on every rank); a model's states sit in one
  // arena at one stride, so each run of equal strides is one strided copy.
  std::vector<char*> slots;
  for (fp8_scaling* s : states) slots.push_back(reinterpret_cast<char*>(scaling_history(s->state)));
  char* buf = plan.amaxes.data();
  const auto runs = [&](auto&& copy) {
    size_t first = 0;
    while (first < slots.size()) {
      size_t last = first + 1;
      ptrdiff_t stride = last < slots.size() ? slots[last] - slots[first] : 0;
      if (stride <= 0) stride = sizeof(float);  // a run of one (a pitch must cover its row)
      while (last < slots.size() && slots[last] - slots[last - 1] == stride) ++last;
      copy(slots[first], static_cast<size_t>(stride), first, last - first);
      first = last;
    }
  };
  runs([&](char* at, size_t stride, size_t i, size_t count) {
    be.copy_2d(buf + i * sizeof(float), sizeof(float), at, stride, sizeof(float), count);
  });
  t.all_reduce(buf, slots.size(), ElemType::kU32, ReduceOp::kMax);
  runs([&](char* at, size_t stride, size_t i, size_t count) {
    be.copy_2d(at, stride, buf + i * sizeof(float), sizeof(float), sizeof(float), count);
  });
}

// ---- the gradient exchange --------------------------------------------------------------------------

namespace {

void build_plan(fp8_model& m, Transport& t, ModelComm::Plan& plan) {
  nn::ParamStore& store = *m.store;
  const auto n = static_cast<size_t>(t.size());
  const auto r = static_cast<size_t>(t.rank());
  ModelComm::Plan fresh;
  fresh.generation = store.generation();
  void* data = nullptr;
  size_t bytes = 0;
  store.flat(nn::kGrads, FP8_DTYPE_F32, &data, &bytes);
  fresh.f32 = static_cast<float*>(data);
  fresh.f32_count = bytes / sizeof(float);
  const fp8_dtype_t d8 = store.grad_dtype();
  store.flat(nn::kGrads, d8, &data, &bytes);
  const std::vector<nn::Parameter*> params = nn::all_parameters(m);
  if (bytes) {
    fresh.piece = store.share_of(nn::kGrads, d8);
    if (fresh.piece * n > store.grad_capacity(d8))
      fail(FP8_ERR_INTERNAL, "the FP8 gradient arena (", store.grad_capacity(d8), " bytes) is not padded for ", n,
           " shares of ", fresh.piece, " bytes");
    fresh.codes = static_cast<uint8_t*>(data);
    fresh.e5m2 = d8 == FP8_DTYPE_E5M2;
    fresh.tensor_count = static_cast<int32_t>(params.size());
    // This rank's share [lo, hi) of the arena, in chunks of one tensor each.
    const size_t lo = r * fresh.piece, hi = lo + fresh.piece;
    std::vector<OptimChunk> chunks;
    for (size_t i = 0; i < params.size(); ++i) {
      const fp8_tensor& g = *params[i]->grad;
      if (g.dtype != d8) continue;
      const size_t begin = static_cast<size_t>(static_cast<char*>(g.data) - static_cast<char*>(data));
      const size_t from = std::max(begin, lo), to = std::min(begin + static_cast<size_t>(g.numel), hi);
      for (size_t at = from; at < to; at += static_cast<size_t>(kOptimChunk))
        chunks.push_back({static_cast<int32_t>(i), static_cast<int32_t>(std::min<size_t>(kOptimChunk, to - at)),
                          static_cast<int64_t>(at - lo)});
    }
    fresh.chunk_count = static_cast<int64_t>(chunks.size());
    fresh.recv = nn::Arena(m.backend, n * fresh.piece);
    fresh.mean = nn::Arena(m.backend, fresh.piece * sizeof(float));
    fresh.sender_scales = nn::Arena(m.backend, n * params.size() * sizeof(GradScales));
    fresh.amax = nn::Arena(m.backend, params.size() * sizeof(uint32_t));
    fresh.chunks = nn::Arena(m.backend, chunks.size() * sizeof(OptimChunk));
    if (!chunks.empty())
      m.backend->copy_from_host(fresh.chunks.data(), chunks.data(), chunks.size() * sizeof(OptimChunk));
  }
  fresh.amaxes = std::move(plan.amaxes);
  fresh.amax_count = plan.amax_count;
  plan = std::move(fresh);
}

}  // namespace

void sync_grads(fp8_model& m, bool whole) {
  if (!m.comm || !m.store) return;
  Transport& t = *m.comm->transport;
  t.check();
  // One rank averages nothing: its gradients are the mean as they are (requantising would only
  // round them again).
  if (t.size() == 1) return;
  Backend& be = *m.backend;
  ModelComm::Plan& plan = plan_of(m);
  if (plan.generation != m.store->generation())  // (the same on every rank: agreed before any exchange)
    all_or_none(
        t, m.backend, "the gradient exchange's buffers", [&] { build_plan(m, t, plan); }, [] {});
  const auto n = static_cast<float>(t.size());
  if (plan.f32_count) {
    t.all_reduce(plan.f32, plan.f32_count, ElemType::kF32, ReduceOp::kSum);
    be.divide({plan.f32, static_cast<int64_t>(plan.f32_count), n});
  }
  if (!plan.codes) return;
  const size_t scale_bytes = static_cast<size_t>(plan.tensor_count) * sizeof(GradScales);
  GradScales* mine = m.store->grad_scales();
  auto* senders = reinterpret_cast<GradScales*>(plan.sender_scales.data());
  t.all_gather(mine, senders, scale_bytes);
  t.all_to_all(plan.codes, plan.recv.data(), plan.piece);
  auto* amax = reinterpret_cast<uint32_t*>(plan.amax.data());
  be.zero(amax, static_cast<size_t>(plan.tensor_count) * sizeof(uint32_t));
  const auto* chunks = reinterpret_cast<const OptimChunk*>(plan.chunks.data());
  auto* mean = reinterpret_cast<float*>(plan.mean.data());
  be.grad_reduce({reinterpret_cast<const uint8_t*>(plan.recv.data()), t.size(), static_cast<int64_t>(plan.piece),
                  senders, plan.tensor_count, chunks, plan.chunk_count, plan.e5m2, mean, amax});
  t.all_reduce(amax, static_cast<size_t>(plan.tensor_count), ElemType::kU32, ReduceOp::kMax);
  uint8_t* share = plan.codes + static_cast<size_t>(t.rank()) * plan.piece;
  be.grad_requantize({mean, chunks, plan.chunk_count, amax, plan.tensor_count, plan.e5m2, share, mine});
  if (whole) t.all_gather(share, plan.codes, plan.piece);
}

void agree_partials(fp8_optimizer& o) {
  Transport& t = *optim::model_of(o).comm->transport;
  t.all_reduce(o.partials, o.chunks.size() * 2, ElemType::kU32, ReduceOp::kMax);
}

void agree_compact_scales(fp8_optimizer& o) {
  Transport& t = *optim::model_of(o).comm->transport;
  static_assert(sizeof(CompactScales) % sizeof(uint32_t) == 0, "compact scales travel as u32 words");
  t.all_reduce(o.scales, static_cast<size_t>(o.compact_count) * sizeof(CompactScales) / sizeof(uint32_t),
               ElemType::kU32, ReduceOp::kMax);
}

namespace {

// The E4M3 weight arena (O3) and the bytes of one rank's share of it.
std::pair<char*, size_t> weight_shares(const fp8_model& m) {
  void* base = nullptr;
  size_t used = 0;
  m.store->flat(nn::kValues, FP8_DTYPE_E4M3, &base, &used);
  return {static_cast<char*>(base), m.store->share_of(nn::kValues, FP8_DTYPE_E4M3)};
}

}  // namespace

void gather_weights(fp8_model& m) {
  Transport& t = *m.comm->transport;
  const auto [base, piece] = weight_shares(m);
  if (piece) t.all_gather(base + static_cast<size_t>(t.rank()) * piece, base, piece);
}

io::WholeState gather_whole(const fp8_model& m, const fp8_optimizer* o, std::vector<nn::Arena>& keep) {
  Transport& t = *m.comm->transport;
  Backend& be = *m.backend;
  const auto [base, piece] = weight_shares(m);
  const size_t n = static_cast<size_t>(t.size()), r = static_cast<size_t>(t.rank());
  const std::vector<const nn::Parameter*> params = nn::all_parameters(m);
  io::WholeState whole;
  whole.master.assign(params.size(), nullptr);
  whole.m.assign(params.size(), nullptr);
  whole.v.assign(params.size(), nullptr);
  // Each array (element size `size`) mirrors the E4M3 arena: element e of a tensor at byte `at`
  // sits at (at + e) * size, so rank k's share is one contiguous range, all-gathered in place.
  const auto gather = [&](std::vector<const void*>& out, size_t size, auto&& own) {
    nn::Arena& a = keep.emplace_back(m.backend, n * piece * size);
    be.zero(a.data(), a.bytes());
    for (size_t i = 0; i < params.size(); ++i) {
      const nn::Parameter& p = *params[i];
      const char* indexed = own(i);
      if (!p.master || !indexed) continue;
      const size_t at = static_cast<size_t>(static_cast<char*>(p.value->data) - base);
      const size_t lo = static_cast<size_t>(p.owned_lo), hi = static_cast<size_t>(p.owned_hi);
      if (hi > lo) be.copy(a.data() + (at + lo) * size, indexed + lo * size, (hi - lo) * size);
      out[i] = a.data() + at * size;
    }
    char* mine = a.data() + r * piece * size;
    t.all_gather(mine, a.data(), piece * size);
  };
  gather(whole.master, 2, [&](size_t i) { return reinterpret_cast<const char*>(params[i]->master); });
  const bool states = o && o->states_m8;
  if (states) {
    gather(whole.m, 1, [&](size_t i) { return static_cast<const char*>(o->tensors[i].m); });
    gather(whole.v, 2, [&](size_t i) { return static_cast<const char*>(o->tensors[i].v); });
  }
  return whole;
}

namespace {

struct Registry {
  std::mutex mutex;
  std::vector<std::pair<const Backend*, std::weak_ptr<Transport>>> comms;
};
Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void register_comm(const Backend* backend, const std::shared_ptr<Transport>& t) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.comms.erase(std::remove_if(r.comms.begin(), r.comms.end(), [](const auto& e) { return e.second.expired(); }),
                r.comms.end());
  r.comms.emplace_back(backend, t);
}

void check_comms(const Backend* backend) {
  std::vector<std::shared_ptr<Transport>> mine;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const auto& [b, weak] : r.comms)
      if (b == backend)
        if (auto t = weak.lock()) mine.push_back(std::move(t));
  }
  for (const auto& t : mine) t->check();
}

Agreement agree(Transport& t, const std::shared_ptr<Backend>& be, fp8_status_t mine) {
  const uint32_t code = (static_cast<uint32_t>(mine) << 16) | static_cast<uint32_t>(t.rank());
  nn::Arena buf(be, sizeof code);
  be->copy_from_host(buf.data(), &code, sizeof code);
  t.all_reduce(buf.data(), 1, ElemType::kU32, ReduceOp::kMax);
  uint32_t worst = 0;
  be->copy_to_host(&worst, buf.data(), sizeof worst);
  t.check();
  return {static_cast<fp8_status_t>(worst >> 16), static_cast<int32_t>(worst & 0xFFFFu)};
}

}  // namespace fp8::dist
