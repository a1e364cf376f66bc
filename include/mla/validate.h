// Checks of the params structs shared by every backend and front-end. Each throws mla::Error
// whose message names the argument, what was expected and what was given.
#pragma once

#include "mla/params.h"

namespace mla {

void validate(const DenseDecodeParams& p);
void validate(const SparseDecodeParams& p);
void validate(const SparsePrefillParams& p);
// A decode call's plan and split workspace, once the caller has filled them (the backends check it
// right before they run).
void validate_split(const DecodeSplit& s);
// What the GPU kernels need of a decode call's out beyond validate(): rows on 4 bytes (they store
// pairs of 16-bit values), so out itself 4-byte aligned and every stride of a dimension of extent
// more than 1 even. The CUDA entry points check it; the CPU backend writes any layout.
void validate_device_output(const DecodeOutput& o, int b, int s_q, int h_q);

}  // namespace mla
