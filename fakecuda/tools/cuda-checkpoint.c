/*
 * cuda-checkpoint.c: fakecuda's own `cuda-checkpoint` utility, with the flags, output, error
 * lines and exit status of NVIDIA's, built on the driver API's checkpoint functions of the
 * libcuda.so.1 it links (fakecuda), so that the agent's CLI backend (agent/mech/native_cli.py)
 * and CRIU's cuda plugin (plugins/cuda/cuda_plugin_cli.c) run against the fake as against the
 * real one. Sources: NVIDIA/cuda-checkpoint README (`--help` of r570), the r580 help quoted in
 * NVIDIA/cuda-checkpoint #18 and #46 (`--device-map|-d`), the r590 help quoted in #43
 * (`--launch-job|-j`, CUDA_CHECKPOINT_JOB_FILE), error lines quoted in #35, #47 and kaito-project
 * grit #9, exit statuses in checkpoint-restore/criu PR #2540.
 *
 *   --get-state --pid P            prints "running", "locked", "checkpointed" or "failed"
 *                                  (the words CRIU's cuda plugin parses), exit 0
 *   --action lock|checkpoint|restore|unlock --pid P [--timeout MS] [--device-map MAP]
 *                                  --timeout (ms) applies to lock only; --device-map|-d to
 *                                  restore only: "OLD=NEW,..." GPU UUIDs ("GPU-" + 32 hex
 *                                  digits, dashes free), every checkpointed GPU listed, handed
 *                                  over as gpuPairs
 *   --toggle --pid P               running -> lock + checkpoint; checkpointed -> restore + unlock
 *   --get-restore-tid --pid P      prints the restore thread id, exit 0
 *   --launch-job|-j PROGRAM ARGS...  makes a memfd the job file, sets CUDA_CHECKPOINT_JOB_FILE to
 *                                  /proc/<pid>/fd/<n> (that memfd) and executes PROGRAM in this
 *                                  process (every argument after it is PROGRAM's)
 *   --help|-h                      the usage text (it names --action: CRIU's plugin probes it)
 *
 * A driver refusal prints `Could not <operation> on process ID <pid>: "<cuGetErrorString>"` on
 * stderr and exits with the CUresult as the status (the kernel keeps its low 8 bits: 401 ->
 * 145), as NVIDIA's does ("it always returns the positive CUDA error code", criu PR #2540); a
 * failed cuInit prints `Error initializing CUDA: "<string>"` and exits the same way. The texts of
 * the get-state and get-restore-tid failures follow that pattern (unconfirmed:
 * scripts/gpu_check_probe.py records the real ones). A usage error exits 2 naming the flag
 * (this utility's own text). With CUDA_CHECKPOINT_JOB_FILE set (a job's file, as the agent or a
 * CRIU plugin of that job passes it on) every operation holds an exclusive flock(2) on that file
 * while it runs: operations on the processes of one job run one at a time, as NVIDIA asks.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <unistd.h>

static const char USAGE[] =
    "CUDA checkpoint and restore utility (fakecuda: the flags of NVIDIA's cuda-checkpoint).\n"
    "\n"
    "Operations:\n"
    "--get-state --pid <pid>\n"
    "        Prints the checkpoint state of <pid>: running, locked, checkpointed or failed\n"
    "\n"
    "--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>] [--device-map <uuids>]\n"
    "        Performs the action on <pid>. A lock waits up to --timeout milliseconds (0 or none: no limit).\n"
    "        A restore may remap GPUs: --device-map oldUuid=newUuid,... listing every checkpointed GPU.\n"
    "\n"
    "--toggle --pid <pid>\n"
    "        Running: lock and checkpoint <pid>; checkpointed: restore and unlock it\n"
    "\n"
    "--get-restore-tid --pid <pid>\n"
    "        Prints the id of the CUDA restore thread of <pid>\n"
    "\n"
    "--launch-job|-j <program> [<arg1> ... [<argn>]]\n"
    "        Makes a memfd the job file, points CUDA_CHECKPOINT_JOB_FILE at it and runs the program\n"
    "\n"
    "Options:\n"
    "--pid|-p <pid>\n"
    "--timeout|-t <timeout>\n"
    "--device-map|-d <deviceUuids>\n"
    "--help|-h\n";

static int usage_error(const char *what)
{
    fprintf(stderr, "cuda-checkpoint: %s (see --help)\n", what);
    return 2;
}

static const char *result_text(CUresult r)
{
    const char *s = NULL;
    if (cuGetErrorString(r, &s) != CUDA_SUCCESS || !s)
        return "unknown error";
    return s;
}

/* The exit status of a refusal: the CUresult (its low 8 bits reach the parent), never 0. */
static int status_of(CUresult r) { return ((int)r & 0xff) ? (int)r : 1; }

