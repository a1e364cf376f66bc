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
// A valid sparse call as the backends run it: an extra cache of no page blocks (no index can name a
// token in it) is dropped, with its indices and lengths; the result is the same either way.
SparseDecodeParams without_empty_extra(SparseDecodeParams p);

}  // namespace mla
