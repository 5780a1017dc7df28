// Quantized-KV kernels compiled for the avx512 path (see kv_quant.h).
#include "cpu/kv_quant.h"

namespace mlxfast {
namespace kvq {
void encode_avx512(const EncodeArgs& a) { Kernels<16>::encode(a); }
void dequant_avx512(const DequantArgs& a) { Kernels<16>::dequant(a); }
void attention_avx512(const AttnArgs& a) { Kernels<16>::attention(a); }
}  // namespace kvq
}  // namespace mlxfast
