// Quantized-KV kernels compiled for the avx2 path (see kv_quant.h).
#include "cpu/kv_quant.h"

namespace mlxfast {
namespace kvq {
void encode_avx2(const EncodeArgs& a) { Kernels<8>::encode(a); }
void dequant_avx2(const DequantArgs& a) { Kernels<8>::dequant(a); }
void attention_avx2(const AttnArgs& a) { Kernels<8>::attention(a); }
}  // namespace kvq
}  // namespace mlxfast
