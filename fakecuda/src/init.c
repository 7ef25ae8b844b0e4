/*
 * init.c: cuInit (builds the device tables from FAKECUDA_DEVICES and CUDA_VISIBLE_DEVICES,
 * creates the primary contexts and starts the checkpoint target's control thread), cuDriverGetVersion, cuGetErrorName
 * and cuGetErrorString; all but cuInit answer before cuInit, as on the real driver. It calls device.c,
 * checkpoint_target.c and core.c.
 */
#include "fc.h"

/* ------------------------------------------------------------------ init, errors */

static pthread_mutex_t g_init_mu = PTHREAD_MUTEX_INITIALIZER; /* one cuInit initialises */

FC_EXPORT CUresult cuInit(unsigned int Flags)
{
    CUresult r = CUDA_SUCCESS;
    if (Flags != 0)
        r = CUDA_ERROR_INVALID_VALUE;
    else if (g_forked_child)
        r = CUDA_ERROR_NOT_INITIALIZED;
    else {
        pthread_mutex_lock(&g_init_mu);
        if (!atomic_load(&g_inited) && (dev_config(), g_ndev == 0))
            r = CUDA_ERROR_NO_DEVICE;
        else if (!atomic_load(&g_inited)) {
            pthread_mutex_lock(&g_mu);
            for (int d = 0; d < g_ndev; d++)
                ctx_init(&g_prim[d], d, 1);
            pthread_mutex_unlock(&g_mu);
            ckpt_start();
            atomic_store_explicit(&g_inited, 1, memory_order_release);
        }
        pthread_mutex_unlock(&g_init_mu);
    }
    fc_log_call(__func__, r, "flags=%u", Flags);
    return r;
}

FC_EXPORT CUresult cuDriverGetVersion(int *v)
{
    API_NOGATE(0, v ? (*v = g_driver_version, CUDA_SUCCESS) : CUDA_ERROR_INVALID_VALUE, "");
}

static CUresult get_error_name(CUresult e, const char **s)
{
    if (!s)
        return CUDA_ERROR_INVALID_VALUE;
    *s = fc_errname(e);
    return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult get_error_string(CUresult e, const char **s)
{
    if (!s)
        return CUDA_ERROR_INVALID_VALUE;
    switch ((int)e) {
    case CUDA_SUCCESS: *s = "no error"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_VALUE: *s = "invalid argument"; return CUDA_SUCCESS;
    case CUDA_ERROR_OUT_OF_MEMORY: *s = "out of memory"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_INITIALIZED: *s = "initialization error"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_DEVICE: *s = "invalid device ordinal"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_CONTEXT: *s = "invalid device context"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_HANDLE: *s = "invalid resource handle"; return CUDA_SUCCESS;
    case CUDA_ERROR_ILLEGAL_STATE: *s = "the operation cannot be performed in the present state"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_FOUND: *s = "named symbol not found"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_READY: *s = "device not ready"; return CUDA_SUCCESS;
    case CUDA_ERROR_ILLEGAL_ADDRESS: *s = "an illegal memory access was encountered"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_PERMITTED: *s = "operation not permitted"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_SUPPORTED: *s = "operation not supported"; return CUDA_SUCCESS;
    }
    *s = fc_errname(e);
    return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FC_EXPORT CUresult cuGetErrorName(CUresult error, const char **pStr)
{
    API_NOGATE(0, get_error_name(error, pStr), "error=%d", (int)error);
}

FC_EXPORT CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    API_NOGATE(0, get_error_string(error, pStr), "error=%d", (int)error);
}
