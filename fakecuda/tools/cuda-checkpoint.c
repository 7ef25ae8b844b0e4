/*
 * cuda-checkpoint.c: fakecuda's own `cuda-checkpoint` utility, with the flags, output and exit
 * status of NVIDIA's (NVIDIA/cuda-checkpoint README, `cuda-checkpoint --help`, r570), built on
 * the driver API's checkpoint functions of the libcuda.so.1 it links (fakecuda), so that the
 * agent's CLI backend (agent/mech/native_cli.py) runs against the fake as against the real one.
 *
 *   --get-state --pid P            prints "running", "locked", "checkpointed" or "failed"
 *                                  (the words CRIU's cuda plugin parses), exit 0
 *   --action lock|checkpoint|restore|unlock --pid P [--timeout MS]
 *                                  --timeout (ms) applies to lock only
 *   --device-map OLD=NEW[,...]     restore onto other GPUs: UUIDs "GPU-xxxxxxxx-xxxx-..."
 *                                  (r580+, cuda-checkpoint issues #18/#46; every
 *                                  checkpointed GPU listed), handed over as gpuPairs
 *   --toggle --pid P               running -> lock + checkpoint; checkpointed -> restore +
 *                                  unlock
 *   --get-restore-tid --pid P      prints the restore thread id, exit 0
 *   --help|-h                      the usage text, exit 0
 *
 * Exit status: 0 on success; 1 when the driver refused (stderr names the operation, the pid
 * and the CUresult name, e.g. "cuda-checkpoint: lock of pid 42 failed: CUDA_ERROR_NOT_READY");
 * 2 for a usage error (stderr says which flag). NVIDIA documents only "0 is success"; the
 * rest is this utility's own choice, and the agent relies only on 0 and the CUresult name.
 */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char USAGE[] = "CUDA checkpoint and restore utility (fakecuda).\n"
                            "\n"
                            "Operations:\n"
                            "--get-state --pid <pid>\n"
                            "        Prints the current checkpoint state of the process specified by <pid>\n"
                            "\n"
                            "--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>] "
                            "[--device-map <old>=<new>,...]\n"
                            "        Performs the specified action on <pid>.\n"
                            "        For the lock action a timeout in milliseconds can be provided.\n"
                            "        For the restore action --device-map remaps every checkpointed GPU (UUIDs).\n"
                            "\n"
                            "--toggle --pid <pid>\n"
                            "        Toggles the CUDA state of <pid> between the running and checkpointed states\n"
                            "\n"
                            "--get-restore-tid --pid <pid>\n"
                            "        Retrieves the CUDA restore thread ID of the process specified by <pid>\n"
                            "\n"
                            "Options:\n"
                            "--pid|-p <pid>\n"
                            "--timeout|-t <timeout>\n"
                            "--device-map <old>=<new>[,<old>=<new>...]\n"
                            "--help|-h\n";

static int usage_error(const char *what)
{
    fprintf(stderr, "cuda-checkpoint: %s (see --help)\n", what);
    return 2;
}

static const char *result_name(CUresult r)
{
    const char *s = NULL;
    if (cuGetErrorName(r, &s) != CUDA_SUCCESS || !s)
        return "CUDA_ERROR_UNKNOWN";
    return s;
}

static int failed(const char *op, int pid, CUresult r)
{
    fprintf(stderr, "cuda-checkpoint: %s of pid %d failed: %s\n", op, pid, result_name(r));
    return 1;
}

/* "GPU-" (optional) then 32 hex digits, dashes anywhere between them ignored. */
static int parse_uuid(const char *s, size_t n, CUuuid *u)
{
    if (n >= 4 && !strncmp(s, "GPU-", 4)) {
        s += 4;
        n -= 4;
    }
    int got = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        int v;
        if (c == '-')
            continue;
        if (c >= '0' && c <= '9')
            v = c - '0';
        else if (c >= 'a' && c <= 'f')
            v = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F')
            v = c - 'A' + 10;
        else
            return -1;
        if (got >= 32)
            return -1;
        if (got % 2 == 0)
            u->bytes[got / 2] = (char)(v << 4);
        else
            u->bytes[got / 2] = (char)(u->bytes[got / 2] | v);
        got++;
    }
    return got == 32 ? 0 : -1;
}

/* "OLD=NEW,OLD=NEW" -> pairs (malloc'd, *count set); -1 on a malformed map. */
static int parse_map(const char *map, CUcheckpointGpuPair **out, unsigned *count)
{
    unsigned n = 1;
    for (const char *p = map; *p; p++)
        n += *p == ',';
    CUcheckpointGpuPair *pairs = calloc(n, sizeof *pairs);
    if (!pairs)
        return -1;
    const char *p = map;
    for (unsigned i = 0; i < n; i++) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        const char *eq = memchr(p, '=', len);
        if (!eq || parse_uuid(p, (size_t)(eq - p), &pairs[i].oldUuid) ||
            parse_uuid(eq + 1, len - (size_t)(eq + 1 - p), &pairs[i].newUuid)) {
            free(pairs);
            return -1;
        }
        p = end ? end + 1 : p + len;
    }
    *out = pairs;
    *count = n;
    return 0;
}

