// torch.ops.dos.*: checks at the boundary, then the plain kernels (adamw.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "adamw.h"

namespace {

const char* const kIsaNames[] = {"scalar", "avx2", "avx512"};

dos::Isa parse_isa(c10::string_view name) {
  for (int i = 0; i < 3; ++i)
    if (name == kIsaNames[i]) {
      TORCH_CHECK(dos::isa_supported(dos::Isa(i)), "dos::adamw_: this CPU cannot run isa '",
                  std::string(name), "'");
      return dos::Isa(i);
    }
  TORCH_CHECK(false, "dos::adamw_: unknown isa '", std::string(name), "' (scalar|avx2|avx512)");
}

dos::DType kernel_dtype(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return dos::DType::kF32;
    case at::kBFloat16: return dos::DType::kBF16;
    case at::kHalf: return dos::DType::kF16;
    default: TORCH_CHECK(false, "dos::adamw_: ", what, " must be float32, bfloat16 or float16, got ",
                         t.scalar_type());
  }
}

bool overlap(const at::Tensor& a, const at::Tensor& b) {
  const auto* a0 = static_cast<const char*>(a.data_ptr());
  const auto* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

void adamw_(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
            const at::Tensor& grad, const std::optional<at::Tensor>& out, int64_t step, double lr,
            double beta1, double beta2, double eps, double weight_decay, double grad_scale,
            int64_t threads, c10::string_view isa) {
  const int64_t n = master.numel();
  const at::Tensor* state[] = {&master, &exp_avg, &exp_avg_sq};
  for (const at::Tensor* t : state) {
    TORCH_CHECK(t->scalar_type() == at::kFloat, "dos::adamw_: master and moments must be float32");
    TORCH_CHECK(t->is_contiguous() && t->numel() == n,
                "dos::adamw_: master, moments, grad and out must be contiguous, of equal numel");
    TORCH_CHECK(!overlap(*t, grad) || n == 0, "dos::adamw_: grad overlaps the optimizer state");
  }
  TORCH_CHECK(grad.is_contiguous() && grad.numel() == n,
              "dos::adamw_: master, moments, grad and out must be contiguous, of equal numel");
  TORCH_CHECK(n == 0 || (!overlap(master, exp_avg) && !overlap(master, exp_avg_sq) &&
                         !overlap(exp_avg, exp_avg_sq)),
              "dos::adamw_: master, exp_avg and exp_avg_sq overlap");
  TORCH_CHECK(step >= 1, "dos::adamw_: step must be >= 1, got ", step);
  TORCH_CHECK(threads >= 0, "dos::adamw_: threads must be >= 0 (0: torch's thread count)");
  TORCH_CHECK(grad_scale != 0.0, "dos::adamw_: grad_scale must be nonzero");

  dos::AdamwArrays a{master.data_ptr<float>(), exp_avg.data_ptr<float>(),
                     exp_avg_sq.data_ptr<float>(), grad.data_ptr(), kernel_dtype(grad, "grad"),
                     nullptr, dos::DType::kNone, n};
  if (out.has_value() && n > 0 && out->data_ptr() != master.data_ptr()) {  // out == master: no-op
    const at::Tensor& o = *out;
    TORCH_CHECK(o.is_contiguous() && o.numel() == n,
                "dos::adamw_: master, moments, grad and out must be contiguous, of equal numel");
    const bool is_grad = o.data_ptr() == grad.data_ptr() && o.scalar_type() == grad.scalar_type();
    TORCH_CHECK(is_grad || !overlap(o, grad), "dos::adamw_: out must be grad itself or not overlap it");
    for (const at::Tensor* t : state)
      TORCH_CHECK(!overlap(o, *t), "dos::adamw_: out overlaps the optimizer state");
    a.out = o.data_ptr();
    a.out_dtype = kernel_dtype(o, "out");
  }
  const int nt = threads > 0 ? int(threads) : at::get_num_threads();
  dos::adamw(a, dos::AdamwHyper{step, lr, beta1, beta2, eps, weight_decay, grad_scale}, nt,
             parse_isa(isa));
}

// Whole-subgroup state (master fp32; moments fp32, bf16, or int8 + uint8 with fp32 `scales`);
// updates elements [lo, hi). The format follows from the moments' dtypes.
void adamw_lowp_(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                 const std::optional<at::Tensor>& scales, const at::Tensor& grad,
                 const std::optional<at::Tensor>& out, int64_t lo, int64_t hi, int64_t step,
                 double lr, double beta1, double beta2, double eps, double weight_decay,
                 double grad_scale, int64_t threads, c10::string_view isa) {
  const char* const E = "dos::adamw_lowp_: ";
  const int64_t n = master.numel();
  TORCH_CHECK(0 <= lo && lo <= hi && hi <= n, E, "need 0 <= lo <= hi <= numel, got lo=", lo,
              " hi=", hi, " numel=", n);
  const auto md = exp_avg.scalar_type(), vd = exp_avg_sq.scalar_type();
  if (md == at::kFloat && vd == at::kFloat) {  // fp32 state: the fp32 kernel on the slices
    TORCH_CHECK(!scales.has_value(), E, "fp32 moments take no scales");
    TORCH_CHECK(exp_avg.numel() == n && exp_avg_sq.numel() == n && grad.numel() == n &&
                    (!out.has_value() || out->numel() == n),
                E, "master, moments, grad and out must be of equal numel");
    auto sl = [&](const at::Tensor& t) { return t.view(-1).slice(0, lo, hi); };
    std::optional<at::Tensor> o;
    if (out.has_value()) o = sl(*out);
    return adamw_(sl(master), sl(exp_avg), sl(exp_avg_sq), sl(grad), o, step, lr, beta1, beta2,
                  eps, weight_decay, grad_scale, threads, isa);
  }
  const bool q = md == at::kChar && vd == at::kByte;
  TORCH_CHECK(q || (md == at::kBFloat16 && vd == at::kBFloat16), E,
              "moments must be float32/float32, bfloat16/bfloat16 or int8/uint8, got ", md, "/", vd);
  TORCH_CHECK(master.scalar_type() == at::kFloat, E, "master must be float32");
  std::vector<const at::Tensor*> state = {&master, &exp_avg, &exp_avg_sq};
  const int64_t nb = (n + dos::kQuantBlock - 1) / dos::kQuantBlock;
  if (q) {
    TORCH_CHECK(scales.has_value(), E, "int8 moments need scales");
    TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() &&
                    scales->numel() == 2 * nb,
                E, "scales must be contiguous float32 of 2*ceil(numel/2048) = ", 2 * nb,
                " elements");
    state.push_back(&*scales);
  } else {
    TORCH_CHECK(!scales.has_value(), E, "bf16 moments take no scales");
  }
  for (size_t i = 0; i < state.size(); ++i) {
    TORCH_CHECK(state[i]->is_contiguous() && state[i]->device().is_cpu(), E,
                "state must be contiguous CPU tensors");
    TORCH_CHECK(i == 3 || state[i]->numel() == n, E,
                "master, moments, grad and out must be of equal numel");
  }
  TORCH_CHECK(grad.is_contiguous() && grad.numel() == n, E,
              "master, moments, grad and out must be contiguous, of equal numel");
  for (size_t i = 0; i < state.size(); ++i) {
    TORCH_CHECK(n == 0 || !overlap(*state[i], grad), E, "grad overlaps the optimizer state");
    for (size_t j = i + 1; j < state.size(); ++j)
      TORCH_CHECK(n == 0 || !overlap(*state[i], *state[j]), E, "the state tensors overlap");
  }
  TORCH_CHECK(step >= 1, E, "step must be >= 1, got ", step);
  TORCH_CHECK(threads >= 0, E, "threads must be >= 0 (0: torch's thread count)");
  TORCH_CHECK(grad_scale != 0.0, E, "grad_scale must be nonzero");

  dos::LowpArrays a{master.data_ptr<float>(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                    q ? scales->data_ptr<float>() : nullptr, grad.data_ptr(),
                    kernel_dtype(grad, "grad"), nullptr, dos::DType::kNone, n, lo, hi};
  const bool out_is_master = out.has_value() && out->data_ptr() == master.data_ptr() &&
                             out->scalar_type() == at::kFloat && out->numel() == n;
  if (out.has_value() && n > 0 && !out_is_master) {  // out == master: nothing to write
    const at::Tensor& o = *out;
    TORCH_CHECK(o.is_contiguous() && o.numel() == n, E,
                "master, moments, grad and out must be contiguous, of equal numel");
    const bool is_grad = o.data_ptr() == grad.data_ptr() && o.scalar_type() == grad.scalar_type();
    TORCH_CHECK(is_grad || !overlap(o, grad), E, "out must be grad itself or not overlap it");
    for (const at::Tensor* t : state)
      TORCH_CHECK(!overlap(o, *t), E, "out overlaps the optimizer state");
    a.out = o.data_ptr();
    a.out_dtype = kernel_dtype(o, "out");
  }
  const int nt = threads > 0 ? int(threads) : at::get_num_threads();
  dos::adamw_lowp(a, q ? dos::StateFmt::kInt8 : dos::StateFmt::kBF16,
                  dos::AdamwHyper{step, lr, beta1, beta2, eps, weight_decay, grad_scale}, nt,
                  parse_isa(isa));
}

// The split master with bf16 moments (dos/split_master.py): whole-subgroup tensors, hi bf16,
// lo int16, moments bf16; updates [lo_i, hi_i). `out` (bf16, optional: `grad` itself or apart from
// the state) receives the new weights, which are `hi`.
void adamw_split_(const at::Tensor& hi, const at::Tensor& lo, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq, const at::Tensor& grad,
                  const std::optional<at::Tensor>& out, int64_t lo_i, int64_t hi_i, int64_t step,
                  double lr, double beta1, double beta2, double eps, double weight_decay,
                  double grad_scale, int64_t threads, c10::string_view isa) {
  const char* const E = "dos::adamw_split_: ";
  const int64_t n = hi.numel();
  TORCH_CHECK(0 <= lo_i && lo_i <= hi_i && hi_i <= n, E, "need 0 <= lo <= hi <= numel, got lo=",
              lo_i, " hi=", hi_i, " numel=", n);
  TORCH_CHECK(hi.scalar_type() == at::kBFloat16 && lo.scalar_type() == at::kShort, E,
              "the master is hi bfloat16 and lo int16, got ", hi.scalar_type(), "/", lo.scalar_type());
  TORCH_CHECK(exp_avg.scalar_type() == at::kBFloat16 && exp_avg_sq.scalar_type() == at::kBFloat16,
              E, "moments must be bfloat16");
  const std::vector<const at::Tensor*> state = {&hi, &lo, &exp_avg, &exp_avg_sq};
  for (size_t i = 0; i < state.size(); ++i) {
    TORCH_CHECK(state[i]->is_contiguous() && state[i]->device().is_cpu() && state[i]->numel() == n,
                E, "state must be contiguous CPU tensors of equal numel");
    TORCH_CHECK(n == 0 || !overlap(*state[i], grad), E, "grad overlaps the optimizer state");
    for (size_t j = i + 1; j < state.size(); ++j)
      TORCH_CHECK(n == 0 || !overlap(*state[i], *state[j]), E, "the state tensors overlap");
  }
  TORCH_CHECK(grad.is_contiguous() && grad.numel() == n, E, "grad must be contiguous, of equal numel");
  TORCH_CHECK(step >= 1, E, "step must be >= 1, got ", step);
  TORCH_CHECK(threads >= 0, E, "threads must be >= 0 (0: torch's thread count)");
  TORCH_CHECK(grad_scale != 0.0, E, "grad_scale must be nonzero");
  dos::LowpArrays a{nullptr, exp_avg.data_ptr(), exp_avg_sq.data_ptr(), nullptr, grad.data_ptr(),
                    kernel_dtype(grad, "grad"), nullptr, dos::DType::kNone, n, lo_i, hi_i};
  a.master_hi = static_cast<uint16_t*>(hi.data_ptr());
  a.master_lo = static_cast<int16_t*>(lo.data_ptr());
  if (out.has_value() && n > 0) {
    const at::Tensor& o = *out;
    TORCH_CHECK(o.scalar_type() == at::kBFloat16 && o.is_contiguous() && o.numel() == n, E,
                "out must be contiguous bfloat16 of equal numel (the weights are hi)");
    const bool is_grad = o.data_ptr() == grad.data_ptr() && o.scalar_type() == grad.scalar_type();
    TORCH_CHECK(is_grad || !overlap(o, grad), E, "out must be grad itself or not overlap it");
    for (const at::Tensor* t : state) TORCH_CHECK(!overlap(o, *t), E, "out overlaps the optimizer state");
    a.out = o.data_ptr();
    a.out_dtype = dos::DType::kBF16;
  }
  const int nt = threads > 0 ? int(threads) : at::get_num_threads();
  dos::adamw_lowp(a, dos::StateFmt::kBF16Split,
                  dos::AdamwHyper{step, lr, beta1, beta2, eps, weight_decay, grad_scale}, nt,
                  parse_isa(isa));
}

std::vector<std::string> cpu_isas() {  // supported here, best first
  std::vector<std::string> r;
  for (int i = 2; i >= 0; --i)
    if (dos::isa_supported(dos::Isa(i))) r.emplace_back(kIsaNames[i]);
  return r;
}

void set_schedule(c10::string_view name) {
  TORCH_CHECK(name == "dynamic" || name == "static",
              "dos::set_schedule: expected 'dynamic' or 'static', got '", std::string(name), "'");
  dos::set_fixed_ranges(name == "static");
}

}  // namespace

