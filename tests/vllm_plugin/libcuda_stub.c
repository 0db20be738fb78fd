/* A libcuda.so.1 with no device, so vllm.platforms.cuda imports on a machine without a GPU.
 *
 * vLLM's extension modules link these driver entry points; every one answers
 * CUDA_ERROR_NO_DEVICE. The tests build it with gcc (standins.build_libcuda_stub) and load
 * it RTLD_GLOBAL before importing vLLM. Nothing here is ever asked to do GPU work: the
 * tests replace what needs a GPU before calling it. */
#define CUDA_ERROR_NO_DEVICE 100

#define NO_DEVICE(name) int name(void) { return CUDA_ERROR_NO_DEVICE; }

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

int cuGetErrorString(int error, const char **text) {
    (void)error;
    *text = "no CUDA device (graphflow's test stub of libcuda)";
    return 0;
}
