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

}  // namespace mla
