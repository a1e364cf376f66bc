#include "../launch.cuh"

MLA_PORTABLE_INSTANTIATE(mla::cuda::portable::SparseProblem<mla::KvFormat::kV32>)
