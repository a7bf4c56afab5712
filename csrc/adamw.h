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

}  // namespace dos
