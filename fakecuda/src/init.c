/*
 * init.c: cuInit (builds the device tables from FAKECUDA_DEVICES and CUDA_VISIBLE_DEVICES,
 * creates the primary contexts, starts the checkpoint target's control thread and reads
 * CUDA_CHECKPOINT_JOB_FILE), cuDriverGetVersion, cuGetErrorName
 * and cuGetErrorString; all but cuInit answer before cuInit, as on the real driver. It calls device.c,
 * checkpoint_target.c and core.c.
 */
#include "fc.h"

/* ------------------------------------------------------------------ init, errors */

/* A process started under `cuda-checkpoint --launch-job` (r590+; NVIDIA/cuda-checkpoint #43: it
 * "initializes a memfd to become a job file, sets CUDA_CHECKPOINT_JOB_FILE to point to that memfd
 * and launches the command") is a job: from r610 its native checkpoint carries CUDA IPC memory
 * (NVIDIA/cuda-checkpoint #56). The fake reads the variable at cuInit; a job file it cannot open
 * is no job (said loudly). FAKECUDA_LAUNCH_JOB=1 makes any process one. */
static void job_config(void)
{
    const char *jf = getenv("CUDA_CHECKPOINT_JOB_FILE");
    if (!jf || !*jf)
        return;
    int fd = open(jf, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        fc_loud("CUDA_CHECKPOINT_JOB_FILE=%s cannot be opened (%s): pid %d is not part of a cuda-checkpoint job "
                "(native checkpoint refuses CUDA IPC memory as before r610)",
                jf, strerror(errno), (int)getpid());
        return;
    }
    close(fd);
    g_launch_job = 1;
    fc_logline("fakecuda: pid %d is a job of cuda-checkpoint --launch-job (CUDA_CHECKPOINT_JOB_FILE=%s)", (int)getpid(),
               jf);
}

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
            job_config();
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
    case CUDA_ERROR_OPERATING_SYSTEM: *s = "OS call failed or operation not supported on this OS"; return CUDA_SUCCESS;
    case CUDA_ERROR_NO_DEVICE: *s = "no CUDA-capable device is detected"; return CUDA_SUCCESS;
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
