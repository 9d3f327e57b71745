/* Stand-in libcudart.so.12 (rankscope simulator): the CUDA runtime API names rankscope probes, with their
 * real C signatures, each doing its work through the stand-in driver (libcuda.so.1) as the real runtime
 * does through the real one. So a runtime call contains driver calls, and the probes of both layers fire:
 * what tests of the layering need. The first call initializes the driver and a context, as the real
 * runtime does lazily. */
#include <pthread.h>
#include <stddef.h>

#include "rsim.h"

#define API RSIM_EXPORT

typedef int cudaError_t;
typedef int CUresult;
typedef struct CUctx_st *CUcontext;
typedef struct CUevent_st *cudaEvent_t;
typedef unsigned long long CUdeviceptr;

enum { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInitializationError = 3 };
enum cudaMemcpyKind { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2 };

CUresult cuInit(unsigned int flags);
CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, int dev);
CUresult cuStreamSynchronize(CUstream hStream);
CUresult cuStreamSynchronize_ptsz(CUstream hStream);
CUresult cuCtxSynchronize(void);
CUresult cuEventSynchronize(cudaEvent_t hEvent);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream hStream);
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t bytes, CUstream hStream);

static pthread_once_t once = PTHREAD_ONCE_INIT;
static int init_failed;

static void init_driver(void) {
    CUcontext ctx;
    init_failed = cuInit(0) != 0 || cuCtxCreate_v2(&ctx, 0, 0) != 0;
}

static cudaError_t result(CUresult rc) { return rc == 0 ? cudaSuccess : cudaErrorInvalidValue; }

#define LAZY_INIT()                           \
    do {                                      \
        pthread_once(&once, init_driver);     \
        if (init_failed)                      \
            return cudaErrorInitializationError; \
    } while (0)

API cudaError_t cudaStreamSynchronize(CUstream stream) {
    LAZY_INIT();
    return result(cuStreamSynchronize(stream));
}

API cudaError_t cudaStreamSynchronize_ptsz(CUstream stream) {
    LAZY_INIT();
    return result(cuStreamSynchronize_ptsz(stream));
}

API cudaError_t cudaDeviceSynchronize(void) {
    LAZY_INIT();
    return result(cuCtxSynchronize());
}

API cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    LAZY_INIT();
    return result(cuEventSynchronize(event));
}

static cudaError_t copy_async(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind, CUstream s) {
    if (kind == cudaMemcpyHostToDevice)
        return result(cuMemcpyHtoDAsync_v2((CUdeviceptr)dst, src, count, s));
    if (kind == cudaMemcpyDeviceToHost)
        return result(cuMemcpyDtoHAsync_v2(dst, (CUdeviceptr)src, count, s));
    return cudaErrorInvalidValue;
}

API cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind, CUstream stream) {
    LAZY_INIT();
    return copy_async(dst, src, count, kind, stream);
}

/* Synchronous: the copy on the default stream, and a wait for it. */
API cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind) {
    LAZY_INIT();
    cudaError_t rc = copy_async(dst, src, count, kind, NULL);
    return rc != cudaSuccess ? rc : result(cuStreamSynchronize(NULL));
}

API cudaError_t cudaMalloc(void **ptr, size_t size) {
    LAZY_INIT();
    return result(cuMemAlloc_v2((CUdeviceptr *)ptr, size));
}

API cudaError_t cudaFree(void *ptr) {
    LAZY_INIT();
    return result(cuMemFree_v2((CUdeviceptr)ptr));
}
