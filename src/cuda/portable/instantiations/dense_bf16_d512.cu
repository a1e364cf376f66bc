#include "../launch.cuh"

MLA_PORTABLE_INSTANTIATE(mla::cuda::portable::DenseProblem<__nv_bfloat16, 512>)
