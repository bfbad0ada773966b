#include "dist/data_parallel.hpp"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <type_traits>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/objects.hpp"
#include "nn/model.hpp"
#include "optim/optimizer.hpp"

namespace fp8::dist {

namespace {

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
  items.push_back("bucket bytes " + std::to_string(m.bucket_bytes));
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
  const uint64_t most = largest_of_ranks(t, *be, items.size());
  std::vector<uint64_t> hashes(most, 0);
  for (size_t i = 0; i < items.size(); ++i) hashes[i] = fnv1a(items[i]);
  const auto all = gather_host(t, *be, hashes.data(), most * sizeof(uint64_t));
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
    const auto texts = gather_host(t, *be, text, kText);
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
  // The gradient arenas (FP8, FP32).
  uint8_t* codes = nullptr;
  bool e5m2 = false;
  float* f32 = nullptr;
  // Each bucket's piece travels in slices (entries [slice_begin[b], slice_begin[b + 1]) of
  // `slices`), so that one slice's pass runs while the next one's codes travel; each slice's
  // chunks are entries [chunk_begin, chunk_begin + chunk_count) of `chunks`.
  struct Slice {
    size_t at, bytes;  // within the piece
    int64_t chunk_begin, chunk_count;
  };
  std::vector<int64_t> slice_begin;
  std::vector<Slice> slices;
  // The senders' codes of a slice, in two halves that alternate (the pass reads one while the next
  // slice arrives in the other); sender_scales holds bucket b's senders at [nranks * first, nranks *
  // last), bounds bucket b's at [first, last).
  nn::Arena recv, sender_scales, bounds, chunks;
  size_t recv_half = 0;
  uint32_t turn = 0;  // the half the next slice arrives in
  // The scaling states' amaxes, gathered.
  nn::Arena amaxes;
  size_t amax_count = 0;
  // The peer exchange (FP8_PEER_EXCHANGE): every rank's FP8 gradient arena (region kCodes) and
  // gradient scales (kScales) within this rank's reach; nullptr: the exchange goes through the
  // transport's collectives.
  enum : size_t { kCodes = 0, kScales = 1 };
  std::unique_ptr<PeerWindows> peers;
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

// The largest slice of a piece: FP8_EXCHANGE_SLICE_BYTES (fp8.h), or kDefaultSliceBytes. Each slice
// costs two NCCL launches (about 20 us each, with their cross-stream waits), and hides one pass
// but the last: on 2 x H200 at 2^28 elements (a 128 MiB piece), 16 / 32 / 64 / 128 MiB slices took
// 1.48 / 1.21 / 1.17 / 1.25 ms (bench_allreduce).
constexpr size_t kDefaultSliceBytes = size_t{64} << 20;

uint64_t slice_bytes_asked() {
  const char* env = std::getenv("FP8_EXCHANGE_SLICE_BYTES");
  if (!env) return kDefaultSliceBytes;
  // Digits only (strtoull alone would take a sign, spaces and an overflow), at most 2^62.
  bool digits = *env != '\0';
  for (const char* c = env; *c; ++c) digits = digits && *c >= '0' && *c <= '9';
  errno = 0;
  const unsigned long long v = digits ? std::strtoull(env, nullptr, 10) : 0;
  if (!digits || errno == ERANGE || v < nn::kSliceAlign || v > (1ull << 62))
    fail(FP8_ERR_INVALID_ARGUMENT, "FP8_EXCHANGE_SLICE_BYTES is '", env, "'; expected a whole number of bytes from ",
         nn::kSliceAlign, " to 2^62");
  return v;
}

// FP8_PEER_EXCHANGE (fp8.h): unset or "auto", "on", "off"; the ranks take the strictest of theirs
// (off over on over auto).
enum class PeerMode : uint64_t { kAuto = 0, kOn = 1, kOff = 2 };

PeerMode peer_mode_asked() {
  const char* env = std::getenv("FP8_PEER_EXCHANGE");
  if (!env || std::strcmp(env, "auto") == 0) return PeerMode::kAuto;
  if (std::strcmp(env, "on") == 0) return PeerMode::kOn;
  if (std::strcmp(env, "off") == 0) return PeerMode::kOff;
  fail(FP8_ERR_INVALID_ARGUMENT, "FP8_PEER_EXCHANGE is '", env, "'; expected auto, on or off");
}

PeerMode agreed_peer_mode(Transport& t, const std::shared_ptr<Backend>& be) {
  PeerMode mine = PeerMode::kAuto;
  all_or_none(
      t, be, "FP8_PEER_EXCHANGE", [&] { mine = peer_mode_asked(); }, [] {});
  return static_cast<PeerMode>(largest_of_ranks(t, *be, static_cast<uint64_t>(mine)));
}

// Collective: the peer windows for the layout in effect (ModelComm::Plan::kCodes, kScales), or
// nullptr when the mode is off or there are no FP8 gradients; refused on every rank
// (FP8_ERR_UNSUPPORTED) when the mode is on and the ranks cannot reach each other's memory.
std::unique_ptr<PeerWindows> map_peers(fp8_model& m, Transport& t, PeerMode mode) {
  const nn::ParamStore& store = *m.store;
  void* data = nullptr;
  size_t bytes = 0;
  store.flat(nn::kGrads, store.grad_dtype(), &data, &bytes);
  if (mode == PeerMode::kOff || !data) return nullptr;
  const std::vector<PeerRegion> regions = {
      {data, bytes, store.grad_memory(store.grad_dtype())},
      {store.grad_scales(), nn::all_parameters(m).size() * sizeof(GradScales), store.grad_scales_memory()}};
  std::string why;
  std::unique_ptr<PeerWindows> peers = t.map_peers(regions, &why);
  if (!peers && mode == PeerMode::kOn)
    fail(FP8_ERR_UNSUPPORTED, "FP8_PEER_EXCHANGE is 'on', but ", why,
         "; unset it (or set auto) to exchange through the communicator's collectives");
  return peers;
}

// Collective: the largest of the ranks' slice sizes (so that they cut the same slices), rounded
// down to kSliceAlign.
size_t agreed_slice_bytes(Transport& t, const std::shared_ptr<Backend>& be) {
  uint64_t mine = 0;
  all_or_none(t, be, "FP8_EXCHANGE_SLICE_BYTES", [&] { mine = slice_bytes_asked(); }, [] {});
  return static_cast<size_t>(largest_of_ranks(t, *be, mine)) / nn::kSliceAlign * nn::kSliceAlign;
}

// `receive`: the exchange goes through the transport's collectives, into buffers of the plan.
void build_plan(fp8_model& m, Transport& t, ModelComm::Plan& plan, size_t most, bool receive) {
  nn::ParamStore& store = *m.store;
  const auto n = static_cast<size_t>(t.size());
  const auto r = static_cast<size_t>(t.rank());
  ModelComm::Plan fresh;
  fresh.generation = store.generation();
  void* data = nullptr;
  size_t bytes = 0;
  store.flat(nn::kGrads, FP8_DTYPE_F32, &data, &bytes);
  fresh.f32 = static_cast<float*>(data);
  const fp8_dtype_t d8 = store.grad_dtype();
  store.flat(nn::kGrads, d8, &data, &bytes);
  fresh.codes = static_cast<uint8_t*>(data);
  fresh.e5m2 = d8 == FP8_DTYPE_E5M2;
  const std::vector<nn::Parameter*> params = nn::all_parameters(m);
  std::vector<OptimChunk> chunks;
  size_t largest = 0;
  for (const nn::Bucket& b : store.buckets()) {
    fresh.slice_begin.push_back(static_cast<int64_t>(fresh.slices.size()));
    const size_t piece = b.piece(t.size());
    if (!piece || !fresh.codes) continue;
    // Equal slices (multiples of kSliceAlign) of at most `most` bytes.
    const size_t count = piece <= most ? 1 : (piece - 1) / most + 1;
    const size_t step = (piece / count + nn::kSliceAlign - 1) / nn::kSliceAlign * nn::kSliceAlign;
    for (size_t s_at = 0; s_at < piece; s_at += step) {
      ModelComm::Plan::Slice sl{s_at, std::min(step, piece - s_at), static_cast<int64_t>(chunks.size()), 0};
      largest = std::max(largest, sl.bytes);
      // This rank's slice [lo, hi) of the bucket, in chunks of one tensor each, offsets from lo.
      const size_t lo = b.fp8_at + r * piece + s_at, hi = lo + sl.bytes;
      for (int32_t i = b.first; i < b.last; ++i) {
        const fp8_tensor& g = *params[static_cast<size_t>(i)]->grad;
        if (g.dtype != d8) continue;
        const size_t begin = static_cast<size_t>(static_cast<char*>(g.data) - static_cast<char*>(data));
        const size_t from = std::max(begin, lo), to = std::min(begin + static_cast<size_t>(g.numel), hi);
        for (size_t at = from; at < to; at += static_cast<size_t>(kOptimChunk))
          chunks.push_back({i - b.first, static_cast<int32_t>(std::min<size_t>(kOptimChunk, to - at)),
                            static_cast<int64_t>(at - lo)});
      }
      sl.chunk_count = static_cast<int64_t>(chunks.size()) - sl.chunk_begin;
      fresh.slices.push_back(sl);
    }
  }
  fresh.slice_begin.push_back(static_cast<int64_t>(fresh.slices.size()));
  if (fresh.codes) {
    fresh.recv_half = (n * largest + nn::kSliceAlign - 1) / nn::kSliceAlign * nn::kSliceAlign;
    if (receive) fresh.recv = nn::Arena(m.backend, 2 * fresh.recv_half);
    fresh.sender_scales = nn::Arena(m.backend, n * params.size() * sizeof(GradScales));
    fresh.bounds = nn::Arena(m.backend, params.size() * sizeof(float));
    fresh.chunks = nn::Arena(m.backend, chunks.size() * sizeof(OptimChunk));
    if (!chunks.empty())
      m.backend->copy_from_host(fresh.chunks.data(), chunks.data(), chunks.size() * sizeof(OptimChunk));
  }
  fresh.amaxes = std::move(plan.amaxes);
  fresh.amax_count = plan.amax_count;
  plan = std::move(fresh);
}

// The exchange's progress, (re)sized for the layout in effect.
ModelComm& progress(fp8_model& m) {
  ModelComm& c = *m.comm;
  if (c.progress_generation != m.store->generation()) {
    const size_t params = nn::all_parameters(m).size();
    c.written.assign(params, 0);
    c.exchanged.assign(m.store->buckets().size(), ModelComm::kNotStarted);
    c.pending.clear();
    for (const nn::Bucket& b : m.store->buckets()) c.pending.push_back(b.last - b.first);
    c.progress_generation = m.store->generation();
  }
  return c;
}

// The exchanges of one call, pipelined on the communication stream and its lane: slice after slice
// (of one bucket or of consecutive ones), the all-to-all of slice s + 1 travels while the lane
// computes slice s; slice s's all-gather follows once both are done. Everything is queued by finish().
class Exchanges {
 public:
  explicit Exchanges(fp8_model& m) : m_(m), t_(*m.comm->transport), be_(*m.backend) {}
  Exchanges(const Exchanges&) = delete;
  Exchanges& operator=(const Exchanges&) = delete;
  ~Exchanges() {
    if (!open_) return;
    try {
      be_.end_side();  // (after a failure: what was queued still runs, and is waited for)
    } catch (...) {  // (the failure being reported says more)
    }
  }

