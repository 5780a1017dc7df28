// Quantized-KV kernels compiled for the portable path (see kv_quant.h).
#include "cpu/kv_quant.h"

namespace mlxfast {
namespace kvq {
void encode_portable(const EncodeArgs& a) { Kernels<4>::encode(a); }
void dequant_portable(const DequantArgs& a) { Kernels<4>::dequant(a); }
void attention_portable(const AttnArgs& a) { Kernels<4>::attention(a); }
}  // namespace kvq
}  // namespace mlxfast
