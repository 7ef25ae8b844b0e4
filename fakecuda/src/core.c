/*
 * core.c: the bottom of fakecuda. The configuration (FAKECUDA_* read when the library is
 * loaded), the call log (FAKECUDA_LOG), the state of the entry gate every gated API passes
 * (fc.h has its inline enter/leave; cuCheckpointProcessLock closes it) and the fork handler.
 * It touches only its own globals and calls no other file.
 */
#include "fc.h"

/* ------------------------------------------------------------------ globals, config, log */

atomic_int g_inited;
int g_ndev = 2;
size_t g_gran = 2u << 20;
size_t g_page = 4096;
unsigned long long g_totalmem = 16ull << 30;
static int g_logfd = -1;
int g_hint_mode = HINT_HONOR; /* FAKECUDA_RESERVE_HINT */
unsigned long long g_mc_watchdog_ms = 10000; /* FAKECUDA_MULTICAST_WATCHDOG_MS (0: wait forever) */
unsigned long long g_mc_rounding;           /* FAKECUDA_MULTICAST_CAPACITY_ROUNDING (0: none) */
unsigned long long g_map_offsets;           /* FAKECUDA_MAP_OFFSETS (0: offset 0 only, as R580) */
int g_launch_job;  /* a job of cuda-checkpoint --launch-job: native checkpoint carries CUDA IPC (init.c) */
int g_persistence; /* FAKECUDA_PERSISTENCE_MODE (default 1): restore needs no cuInit in the caller */
const char *g_hold_fn; /* FAKECUDA_HOLD=FN:DIR (test only) */
static char g_hold_dir[512];

pid_t fc_tid(void) { return (pid_t)syscall(SYS_gettid); }

const char *fc_errname(CUresult r)
{
    switch ((int)r) {
#define X(n) \
    case n: return #n;
#include "fc_errors.inc"
#undef X
    default: return NULL;
    }
}

void fc_logline(const char *fmt, ...)
{
    if (g_logfd < 0)
        return;
    char buf[1024];
    int n = snprintf(buf, sizeof buf, "%d %d ", (int)getpid(), (int)fc_tid());
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (m < 0)
        return;
    n += m;
    if (n > (int)sizeof buf - 2)
        n = (int)sizeof buf - 2;
    buf[n++] = '\n';
    ssize_t w = write(g_logfd, buf, (size_t)n);
    (void)w;
}

/* A loud line: stderr and the call log. */
void fc_loud(const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "fakecuda[%d]: %s\n", (int)getpid(), buf);
    fc_logline("fakecuda: %s", buf);
}