  // Collective: bucket k's exchange, up to `goal` (kOwnPieces or kWhole).
  void run(size_t k, uint8_t goal) {
    ModelComm& c = *m_.comm;
    if (c.exchanged[k] >= goal) return;
    // One rank averages nothing: its gradients are the mean as they are (requantising would only
    // round them again).
    if (t_.size() == 1) {
      c.exchanged[k] = goal;
      return;
    }
    t_.check();
    ModelComm::Plan& plan = plan_of(m_);
    if (plan.generation != m_.store->generation()) {  // (the same on every rank: agreed before any exchange)
      const size_t most = agreed_slice_bytes(t_, m_.backend);
      const PeerMode mode = agreed_peer_mode(t_, m_.backend);
      // The old windows close on every rank before the memory they hold may go. (A refusal below
      // leaves the plan stale: the next exchange tries, and refuses, again.)
      if (plan.peers) plan.peers->close();
      plan.peers.reset();
      std::unique_ptr<PeerWindows> peers = map_peers(m_, t_, mode);
      all_or_none(
          t_, m_.backend, "the gradient exchange's buffers", [&] { build_plan(m_, t_, plan, most, !peers); }, [] {});
      plan.peers = std::move(peers);
    }
    const nn::Bucket& b = m_.store->buckets()[k];
    const size_t piece = b.piece(t_.size());
    if (!open_) be_.begin_side(), open_ = true;
    const bool sliced_now = c.exchanged[k] == ModelComm::kNotStarted;
    if (sliced_now && plan.peers) {
      exchange_with_peers(k, goal);
      return;
    }
    if (sliced_now) {
      average_f32(b);
      const int32_t tensors = b.last - b.first;
      GradScales* mine = m_.store->grad_scales() + b.first;
      auto* senders = reinterpret_cast<GradScales*>(plan.sender_scales.data()) +
                      static_cast<size_t>(t_.size()) * static_cast<size_t>(b.first);
      for (int64_t s = plan.slice_begin[k]; s < plan.slice_begin[k + 1]; ++s) {
        const ModelComm::Plan::Slice& sl = plan.slices[static_cast<size_t>(s)];
        const bool first = s == plan.slice_begin[k];
        uint8_t* recv = reinterpret_cast<uint8_t*>(plan.recv.data()) + (plan.turn++ & 1u) * plan.recv_half;
        // (The bucket's scales travel with its first slice.)
        Transport::Gather scales;
        if (first) scales = {mine, senders, static_cast<size_t>(tensors) * sizeof(GradScales)};
        t_.all_to_all(plan.codes + b.fp8_at + sl.at, piece, recv, sl.bytes, scales);
        // The lane is done with the half this slice's successor arrives in once the previous
        // slice's all-gather may start.
        settle();
        be_.begin_lane();
        be_.grad_exchange({recv, t_.size(), static_cast<int64_t>(sl.bytes), senders, tensors,
                           reinterpret_cast<const OptimChunk*>(plan.chunks.data()) + sl.chunk_begin, sl.chunk_count,
                           plan.e5m2, reinterpret_cast<float*>(plan.bounds.data()) + b.first,
                           plan.codes + b.fp8_at + static_cast<size_t>(t_.rank()) * piece + sl.at,
                           first ? mine : nullptr});
        be_.end_lane();
        if (goal == ModelComm::kWhole) gather_ = {b.fp8_at + sl.at, sl.bytes, piece};
      }
      c.exchanged[k] = ModelComm::kOwnPieces;
    }
    if (goal == ModelComm::kWhole && c.exchanged[k] == ModelComm::kOwnPieces) {
      if (!sliced_now) {  // (own pieces from an earlier call: every slice's all-gather, once the lane is done)
        settle();
        for (int64_t s = plan.slice_begin[k]; s < plan.slice_begin[k + 1]; ++s) {
          const ModelComm::Plan::Slice& sl = plan.slices[static_cast<size_t>(s)];
          gather({b.fp8_at + sl.at, sl.bytes, piece});
        }
      }
      c.exchanged[k] = ModelComm::kWhole;
    }
  }

