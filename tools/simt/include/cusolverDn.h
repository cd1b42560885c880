// SIMT emulator fake of cusolverDn.h: the eigensolver entry points csrc/cuda
// uses, computed by a plain reference (tools/simt/src/cusolver.cpp) on the
// handle's stream, with cuSOLVER's argument checks, workspace queries and
// per-matrix `info` codes. Values of the enums are cuSOLVER's.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

// The emulated library version: cuSOLVER 12.0.4 (CUDA 13.0), which has
// cusolverDnXsyevBatched (>= 11.7.1). -DSIMT_CUSOLVER_VERSION=... overrides.
#define CUSOLVER_VER_MAJOR 12
#define CUSOLVER_VER_MINOR 0
#define CUSOLVER_VER_PATCH 4
#ifdef SIMT_CUSOLVER_VERSION
#define CUSOLVER_VERSION SIMT_CUSOLVER_VERSION
#else
#define CUSOLVER_VERSION (CUSOLVER_VER_MAJOR * 1000 + CUSOLVER_VER_MINOR * 100 + CUSOLVER_VER_PATCH)
#endif

typedef struct simt_cusolver_st* cusolverDnHandle_t;
typedef struct simt_syevj_info_st* syevjInfo_t;
typedef struct simt_dn_params_st* cusolverDnParams_t;

typedef enum {
  CUSOLVER_STATUS_SUCCESS = 0,
  CUSOLVER_STATUS_NOT_INITIALIZED = 1,
  CUSOLVER_STATUS_ALLOC_FAILED = 2,
  CUSOLVER_STATUS_INVALID_VALUE = 3,
  CUSOLVER_STATUS_ARCH_MISMATCH = 4,
  CUSOLVER_STATUS_MAPPING_ERROR = 5,
  CUSOLVER_STATUS_EXECUTION_FAILED = 6,
  CUSOLVER_STATUS_INTERNAL_ERROR = 7,
  CUSOLVER_STATUS_MATRIX_TYPE_NOT_SUPPORTED = 8,
  CUSOLVER_STATUS_NOT_SUPPORTED = 9,
} cusolverStatus_t;

typedef enum { CUSOLVER_EIG_MODE_NOVECTOR = 0, CUSOLVER_EIG_MODE_VECTOR = 1 } cusolverEigMode_t;

extern "C" {
cusolverStatus_t cusolverDnCreate(cusolverDnHandle_t* handle);
cusolverStatus_t cusolverDnDestroy(cusolverDnHandle_t handle);
cusolverStatus_t cusolverDnSetStream(cusolverDnHandle_t handle, cudaStream_t stream);
cusolverStatus_t cusolverDnGetStream(cusolverDnHandle_t handle, cudaStream_t* stream);

cusolverStatus_t cusolverDnCreateSyevjInfo(syevjInfo_t* info);
cusolverStatus_t cusolverDnDestroySyevjInfo(syevjInfo_t info);
cusolverStatus_t cusolverDnXsyevjSetSortEig(syevjInfo_t info, int sort_eig);
cusolverStatus_t cusolverDnXsyevjSetTolerance(syevjInfo_t info, double tolerance);
cusolverStatus_t cusolverDnXsyevjSetMaxSweeps(syevjInfo_t info, int max_sweeps);

cusolverStatus_t cusolverDnCreateParams(cusolverDnParams_t* params);
cusolverStatus_t cusolverDnDestroyParams(cusolverDnParams_t params);

cusolverStatus_t cusolverDnSsyevjBatched_bufferSize(cusolverDnHandle_t handle,
                                                    cusolverEigMode_t jobz,
                                                    cublasFillMode_t uplo, int n, const float* A,
                                                    int lda, const float* W, int* lwork,
                                                    syevjInfo_t params, int batchSize);
cusolverStatus_t cusolverDnDsyevjBatched_bufferSize(cusolverDnHandle_t handle,
                                                    cusolverEigMode_t jobz,
                                                    cublasFillMode_t uplo, int n, const double* A,
                                                    int lda, const double* W, int* lwork,
                                                    syevjInfo_t params, int batchSize);
cusolverStatus_t cusolverDnSsyevjBatched(cusolverDnHandle_t handle, cusolverEigMode_t jobz,
                                         cublasFillMode_t uplo, int n, float* A, int lda,
                                         float* W, float* work, int lwork, int* info,
                                         syevjInfo_t params, int batchSize);
cusolverStatus_t cusolverDnDsyevjBatched(cusolverDnHandle_t handle, cusolverEigMode_t jobz,
                                         cublasFillMode_t uplo, int n, double* A, int lda,
                                         double* W, double* work, int lwork, int* info,
                                         syevjInfo_t params, int batchSize);

cusolverStatus_t cusolverDnSsyevd_bufferSize(cusolverDnHandle_t handle, cusolverEigMode_t jobz,
                                             cublasFillMode_t uplo, int n, const float* A,
                                             int lda, const float* W, int* lwork);
cusolverStatus_t cusolverDnDsyevd_bufferSize(cusolverDnHandle_t handle, cusolverEigMode_t jobz,
                                             cublasFillMode_t uplo, int n, const double* A,
                                             int lda, const double* W, int* lwork);
cusolverStatus_t cusolverDnSsyevd(cusolverDnHandle_t handle, cusolverEigMode_t jobz,
                                  cublasFillMode_t uplo, int n, float* A, int lda, float* W,
                                  float* work, int lwork, int* info);
cusolverStatus_t cusolverDnDsyevd(cusolverDnHandle_t handle, cusolverEigMode_t jobz,
                                  cublasFillMode_t uplo, int n, double* A, int lda, double* W,
                                  double* work, int lwork, int* info);

cusolverStatus_t cusolverDnXsyevBatched_bufferSize(
    cusolverDnHandle_t handle, cusolverDnParams_t params, cusolverEigMode_t jobz,
    cublasFillMode_t uplo, int64_t n, cudaDataType dataTypeA, const void* A, int64_t lda,
    cudaDataType dataTypeW, const void* W, cudaDataType computeType,
    size_t* workspaceInBytesOnDevice, size_t* workspaceInBytesOnHost, int64_t batchSize);
cusolverStatus_t cusolverDnXsyevBatched(cusolverDnHandle_t handle, cusolverDnParams_t params,
                                        cusolverEigMode_t jobz, cublasFillMode_t uplo, int64_t n,
                                        cudaDataType dataTypeA, void* A, int64_t lda,
                                        cudaDataType dataTypeW, void* W, cudaDataType computeType,
                                        void* bufferOnDevice, size_t workspaceInBytesOnDevice,
                                        void* bufferOnHost, size_t workspaceInBytesOnHost,
                                        int* info, int64_t batchSize);
}
