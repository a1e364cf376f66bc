#include "../launch.cuh"

MLA_PORTABLE_INSTANTIATE(mla::cuda::portable::DenseProblem<__nv_fp8_e4m3, 576>)