  // The bucket's FP32 gradients (both paths): summed across the ranks and divided by their count.
  void average_f32(const nn::Bucket& b) {
    if (!b.f32_bytes) return;
    float* f32 = plan_of(m_).f32 + b.f32_at / sizeof(float);
    const size_t count = b.f32_bytes / sizeof(float);
    t_.all_reduce(f32, count, ElemType::kF32, ReduceOp::kSum);
    be_.divide({f32, static_cast<int64_t>(count), static_cast<float>(t_.size())});
  }

  // The peer exchange of bucket k (every rank's memory within reach): each rank reads its piece of
  // every rank's codes and scales where they are, and writes the encoded means into every rank's
  // arena (into its own only for kOwnPieces), between two barriers: the first waits until every
  // rank's gradients are final, the second until every rank has read and written; only then does
  // each rank overwrite its own scales (identical on every rank: the same bounds).
  void exchange_with_peers(size_t k, uint8_t goal) {
    ModelComm& c = *m_.comm;
    ModelComm::Plan& plan = plan_of(m_);
    const nn::Bucket& b = m_.store->buckets()[k];
    const size_t piece = b.piece(t_.size());
    const int32_t n = t_.size();
    average_f32(b);
    if (plan.slice_begin[k] == plan.slice_begin[k + 1]) {  // (no FP8 gradients)
      c.exchanged[k] = goal;
      return;
    }
    PeerWindows& w = *plan.peers;
    const int32_t tensors = b.last - b.first;
    auto* senders = reinterpret_cast<GradScales*>(plan.sender_scales.data()) +
                    static_cast<size_t>(n) * static_cast<size_t>(b.first);
    float* bounds = reinterpret_cast<float*>(plan.bounds.data()) + b.first;
    const auto codes = reinterpret_cast<uint8_t* const*>(w.table(ModelComm::Plan::kCodes));
    w.barrier();
    be_.gather_peer_scales({reinterpret_cast<const GradScales* const*>(w.table(ModelComm::Plan::kScales)), n, b.first,
                            tensors, senders, bounds, w.poisoned()});
    for (int64_t s = plan.slice_begin[k]; s < plan.slice_begin[k + 1]; ++s) {
      const ModelComm::Plan::Slice& sl = plan.slices[static_cast<size_t>(s)];
      const size_t at = b.fp8_at + static_cast<size_t>(t_.rank()) * piece + sl.at;
      GradExchangeJob job{
          nullptr,         n,         0,
          senders,         tensors,   reinterpret_cast<const OptimChunk*>(plan.chunks.data()) + sl.chunk_begin,
          sl.chunk_count,  plan.e5m2, bounds,
          plan.codes + at, nullptr};
      job.peer_codes = codes;
      job.peer_outputs = goal == ModelComm::kWhole ? codes : nullptr;
      job.peer_at = static_cast<int64_t>(at);
      job.peer_alignment = w.alignment(ModelComm::Plan::kCodes);
      job.peer_poisoned = w.poisoned();
      be_.grad_exchange(job);
    }
    w.barrier();
    GradExchangeJob finish{
        nullptr, n, 0, senders, tensors, nullptr, 0, plan.e5m2, bounds, nullptr, m_.store->grad_scales() + b.first};
    finish.peer_poisoned = w.poisoned();
    be_.grad_exchange(finish);
    c.exchanged[k] = goal;
  }

