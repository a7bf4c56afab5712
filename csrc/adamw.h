// Fused CPU AdamW over one flat subgroup: plain C++, no torch types (see binding.cpp for the op).
//
// One streaming pass per element: read the gradient (bf16/fp16/fp32), update the fp32 master,
// exp_avg and exp_avg_sq in place, and optionally write the new weight (bf16/fp16/fp32) to `out`.
// `out` may be the gradient buffer itself (same pointer, same dtype): each gradient element is
// read before the weight at that element is written. Math and operation order follow
// torch._fused_adamw_ (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, ADAMW mode).
#pragma once

#include <cstdint>

namespace dos {

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 3 };  // kNone: no output
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

struct AdamwArrays {
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grad;
  DType grad_dtype;  // kF32, kBF16 or kF16
  void* out;         // nullptr when out_dtype == kNone
  DType out_dtype;
  int64_t n;
};

struct AdamwHyper {
  int64_t step;  // 1-based, as torch's state_step after its increment
  double lr, beta1, beta2, eps, weight_decay;
  double grad_scale;  // the gradient is divided by it (torch fused semantics)
};

// Whether this CPU (and OS) can run `isa`.
bool isa_supported(Isa isa);

// Runs on at most `threads` OpenMP threads (fewer for small n); `isa` must be supported.
void adamw(const AdamwArrays& a, const AdamwHyper& h, int threads, Isa isa);
// How threads share a call's elements: dynamically handed-out chunks (default), or one fixed
// contiguous range per thread (the kernel before 2026-12-02; kept for in-situ A/B runs).
void set_fixed_ranges(bool fixed);
bool fixed_ranges();

// Low-precision optimizer state (dos/state_format.py defines the formats and the algorithm):
// an fp32 master with bf16 moments, or int8/uint8 block-quantized moments with fp32 scales.
// The math is `adamw`'s, in fp32, on decoded moments; the new fp32 moments are then encoded.
enum class StateFmt : int { kBF16 = 1, kInt8 = 2, kBF16Split = 3 };
constexpr int64_t kQuantBlock = 2048;  // int8: elements per scale pair (state_format.BLOCK)

struct LowpArrays {
  float* master;     // n (nullptr for kBF16Split)
  void* exp_avg;     // n: bf16 (uint16_t bits) or int8
  void* exp_avg_sq;  // n: bf16 (uint16_t bits) or uint8
  float* scales;     // int8 only: [s_m of each block, then s_v of each block], 2*ceil(n/2048)
  const void* grad;  // n
  DType grad_dtype;
  void* out;         // n, or nullptr when out_dtype == kNone
  DType out_dtype;
  int64_t n, lo, hi;  // whole-subgroup arrays; elements [lo, hi) are updated
  // kBF16Split only (dos/split_master.py): the master as its bf16 weight `hi` (rounded half away
  // from zero) and int16 `lo`, master = sign | ((|hi| << 16) + lo); `out` (bf16) gets `hi`.
  uint16_t* master_hi = nullptr;
  int16_t* master_lo = nullptr;
};

// Updates [lo, hi). int8: every block [lo, hi) touches is re-encoded with its new scales (its
// elements outside [lo, hi) keep their decoded values). Threads never share an int8 block.
void adamw_lowp(const LowpArrays& a, StateFmt fmt, const AdamwHyper& h, int threads, Isa isa);

}  // namespace dos