void fc_log_call(const char *fn, CUresult r, const char *fmt, ...)
{
    if (g_logfd < 0)
        return;
    char args[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    const char *name = fc_errname(r);
    if (name)
        fc_logline("%s(%s) = %s", fn, args, name);
    else
        fc_logline("%s(%s) = %d", fn, args, (int)r);
}

static unsigned long long env_ull(const char *name, unsigned long long dflt)
{
    const char *s = getenv(name);
    if (!s || !*s)
        return dflt;
    char *end;
    unsigned long long v = strtoull(s, &end, 0);
    return *end ? dflt : v;
}

/* A child forked after cuInit cannot use the driver (as on the real driver): every call,
 * cuInit included, returns CUDA_ERROR_NOT_INITIALIZED there. */
int g_forked_child;
int g_ck_listen = -1; /* the checkpoint control socket (checkpoint_target.c serves it) */
int g_driver_version = FC_DRIVER_VERSION;
unsigned long long g_cs_timeout_ms;
static void fc_atfork_child(void)
{
    if (atomic_load(&g_inited)) {
        g_forked_child = 1;
        atomic_store(&g_inited, 0);
    }
    if (g_ck_listen >= 0) { /* the parent's control socket is not the child's to hold */
        close(g_ck_listen);
        g_ck_listen = -1;
    }
}

/* Read before cuInit so that lookups and pre-init errors are logged too. */
__attribute__((constructor)) static void fc_load(void)
{
    pthread_atfork(NULL, NULL, fc_atfork_child);
    const char *log = getenv("FAKECUDA_LOG");
    if (log && *log)
        g_logfd = open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    long pg = sysconf(_SC_PAGESIZE);
    if (pg > 0)
        g_page = (size_t)pg;
    g_ndev = (int)env_ull("FAKECUDA_DEVICE_COUNT", 2);
    if (g_ndev < 0)
        g_ndev = 0;
    if (g_ndev > FC_MAX_DEVICES)
        g_ndev = FC_MAX_DEVICES;
    g_gran = (size_t)env_ull("FAKECUDA_GRANULARITY", 2u << 20);
    if (g_gran < g_page || (g_gran & (g_gran - 1)))
        g_gran = 2u << 20;
    g_totalmem = env_ull("FAKECUDA_TOTAL_MEM", 16ull << 30);
    g_mc_watchdog_ms = env_ull("FAKECUDA_MULTICAST_WATCHDOG_MS", 10000);
    g_mc_rounding = env_ull("FAKECUDA_MULTICAST_CAPACITY_ROUNDING", 0);
    g_map_offsets = env_ull("FAKECUDA_MAP_OFFSETS", 0);
    g_launch_job = env_ull("FAKECUDA_LAUNCH_JOB", 0) != 0;
    g_persistence = env_ull("FAKECUDA_PERSISTENCE_MODE", 1) != 0;
    /* an older driver (e.g. 13010: no custom storage, no cuCheckpointOperationComplete) */
    unsigned long long ver = env_ull("FAKECUDA_DRIVER_VERSION", FC_DRIVER_VERSION);
    g_driver_version = ver >= 12080 && ver <= FC_DRIVER_VERSION ? (int)ver : FC_DRIVER_VERSION;
    g_cs_timeout_ms = env_ull("FAKECUDA_CUSTOM_STORAGE_TIMEOUT_MS", 600000);
    if (g_mc_rounding % g_gran) /* a capacity is always a multiple of the granularity */
        g_mc_rounding += g_gran - g_mc_rounding % g_gran;
    const char *hold = getenv("FAKECUDA_HOLD");
    const char *colon = hold ? strchr(hold, ':') : NULL;
    static char hold_fn[128];
    if (colon && colon > hold && (size_t)(colon - hold) < sizeof hold_fn && strlen(colon + 1) < sizeof g_hold_dir - 8) {
        memcpy(hold_fn, hold, (size_t)(colon - hold));
        strcpy(g_hold_dir, colon + 1);
        g_hold_fn = hold_fn;
    }
    const char *hint = getenv("FAKECUDA_RESERVE_HINT");
    if (hint && !strcmp(hint, "ignore"))
        g_hint_mode = HINT_IGNORE;
    else if (hint && !strcmp(hint, "fail"))
        g_hint_mode = HINT_FAIL;
}

/* FAKECUDA_HOLD=FN:DIR (test only: a test holds one driver call where it wants, without timing).
 * A call of FN made while DIR/hold exists creates DIR/held and waits, polling every ms, until
 * DIR/hold is gone; then it runs as usual. Outside the entry gate (a lock does not wait for it). */
void fc_hold(const char *fn)
{
    if (strcmp(fn, g_hold_fn) != 0)
        return;
    char hold[sizeof g_hold_dir + 8], held[sizeof g_hold_dir + 8];
    snprintf(hold, sizeof hold, "%s/hold", g_hold_dir);
    snprintf(held, sizeof held, "%s/held", g_hold_dir);
    if (access(hold, F_OK) != 0)
        return;
    int fd = open(held, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd >= 0)
        close(fd);
    fc_logline("fakecuda: %s held (FAKECUDA_HOLD)", fn);
    while (access(hold, F_OK) == 0)
        usleep(1000);
}

/* ------------------------------------------------------------------ entry gate (fc.h: struct fc_gate) */

struct fc_gate g_gate = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0};

/* One mutex for every table (contexts, streams, reservations, allocations, mappings). */
pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