  // Queues what is left (the last all-gather) and closes the communication stream's scope.
  void finish() {
    if (!open_) return;
    settle();
    open_ = false;
    be_.end_side();
  }

 private:
  struct Gather {
    size_t at = 0, bytes = 0, piece = 0;  // the slice's offset in the arena (in rank 0's piece), its bytes, the piece
  };

  // Every rank's slice into its piece of the bucket.
  void gather(const Gather& g) {
    uint8_t* at = plan_of(m_).codes + g.at;
    t_.all_gather(at + static_cast<size_t>(t_.rank()) * g.piece, at, g.bytes, g.piece);
  }

  // The communication stream waits for the lane's work so far, then the deferred all-gather (if
  // any) goes.
  void settle() {
    be_.join_lane();
    if (!gather_.bytes) return;
    const Gather g = gather_;
    gather_ = {};
    gather(g);
  }

  fp8_model& m_;
  Transport& t_;
  Backend& be_;
  bool open_ = false;
  Gather gather_;
};

// The goal of an exchange started by the backward: at O3 the step needs only this rank's pieces.
uint8_t backward_goal(const fp8_model& m) {
  return m.store->masters_sharded() ? ModelComm::kOwnPieces : ModelComm::kWhole;
}

}  // namespace

void before_grad_write(fp8_model& m, int32_t first, int32_t count) {
  if (!m.comm || !m.store || count <= 0) return;
  ModelComm& c = progress(m);
  const std::vector<nn::Bucket>& buckets = m.store->buckets();
  for (int32_t i = first; i < first + count; ++i) {
    const int32_t k = m.store->bucket_index(i);
    if (c.exchanged[static_cast<size_t>(k)] == ModelComm::kNotStarted) continue;
    const nn::Bucket& b = buckets[static_cast<size_t>(k)];
    if (c.synced_explicitly)
      fail(FP8_ERR_INVALID_STATE, "the gradients were averaged across the ranks by fp8_model_sync_grads; step the ",
           "optimizer (or zero_grad) before writing them again");
    fail(FP8_ERR_INVALID_STATE, "parameter ", i, "'s gradient was already averaged across the ranks (with parameters ",
         b.first, "..", b.last - 1, ", its bucket, once the backward had written them all: backward sync was on, so ",
         "that backward was the last before the step; turning it off now does not undo that). To accumulate ",
         "micro-batches, turn backward sync off (fp8_model_set_backward_sync(model, 0)) for all but the last; ",
         "or step (or zero_grad) first");
  }
}

void after_grad_write(fp8_model& m, int32_t first, int32_t count, int32_t unwritten_below) {
  if (!m.comm || !m.store || !m.comm->backward_sync) return;
  ModelComm& c = progress(m);
  for (int32_t i = first; i < first + count; ++i) {
    if (c.written[static_cast<size_t>(i)]) continue;
    c.written[static_cast<size_t>(i)] = 1;
    --c.pending[static_cast<size_t>(m.store->bucket_index(i))];
  }
  // Every complete bucket starts, the last first, except one the same call has still to write.
  const std::vector<nn::Bucket>& buckets = m.store->buckets();
  Exchanges exchanges(m);
  for (size_t k = buckets.size(); k-- > 0;)
    if (c.pending[k] == 0 && c.exchanged[k] == ModelComm::kNotStarted && buckets[k].first >= unwritten_below)
      exchanges.run(k, backward_goal(m));
  exchanges.finish();
}

void set_backward_sync(fp8_model& m, bool on) {
  ModelComm& c = *m.comm;
  if (on && !c.backward_sync && m.store) {  // only what is written from now on counts
    progress(m);
    std::fill(c.written.begin(), c.written.end(), uint8_t{0});
    const std::vector<nn::Bucket>& buckets = m.store->buckets();
    for (size_t k = 0; k < buckets.size(); ++k)
      if (c.exchanged[k] == ModelComm::kNotStarted) c.pending[k] = buckets[k].last - buckets[k].first;
  }
  c.backward_sync = on;
}

void sync_grads(fp8_model& m, bool whole) {
  if (!m.comm || !m.store) return;
  m.comm->transport->check();
  ModelComm& c = progress(m);
  const uint8_t goal = whole ? ModelComm::kWhole : ModelComm::kOwnPieces;
  Exchanges exchanges(m);
  for (size_t k = 0; k < c.exchanged.size(); ++k) exchanges.run(k, goal);
  exchanges.finish();
  m.backend->join_side();
}

void grads_consumed(fp8_model& m) {
  if (!m.comm) return;
  m.backend->join_side();
  ModelComm& c = *m.comm;
  std::fill(c.written.begin(), c.written.end(), uint8_t{0});
  std::fill(c.exchanged.begin(), c.exchanged.end(), uint8_t{ModelComm::kNotStarted});
  if (m.store) {
    c.pending.clear();
    for (const nn::Bucket& b : m.store->buckets()) c.pending.push_back(b.last - b.first);
  }
  c.synced_explicitly = false;
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

// The E4M3 weight arena (O3), and for each bucket the offset and bytes of rank 0's piece of it.
char* weight_pieces(const fp8_model& m, std::vector<std::pair<size_t, size_t>>& pieces) {
  void* base = nullptr;
  size_t used = 0;
  m.store->flat(nn::kValues, FP8_DTYPE_E4M3, &base, &used);
  const int32_t n = m.comm->transport->size();
  for (const nn::Bucket& b : m.store->buckets())
    if (b.fp8_bytes) pieces.emplace_back(b.fp8_at, b.piece(n));
  return static_cast<char*>(base);
}

}  // namespace

void gather_weights(fp8_model& m) {
  Transport& t = *m.comm->transport;
  std::vector<std::pair<size_t, size_t>> pieces;
  char* base = weight_pieces(m, pieces);
  for (const auto& [at, piece] : pieces)
    t.all_gather(base + at + static_cast<size_t>(t.rank()) * piece, base + at, piece);
}

io::WholeState gather_whole(const fp8_model& m, const fp8_optimizer* o, std::vector<nn::Arena>& keep) {
  Transport& t = *m.comm->transport;
  Backend& be = *m.backend;
  std::vector<std::pair<size_t, size_t>> pieces;
  char* base = weight_pieces(m, pieces);
  void* unused = nullptr;
  size_t e4m3_bytes = 0;
  m.store->flat(nn::kValues, FP8_DTYPE_E4M3, &unused, &e4m3_bytes);
  const size_t r = static_cast<size_t>(t.rank());
  const std::vector<const nn::Parameter*> params = nn::all_parameters(m);
  io::WholeState whole;
  whole.master.assign(params.size(), nullptr);
  whole.m.assign(params.size(), nullptr);
  whole.v.assign(params.size(), nullptr);
  // Each array (element size `size`) mirrors the E4M3 arena: element e of a tensor at byte `at`
  // sits at (at + e) * size, so rank k's piece of a bucket is one contiguous range, all-gathered in
  // place.
  const auto gather = [&](std::vector<const void*>& out, size_t size, auto&& own) {
    nn::Arena& a = keep.emplace_back(m.backend, e4m3_bytes * size);
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
    for (const auto& [at, piece] : pieces)
      t.all_gather(a.data() + (at + r * piece) * size, a.data() + at * size, piece * size);
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

std::vector<std::shared_ptr<Transport>> comms_of(const Backend* backend) {
  std::vector<std::shared_ptr<Transport>> mine;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& [b, weak] : r.comms)
    if (b == backend)
      if (auto t = weak.lock()) mine.push_back(std::move(t));
  return mine;
}

}  // namespace

void register_comm(Backend* backend, const std::shared_ptr<Transport>& t) {
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.comms.erase(std::remove_if(r.comms.begin(), r.comms.end(), [](const auto& e) { return e.second.expired(); }),
                  r.comms.end());
    r.comms.emplace_back(backend, t);
  }
  backend->set_wait_poll([backend](double waited) {
    for (const auto& comm : comms_of(backend)) comm->poll_wait(waited);
  });
}

