#include "../launch.cuh"

MLA_PORTABLE_INSTANTIATE(mla::cuda::portable::DenseProblem<__half, 512>)