static int do_action(const char *action, int pid, unsigned timeout_ms, const char *map)
{
    CUresult r;
    if (!strcmp(action, "lock")) {
        CUcheckpointLockArgs a;
        memset(&a, 0, sizeof a);
        a.timeoutMs = timeout_ms;
        r = cuCheckpointProcessLock(pid, &a);
    } else if (!strcmp(action, "checkpoint")) {
        r = cuCheckpointProcessCheckpoint(pid, NULL);
    } else if (!strcmp(action, "restore")) {
        CUcheckpointRestoreArgs a;
        memset(&a, 0, sizeof a);
        CUcheckpointGpuPair *pairs = NULL;
        if (map) {
            if (parse_map(map, &pairs, &a.gpuPairsCount))
                return usage_error("--device-map wants OLD=NEW[,OLD=NEW...] with GPU UUIDs");
            a.gpuPairs = pairs;
        }
        r = cuCheckpointProcessRestore(pid, map ? &a : NULL);
        free(pairs);
    } else if (!strcmp(action, "unlock")) {
        r = cuCheckpointProcessUnlock(pid, NULL);
    } else {
        return usage_error("--action must be lock, checkpoint, restore or unlock");
    }
    return r == CUDA_SUCCESS ? 0 : failed(action, pid, r);
}

static const char *state_word(CUprocessState s)
{
    switch (s) {
    case CU_PROCESS_STATE_RUNNING: return "running";
    case CU_PROCESS_STATE_LOCKED: return "locked";
    case CU_PROCESS_STATE_CHECKPOINTED: return "checkpointed";
    case CU_PROCESS_STATE_CHECKPOINTING: return "checkpointing"; /* custom storage (13.4+) */
    case CU_PROCESS_STATE_RESTORING: return "restoring";
    default: return "failed";
    }
}

static int toggle(int pid)
{
    CUprocessState s;
    CUresult r = cuCheckpointProcessGetState(pid, &s);
    if (r != CUDA_SUCCESS)
        return failed("get-state", pid, r);
    if (s == CU_PROCESS_STATE_RUNNING) {
        int rc = do_action("lock", pid, 0, NULL);
        return rc ? rc : do_action("checkpoint", pid, 0, NULL);
    }
    if (s == CU_PROCESS_STATE_CHECKPOINTED) {
        int rc = do_action("restore", pid, 0, NULL);
        return rc ? rc : do_action("unlock", pid, 0, NULL);
    }
    fprintf(stderr, "cuda-checkpoint: pid %d is %s; --toggle needs running or checkpointed\n", pid, state_word(s));
    return 1;
}

int main(int argc, char **argv)
{
    const char *action = NULL, *map = NULL;
    int pid = 0, get_state = 0, get_tid = 0, do_toggle = 0, have_timeout = 0;
    unsigned long timeout_ms = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(USAGE, stdout);
            return 0;
        } else if (!strcmp(a, "--get-state")) {
            get_state = 1;
        } else if (!strcmp(a, "--get-restore-tid")) {
            get_tid = 1;
        } else if (!strcmp(a, "--toggle")) {
            do_toggle = 1;
        } else if (!strcmp(a, "--action") || !strcmp(a, "--pid") || !strcmp(a, "-p") || !strcmp(a, "--timeout") ||
                   !strcmp(a, "-t") || !strcmp(a, "--device-map")) {
            if (!v)
                return usage_error("a flag is missing its value");
            i++;
            char *end = NULL;
            if (!strcmp(a, "--action")) {
                action = v;
            } else if (!strcmp(a, "--device-map")) {
                map = v;
            } else if (a[2] == 'p' || a[1] == 'p') {
                long p = strtol(v, &end, 10);
                if (!end || *end || p <= 0 || p > 0x7fffffff)
                    return usage_error("--pid wants a positive process id");
                pid = (int)p;
            } else {
                timeout_ms = strtoul(v, &end, 10);
                if (!end || *end || *v == '-' || timeout_ms > 0xffffffffUL)
                    return usage_error("--timeout wants milliseconds (a non-negative integer)");
                have_timeout = 1;
            }
        } else {
            fprintf(stderr, "cuda-checkpoint: unknown argument '%s' (see --help)\n", a);
            return 2;
        }
    }
    if (get_state + get_tid + do_toggle + (action != NULL) != 1)
        return usage_error("give exactly one of --get-state, --action, --toggle, --get-restore-tid");
    if (!pid)
        return usage_error("--pid is required");
    if (have_timeout && (!action || strcmp(action, "lock")))
        return usage_error("--timeout applies to --action lock only");
    if (map && (!action || strcmp(action, "restore")))
        return usage_error("--device-map applies to --action restore only");
    CUresult r = cuInit(0); /* the controller must cuInit first (driver API docs) */
    if (r != CUDA_SUCCESS)
        return failed("cuInit", pid, r);
    if (get_state) {
        CUprocessState s;
        r = cuCheckpointProcessGetState(pid, &s);
        if (r != CUDA_SUCCESS)
            return failed("get-state", pid, r);
        printf("%s\n", state_word(s));
        return 0;
    }
    if (get_tid) {
        int tid = 0;
        r = cuCheckpointProcessGetRestoreThreadId(pid, &tid);
        if (r != CUDA_SUCCESS)
            return failed("get-restore-tid", pid, r);
        printf("%d\n", tid);
        return 0;
    }
    if (do_toggle)
        return toggle(pid);
    return do_action(action, pid, (unsigned)timeout_ms, map);
}