TORCH_LIBRARY(dos, m) {
  // NOTE: `out` may be `grad` itself (the weights overwrite the consumed gradient); the schema
  // cannot say "aliases grad only when equal", so grad is declared read-only.
  m.def("adamw_(Tensor(a!) master, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor grad, "
        "Tensor(d!)? out, int step, float lr, float beta1, float beta2, float eps, "
        "float weight_decay, float grad_scale=1., int threads=0, str isa='scalar') -> ()");
  // Whole-subgroup tensors; updates [lo, hi). Moments fp32/fp32, bf16/bf16 or int8/uint8 (then
  // `scales`: fp32 [s_m per 2048-element block..., s_v per block...]); dos/state_format.py.
  m.def("adamw_lowp_(Tensor(a!) master, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
        "Tensor(e!)? scales, Tensor grad, Tensor(d!)? out, int lo, int hi, int step, float lr, "
        "float beta1, float beta2, float eps, float weight_decay, float grad_scale=1., "
        "int threads=0, str isa='scalar') -> ()");
  // The split master (hi bf16, lo int16) with bf16 moments: dos/split_master.py.
  m.def("adamw_split_(Tensor(a!) hi, Tensor(b!) lo, Tensor(c!) exp_avg, Tensor(d!) exp_avg_sq, "
        "Tensor grad, Tensor(e!)? out, int lo_i, int hi_i, int step, float lr, float beta1, "
        "float beta2, float eps, float weight_decay, float grad_scale=1., int threads=0, "
        "str isa='scalar') -> ()");
  m.def("cpu_isas() -> str[]", &cpu_isas);
  // How the threads share a call: "dynamic" chunks (default) or "static" per-thread ranges.
  m.def("set_schedule(str name) -> ()", &set_schedule);
}

TORCH_LIBRARY_IMPL(dos, CPU, m) {
  m.impl("adamw_", &adamw_);
  m.impl("adamw_lowp_", &adamw_lowp_);
  m.impl("adamw_split_", &adamw_split_);
}
