/* The project's stand-in for the NVIDIA driver library, libcuda.so.1, in the test hosts.
 *
 * vLLM's compiled extensions link against libcuda.so.1, so `import vllm.platforms.cuda` fails
 * on a machine without the NVIDIA driver ("libcuda.so.1: cannot open shared object file"),
 * before the engine probe (reconciler/engines/vllm_probe.py) can ask vLLM anything. A GPU
 * host has the real driver; the test hosts get this file instead. It exports the 17 driver
 * entry points vLLM 0.33.0's extensions import, and every one answers as a machine with the
 * driver but no GPU would: CUDA_ERROR_NO_DEVICE. Nothing here runs CUDA: the probe hides the
 * GPUs (CUDA_VISIBLE_DEVICES=) and tells vLLM the host's facts itself.
 *
 * Built by the test set-up (tests/engines.py): gcc -shared -fPIC -Wl,-soname,libcuda.so.1
 */
#include <stddef.h>

#define CUDA_SUCCESS 0
#define CUDA_ERROR_NO_DEVICE 100

/* Every entry point takes arguments the stand-in never reads; on x86-64 an unprototyped
 * definition that ignores them is called exactly like the real one. */
#define NO_DEVICE(name) int name() { return CUDA_ERROR_NO_DEVICE; }

NO_DEVICE(cuCtxGetCurrent)
NO_DEVICE(cuCtxSetCurrent)
NO_DEVICE(cuDeviceGetAttribute)
NO_DEVICE(cuDevicePrimaryCtxRetain)
NO_DEVICE(cuDriverGetVersion)
NO_DEVICE(cuGetProcAddress_v2)
NO_DEVICE(cuMemAddressFree)
NO_DEVICE(cuMemAddressReserve)
NO_DEVICE(cuMemCreate)
NO_DEVICE(cuMemGetAllocationGranularity)
NO_DEVICE(cuMemMap)
NO_DEVICE(cuMemRelease)
NO_DEVICE(cuMemSetAccess)
NO_DEVICE(cuMemUnmap)
NO_DEVICE(cuPointerGetAttribute)
NO_DEVICE(cuTensorMapEncodeTiled)
/* Also the usual first call of any CUDA program. */
NO_DEVICE(cuInit)
NO_DEVICE(cuDeviceGetCount)

int cuGetErrorString(int error, const char **str) {
    if (str == NULL) return 1; /* CUDA_ERROR_INVALID_VALUE */
    *str = error == CUDA_ERROR_NO_DEVICE
        ? "no CUDA-capable device is detected (the test hosts' libcuda stand-in)"
        : "unknown error (the test hosts' libcuda stand-in)";
    return CUDA_SUCCESS;
}
