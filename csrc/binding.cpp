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

std::vector<std::string> cpu_isas() {  // supported here, best first
  std::vector<std::string> r;
  for (int i = 2; i >= 0; --i)
    if (dos::isa_supported(dos::Isa(i))) r.emplace_back(kIsaNames[i]);
  return r;
}

}  // namespace

TORCH_LIBRARY(dos, m) {
  // NOTE: `out` may be `grad` itself (the weights overwrite the consumed gradient); the schema
  // cannot say "aliases grad only when equal", so grad is declared read-only.
  m.def("adamw_(Tensor(a!) master, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor grad, "
        "Tensor(d!)? out, int step, float lr, float beta1, float beta2, float eps, "
        "float weight_decay, float grad_scale=1., int threads=0, str isa='scalar') -> ()");
  m.def("cpu_isas() -> str[]", &cpu_isas);
}

TORCH_LIBRARY_IMPL(dos, CPU, m) { m.impl("adamw_", &adamw_); }