static int failed(const char *op, int pid, CUresult r)
{
    fprintf(stderr, "Could not %s on process ID %d: \"%s\"\n", op, pid, result_text(r));
    return status_of(r);
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
        return failed("get state", pid, r);
    if (s == CU_PROCESS_STATE_RUNNING) {
        int rc = do_action("lock", pid, 0, NULL);
        return rc ? rc : do_action("checkpoint", pid, 0, NULL);
    }
    if (s == CU_PROCESS_STATE_CHECKPOINTED) {
        int rc = do_action("restore", pid, 0, NULL);
        return rc ? rc : do_action("unlock", pid, 0, NULL);
    }
    fprintf(stderr, "Could not toggle process ID %d: it is %s (toggle needs running or checkpointed)\n", pid,
            state_word(s));
    return status_of(CUDA_ERROR_ILLEGAL_STATE);
}

/* --launch-job: the job file is a memfd without close-on-exec, named by /proc/<pid>/fd/<n> (this
 * pid is the program's after execvp). A program that cannot be run: 127 (not found) or 126, as
 * env(1) answers. */
static int launch_job(char **argv)
{
    int fd = memfd_create("cuda-checkpoint-job", 0);
    if (fd < 0) {
        fprintf(stderr, "Could not create the job file: %s\n", strerror(errno));
        return 1;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)getpid(), fd);
    setenv("CUDA_CHECKPOINT_JOB_FILE", path, 1);
    execvp(argv[0], argv);
    int e = errno;
    fprintf(stderr, "Could not launch %s: %s\n", argv[0], strerror(e));
    return e == ENOENT ? 127 : 126;
}

/* A job's operations one at a time: an exclusive flock on CUDA_CHECKPOINT_JOB_FILE, held until
 * exit. An unopenable job file is refused before anything is asked of the driver. */
static int job_lock(void)
{
    const char *jf = getenv("CUDA_CHECKPOINT_JOB_FILE");
    if (!jf || !*jf)
        return 0;
    int fd = open(jf, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || flock(fd, LOCK_EX) != 0) {
        fprintf(stderr, "Could not open the job file CUDA_CHECKPOINT_JOB_FILE=%s: %s\n", jf, strerror(errno));
        return 1;
    }
    return 0; /* fd stays open: the lock lasts until exit */
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
        } else if (!strcmp(a, "--launch-job") || !strcmp(a, "-j")) {
            if (action || pid || get_state || get_tid || do_toggle || map || have_timeout)
                return usage_error("--launch-job takes no other operation or option");
            if (!v)
                return usage_error("--launch-job needs a program to run");
            return launch_job(argv + i + 1);
        } else if (!strcmp(a, "--get-state")) {
            get_state = 1;
        } else if (!strcmp(a, "--get-restore-tid")) {
            get_tid = 1;
        } else if (!strcmp(a, "--toggle")) {
            do_toggle = 1;
        } else if (!strcmp(a, "--action") || !strcmp(a, "--pid") || !strcmp(a, "-p") || !strcmp(a, "--timeout") ||
                   !strcmp(a, "-t") || !strcmp(a, "--device-map") || !strcmp(a, "-d")) {
            if (!v)
                return usage_error("a flag is missing its value");
            i++;
            char *end = NULL;
            if (!strcmp(a, "--action")) {
                action = v;
            } else if (!strcmp(a, "--device-map") || !strcmp(a, "-d")) {
                map = v;
            } else if (!strcmp(a, "--pid") || !strcmp(a, "-p")) {
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
        return usage_error("give exactly one of --get-state, --action, --toggle, --get-restore-tid, --launch-job");
    if (!pid)
        return usage_error("--pid is required");
    if (have_timeout && (!action || strcmp(action, "lock")))
        return usage_error("--timeout applies to --action lock only");
    if (map && (!action || strcmp(action, "restore")))
        return usage_error("--device-map applies to --action restore only");
    if (job_lock())
        return 1;
    CUresult r = cuInit(0); /* as NVIDIA's utility does (grit #9: "Error initializing CUDA") */
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "Error initializing CUDA: \"%s\"\n", result_text(r));
        return status_of(r);
    }
    if (get_state) {
        CUprocessState s;
        r = cuCheckpointProcessGetState(pid, &s);
        if (r != CUDA_SUCCESS)
            return failed("get state", pid, r);
        printf("%s\n", state_word(s));
        return 0;
    }
    if (get_tid) {
        int tid = 0;
        r = cuCheckpointProcessGetRestoreThreadId(pid, &tid);
        if (r != CUDA_SUCCESS)
            return failed("get restore thread ID", pid, r);
        printf("%d\n", tid);
        return 0;
    }
    if (do_toggle)
        return toggle(pid);
    return do_action(action, pid, (unsigned)timeout_ms, map);
}
