#include "../launch.cuh"

MLA_PORTABLE_INSTANTIATE(mla::cuda::portable::PrefillProblem<576>)