void check_comms(const Backend* backend) {
  for (const auto& t : comms_of(backend)) t->check();
}

namespace {

// The maxima over the ranks of N host values (uint32_t or double; collective), through the
// backend's memory.
template <class T, size_t N>
std::array<T, N> max_over_ranks(Transport& t, const std::shared_ptr<Backend>& be, std::array<T, N> v) {
  static_assert(std::is_same_v<T, uint32_t> || std::is_same_v<T, double>, "a type the transports reduce");
  nn::Arena buf(be, sizeof v);
  be->copy_from_host(buf.data(), v.data(), sizeof v);
  t.all_reduce(buf.data(), N, std::is_same_v<T, double> ? ElemType::kF64 : ElemType::kU32, ReduceOp::kMax);
  be->copy_to_host(v.data(), buf.data(), sizeof v);
  t.check();
  return v;
}

}  // namespace

Agreement agree(Transport& t, const std::shared_ptr<Backend>& be, fp8_status_t mine) {
  // One collective (every rank takes the same number, whatever fails): status * 2^32 + rank, exact
  // in a double (statuses are small, ranks below 2^31), so the maximum is the worst status and the
  // highest rank that had it.
  constexpr double kRankSpan = 4294967296.0;
  const double worst = max_over_ranks<double, 1>(t, be, {static_cast<double>(mine) * kRankSpan + t.rank()})[0];
  const auto status = static_cast<fp8_status_t>(worst / kRankSpan);
  return {status, status == FP8_OK ? -1 : static_cast<int32_t>(worst - static_cast<double>(status) * kRankSpan)};
}

bool same_on_every_rank(Transport& t, const std::shared_ptr<Backend>& be, bool mine) {
  // seen[0]: some rank has true; seen[1]: some rank has false.
  const auto seen = max_over_ranks<uint32_t, 2>(t, be, {mine ? 1u : 0u, mine ? 0u : 1u});
  return !(seen[0] && seen[1]);
}

}  // namespace fp8::dist
