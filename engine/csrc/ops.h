// The CPU kernels' entry points, callable from one another's C++ without the dispatcher: a
// fused decode layer (`decode_layer.cpp`) runs them back to back in one op. Each is also
// registered as `torch.ops.conveyor.<name>` by its own source file.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace conveyor {

at::Tensor paged_decode(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor table,
                        at::Tensor lens, double scale);
// x W^T + bias (+ residual, where given).
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels,
                        const c10::optional<at::Tensor>& bias, int64_t out_features,
                        const c10::optional<at::Tensor>& residual = c10::nullopt);
// panel_linear's product over int8 panels (Q4_1 or Q8_0 blocks times activations rounded to
// 8-bit blocks), its inputs already checked: out [M, out_features] from x [M, K] and a padded bias.
void int8_panel_product(const float* x, int64_t M, int64_t K, const at::Tensor& panels,
                        const float* bias, float* out, int64_t out_features);
// panel_linear's product over bf16 panels (AVX-512 BF16 dot products over x rounded to bf16),
// plus a residual [M, out_features] where not null, its inputs already checked.
void bf16_panel_product(const float* x, int64_t M, int64_t K, const at::Tensor& panels,
                        const float* bias, const float* residual, float* out,
                        int64_t out_features);
// The same over rows already rounded to bf16 (`x` [M, K] bf16 bit patterns).
void bf16_rows_product(const uint16_t* x, int64_t M, int64_t K, const at::Tensor& panels,
                       const float* bias, const float* residual, float* out,
                       int64_t out_features);
// silu(x Wg^T + bg) * (x Wu^T + bu) over gated bf16 panels (`bf16_panels.cpp`): fp32, or with
// `bf16_out` rounded to bf16 as a bf16 product rounds its input rows.
at::Tensor gated_linear(const at::Tensor& x, const at::Tensor& panels,
                        const c10::optional<at::Tensor>& bias, int64_t inter,
                        bool bf16_out = false);
// The input features of panels as `panel_linear` takes them (fp32, fp16, bf16 pairs or GGUF blocks).
int64_t panel_in_features(const at::Tensor& panels);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    bool bf16_out = false);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& x);

}  // namespace conveyor
