// Weight-only int4 to float (w = (q - 8) * scale + zero, as PyTorch's kernel computes it),
// for prompt chunks. PyTorch's CPU int4 kernel (_weight_int4pack_mm_for_cpu) walks the rows
// four at a time with vector FMAs, so its cost grows with the rows while a dense GEMM on the
// matrix units barely does (at 512 rows of a 1536x576 weight, bfloat16: 5.7 ms against
// 0.45 ms). A chunk instead expands the weight once and takes the dense GEMM. PyTorch has no
// public unpack of its packed layout, hence this.
//
// The packed layout is ATen's weight_to_int4pack_kernel (aten/src/ATen/native/cpu/int4mm_kernel.cpp):
// output channels in blocks of block_n (64 on AVX-512, 32 otherwise), each block stored as K
// rows of block_n / 2 bytes. In a full block, byte j of a row holds channel j (low nibble)
// and channel j + block_n / 2 (high nibble); in the last, shorter block it holds channels 2j
// and 2j + 1. Python checks block_n against PyTorch's own kernel before using this
// (kernels/quant.py), so a different layout is caught, not used.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

namespace {

template <typename T>
void expand(const uint8_t* packed, const T* scales_zeros, T* out, int64_t n_out, int64_t n_in, int64_t group,
            int64_t block_n) {
  const int64_t blocks = (n_out + block_n - 1) / block_n, groups = n_in / group;
  // out is the transposed weight (n_in, n_out): a row of packed bytes fills a contiguous run
  at::parallel_for(0, blocks * groups, 1, [&](int64_t begin, int64_t end) {
    float scale[64], zero[64];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task / groups, g = task % groups;
      const int64_t n0 = block * block_n, width = std::min(block_n, n_out - n0), half = width / 2;
      const bool full = width == block_n;
      const T* sz = scales_zeros + (g * n_out + n0) * 2;
      for (int64_t n = 0; n < width; ++n) {
        scale[n] = static_cast<float>(sz[2 * n]);
        zero[n] = static_cast<float>(sz[2 * n + 1]);
      }
      for (int64_t k = g * group; k < (g + 1) * group; ++k) {
        const uint8_t* row = packed + n0 * n_in / 2 + k * half;
        T* o = out + k * n_out + n0;
        if (full) {
          for (int64_t j = 0; j < half; ++j) {
            o[j] = static_cast<T>((static_cast<float>(row[j] & 15) - 8.0f) * scale[j] + zero[j]);
            o[j + half] = static_cast<T>((static_cast<float>(row[j] >> 4) - 8.0f) * scale[j + half] + zero[j + half]);
          }
        } else {
          for (int64_t j = 0; j < half; ++j) {
            o[2 * j] = static_cast<T>((static_cast<float>(row[j] & 15) - 8.0f) * scale[2 * j] + zero[2 * j]);
            o[2 * j + 1] =
                static_cast<T>((static_cast<float>(row[j] >> 4) - 8.0f) * scale[2 * j + 1] + zero[2 * j + 1]);
          }
        }
      }
    }
  });
}

}  // namespace

// packed: (n_out, n_in / 2) uint8 in ATen's CPU int4 layout; scales_zeros: (n_in / group, n_out, 2).
// Returns the float weight transposed, (n_in, n_out), in the scales' dtype.
torch::Tensor int4_expand(torch::Tensor packed, torch::Tensor scales_zeros, int64_t group, int64_t block_n) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 2 && packed.is_contiguous(),
              "packed: contiguous (n_out, n_in / 2) uint8");
  const int64_t n_out = packed.size(0), n_in = packed.size(1) * 2;
  TORCH_CHECK(block_n == 32 || block_n == 64, "block_n is 32 or 64");
  TORCH_CHECK(n_out % 16 == 0 && group > 0 && n_in % group == 0, "n_out a multiple of 16, n_in of the group");
  TORCH_CHECK(scales_zeros.is_contiguous() && scales_zeros.dim() == 3 && scales_zeros.size(0) == n_in / group &&
                  scales_zeros.size(1) == n_out && scales_zeros.size(2) == 2,
              "scales_zeros: contiguous (n_in / group, n_out, 2)");
  auto out = torch::empty({n_in, n_out}, scales_zeros.options());
  const auto* bytes = packed.data_ptr<uint8_t>();
  switch (scales_zeros.scalar_type()) {
    case torch::kFloat32:
      expand<float>(bytes, scales_zeros.data_ptr<float>(), out.data_ptr<float>(), n_out, n_in, group, block_n);
      break;
    case torch::kBFloat16:
      expand<c10::BFloat16>(bytes, scales_zeros.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), n_out,
                            n_in, group, block_n);
      break;
    default: TORCH_CHECK(false, "int4_expand takes float32 or bfloat16 scales");
  }
  return out;
}
