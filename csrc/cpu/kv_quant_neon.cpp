// Quantized-KV kernels compiled for the neon path (see kv_quant.h).
#include "cpu/kv_quant.h"

namespace mlxfast {
namespace kvq {
void encode_neon(const EncodeArgs& a) { Kernels<4>::encode(a); }
void dequant_neon(const DequantArgs& a) { Kernels<4>::dequant(a); }
void attention_neon(const AttnArgs& a) { Kernels<4>::attention(a); }
}  // namespace kvq
}  // namespace mlxfast
