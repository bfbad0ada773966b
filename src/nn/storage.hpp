// The flat storage of a model's parameters (fp8.h, "Flat storage"). Per model, one device allocation
// per (role, dtype): values (F32, and at MS-AMP levels F16 or E4M3 Linear weights), O3's F16
// masters, gradients (F32, or FP8 for Linear weights at O1..O3), and two small arrays of per-tensor
// scales (an FP8 gradient's GradScales, an E4M3 weight's scale_inv). Slices are 256-byte aligned
// and in the model's parameter order, so a communication bucket is a contiguous range of slices
// and a shard an element range of an arena. The parameter tensors are views into the arenas: their
// handles live as long as the model; their data moves only when the layout changes (a layer added
// before conversion, or a conversion to another level).
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "backend/backend.hpp"
#include "fp8.h"

namespace fp8::nn {

struct Parameter;

constexpr size_t kSliceAlign = 256;

// Data parallelism: the ranks of the model's group, this one's rank (nranks 0: not data-parallel),
// and the gradient bytes (as stored) at which a communication bucket closes.
struct Shares {
  int32_t nranks = 0, rank = 0;
  size_t bucket_bytes = 0;
  bool operator==(const Shares& o) const {
    return nranks == o.nranks && rank == o.rank && bucket_bytes == o.bucket_bytes;
  }
  bool operator!=(const Shares& o) const { return !(*this == o); }
};

// A communication bucket: consecutive parameters whose gradients are exchanged together, as soon as
// the backward has written the last of them. Its range of the FP8 gradient arena (and at O3 the same
// range of the E4M3 weight arena, laid out alike) is padded to nranks equal pieces, 256-byte
// aligned: rank k owns piece k, averages those gradients, and at O3 keeps those weights' masters and
// moments. Its FP32 gradients are one range of the FP32 arena.
struct Bucket {
  int32_t first = 0, last = 0;       // parameters [first, last), in the model's order
  size_t fp8_at = 0, fp8_bytes = 0;  // bytes of the FP8 arenas
  size_t f32_at = 0, f32_bytes = 0;  // bytes of the FP32 gradient arena
  size_t piece(int32_t nranks) const { return fp8_bytes / static_cast<size_t>(nranks); }
};

// One allocation of device memory, released with the last of the arena and the tensors lent out
// of it (fp8_tensor_to_dlpack).
class Arena {
 public:
  Arena() = default;
  Arena(std::shared_ptr<Backend> backend, size_t bytes);
  char* data() const { return memory_.get(); }
  size_t bytes() const { return bytes_; }
  const std::shared_ptr<char>& memory() const { return memory_; }

 private:
  std::shared_ptr<char> memory_;
  size_t bytes_ = 0;
};

// Storage roles of fp8.h's fp8_model_flat_storage.
enum StorageRole : int32_t { kValues = 0, kGrads = 1, kMasters = 2 };

class ParamStore {
 public:
  explicit ParamStore(std::shared_ptr<Backend> backend) : backend_(std::move(backend)) {}

  // The MS-AMP level the Linear weights are stored at (0: FP32) and the FP8 gradients' dtype.
  int32_t level() const { return level_; }
  fp8_dtype_t grad_dtype() const { return grad_dtype_; }

  // Lays every parameter of `params` (the model's, in order) out at `level` (FP8 gradients in
  // `grad_dtype`), carrying values and gradients over (converted where the dtype changes; a
  // parameter that owns its memory, new from a layer's constructor, moves in). Keeps the current
  // arenas when they already hold this layout; `slack` leaves room to append parameters without
  // moving the others (while layers are being added). All or nothing: on a failure the parameters
  // and arenas are as they were. Synchronous.
  void layout(const std::vector<Parameter*>& params, int32_t level, fp8_dtype_t grad_dtype, bool slack);

  // The arena of (role, dtype): its memory and the bytes in use; {nullptr, 0} when there is none.
  void flat(int32_t role, fp8_dtype_t dtype, void** data, size_t* bytes) const;

  // Every gradient to zero (FP8 ones with their scales: "nothing accumulated yet"). Asynchronous.
  void zero_grads();

  // Data parallelism, from the next layout on: the parameters are grouped into buckets (at most one
  // when a single parameter's gradient exceeds bucket_bytes), each padded as Bucket says, so that
  // pieces can be exchanged in place (the padding stays zero); at O3 this rank keeps the F16 masters
  // of its pieces of the E4M3 weights alone (ZeRO: a parameter's master holds elements [owned_lo,
  // owned_hi)). Once masters are sharded, a layout that would move anything (another level,
  // communicator or parameter set) is refused.
  void set_shares(Shares shares) { shares_ = shares; }
  Shares shares() const { return applied_; }
  // The buckets of the layout in effect (none without data parallelism), and the bucket of a parameter.
  const std::vector<Bucket>& buckets() const { return buckets_; }
  const Bucket& bucket_of(int32_t param) const {
    return buckets_[static_cast<size_t>(param_bucket_[static_cast<size_t>(param)])];
  }
  int32_t bucket_index(int32_t param) const { return param_bucket_[static_cast<size_t>(param)]; }
  bool masters_sharded() const { return level_ == 3 && applied_.nranks > 0; }
  // Every parameter's GradScales, in parameter order (meaningful for FP8 gradients only).
  GradScales* grad_scales() const { return reinterpret_cast<GradScales*>(grad_scales_.data()); }
  // The memory behind the gradient arena of `dtype` and behind grad_scales(), for holding it while
  // other ranks reach it (the peer exchange).
  const std::shared_ptr<char>& grad_memory(fp8_dtype_t dtype) const { return grads_[dtype].memory(); }
  const std::shared_ptr<char>& grad_scales_memory() const { return grad_scales_.memory(); }
  // Grows at every layout(): what was derived from an earlier layout must be derived again.
  uint64_t generation() const { return generation_; }
  // Every arena in use, for copying a whole model state between ranks: data and bytes in use
  // (sharded masters left out).
  std::vector<std::pair<void*, size_t>> arenas() const;

 private:
  struct Arenas;
  std::shared_ptr<Backend> backend_;
  int32_t level_ = 0;
  fp8_dtype_t grad_dtype_ = FP8_DTYPE_E5M2;
  // The value and gradient arenas by dtype (index = fp8_dtype_t), the masters, the per-tensor scales.
  Arena values_[5], grads_[5], masters_, grad_scales_, value_scales_;
  size_t used_values_[5] = {}, used_grads_[5] = {}, used_masters_ = 0, used_scales_ = 0;
  Shares shares_, applied_;  // wanted by set_shares; in effect since the last layout
  std::vector<Bucket> buckets_;
  std::vector<int32_t> param_bucket_;
  uint64_t generation_ = 0;
};

}  // namespace fp8::nn
