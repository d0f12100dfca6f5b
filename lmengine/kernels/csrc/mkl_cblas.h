// MKL's BLAS entry points that torch's CPU wheels export from libtorch_cpu (LP64: MKL_INT is
// int), with the enum values of mkl_cblas.h. Declared weak: a torch built without MKL still
// loads the kernels, and `mkl_cblas_available()` is false there (callers then take their
// PyTorch path).
#pragma once

#include <cstddef>

extern "C" {
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k) __attribute__((weak));
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha,
                      const float* src, int ld, float* dest) __attribute__((weak));
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a,
                         int lda, const float* b, int ldb, float beta, float* c, int ldc)
    __attribute__((weak));
}

namespace mkl_cblas {
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;
}  // namespace mkl_cblas

inline bool mkl_cblas_available() {
  return cblas_sgemm_pack_get_size != nullptr && cblas_sgemm_pack != nullptr &&
         cblas_sgemm_compute != nullptr;
}

