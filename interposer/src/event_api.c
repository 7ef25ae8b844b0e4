/*
 * event_api.c: IPC events (docs/shim.md "IPC events"; CUDA driver API "Event Management" and
 * "Inter-Process Communication"), on the API layer above peer.c (the FETCH_FD client).
 *
 * PyTorch sends an event with every CUDA storage it shares (torch/csrc/CudaIPCTypes.cpp:
 * cudaEventCreateWithFlags(DisableTiming | Interprocess | BlockingSync), recorded on the current
 * stream; torch/csrc/StorageSharing.cpp: cudaIpcGetEventHandle, and the consumer's
 * cudaIpcOpenEventHandle + cudaStreamWaitEvent). Native checkpoint cannot be trusted with them
 * (the documentation is silent; fakecuda refuses), so every interprocess event is virtual:
 * - cuEventCreate with CU_EVENT_INTERPROCESS and cuIpcOpenEventHandle of a virtual handle hand
 *   the application a virtual CUevent: an address in a PROT_NONE reservation of this file
 *   (never dereferenced, never a driver object), one 16-byte slot per event. Every call taking a
 *   CUevent translates it (one range test for any other event: no lock, no cost beyond it).
 * - cuIpcGetEventHandle of one returns struct cui_ipc_event_handle (protocol.h): creator pid,
 *   event id, secret, flags. The driver's own 64 bytes go into a sealed memfd in the export
 *   cache under the event id, so an opener's FETCH_FD (with the secret) returns them and it
 *   opens them with the driver.
 * - PREPARE_UNICAST drains (cuEventSynchronize) and destroys every driver event behind a virtual
 *   one (cui_events_teardown); LOAD_ALLOCATIONS re-creates the creators' with the same flags and
 *   re-exports them (cui_events_recreate); RESTORE_UNICAST re-opens the openers' from the
 *   creators (cui_events_reopen). A re-created event was never recorded, so a wait on it
 *   returns at once: what a wait on the drained event did. An opened event whose creator
 *   destroyed it before the capture (PyTorch's consumer keeps its opened events) gets a
 *   completed local event in its place (cuda.h: using it is undefined behaviour anyway).
 * Any other event passes through untouched; a driver IPC event handle that passes through
 * (an event the shim did not create, a handle not made by a shim) is remembered, and INSPECT
 * refuses the capture naming pid and handle (cui_events_inspect).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "api.h"

#define EV_MAX    (1u << 20) /* virtual events at once */
#define EV_STRIDE 16u     /* bytes of reservation per virtual CUevent */

struct cui_event {
  int live;
  int opened;          /* from cuIpcOpenEventHandle (0: created here with CU_EVENT_INTERPROCESS) */
  int exported;        /* created: its driver handle is in the export cache */
  int standin;         /* opened: its creator's event was gone at restore; a local one stands in */
  unsigned flags;      /* CU_EVENT_* (opened: DISABLE_TIMING, as the driver's opened events) */
  CUevent real;        /* NULL while torn down (PREPARE_UNICAST .. LOAD / RESTORE_UNICAST) */
  CUcontext ctx;       /* current at the create or open */
  uint8_t id[16];      /* created: its id; opened: the creator's */
  uint32_t creator_pid;
  uint32_t next_free;  /* free-slot list (index + 1) */
};

static pthread_mutex_t g_ev_lock = PTHREAD_MUTEX_INITIALIZER;
static uintptr_t g_ev_base; /* the reservation; 0 until the first virtual event */
static struct cui_event *g_ev;
static uint32_t g_ev_n, g_ev_cap, g_ev_free, g_ev_live;

/* Driver IPC event handles that passed through (they block a checkpoint). */
#define EV_FOREIGN_MAX 64
static struct {
  CUevent ev;
  uint8_t head[8];
  int import;
} g_evf[EV_FOREIGN_MAX];
static uint32_t g_nevf, g_evf_lost;

#define EV_REAL_OR(var, row, missing) \
  cui_fn_##row var = REAL(row);       \
  if (!var) return missing

/* ---------- the table ---------- */

static inline int ev_index(CUevent e, uint32_t *i) {
  uintptr_t b = __atomic_load_n(&g_ev_base, __ATOMIC_ACQUIRE), v = (uintptr_t)e;
  if (!b || v < b || v - b >= (uintptr_t)EV_MAX * EV_STRIDE || (v - b) % EV_STRIDE) return 0;
  *i = (uint32_t)((v - b) / EV_STRIDE);
  return 1;
}

static inline CUevent ev_value(uint32_t i) { return (CUevent)(g_ev_base + (uintptr_t)i * EV_STRIDE); }

static inline int gate_open(void) {
  return __atomic_load_n(&cui_st.phase, __ATOMIC_ACQUIRE) == CUI_PHASE_ACTIVE &&
         !__atomic_load_n(&cui_st.op_running, __ATOMIC_ACQUIRE);
}

/* A free slot (g_ev_lock held), or -1 out of memory / EV_MAX live events. */
static int64_t ev_alloc(void) {
  if (!g_ev_base) {
    void *p = mmap(NULL, (size_t)EV_MAX * EV_STRIDE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return -1;
    __atomic_store_n(&g_ev_base, (uintptr_t)p, __ATOMIC_RELEASE);
  }
  uint32_t i;
  if (g_ev_free) {
    i = g_ev_free - 1;
    g_ev_free = g_ev[i].next_free;
  } else {
    if (g_ev_n == EV_MAX) return -1;
    if (g_ev_n == g_ev_cap) {
      uint32_t cap = g_ev_cap ? g_ev_cap * 2 : 64;
      struct cui_event *t = realloc(g_ev, (size_t)cap * sizeof *t);
      if (!t) return -1;
      g_ev = t;
      g_ev_cap = cap;
    }
    i = g_ev_n++;
  }
  memset(&g_ev[i], 0, sizeof g_ev[i]);
  g_ev[i].live = 1;
  g_ev_live++;
  return i;
}

static void ev_free(uint32_t i) {
  g_ev[i].live = 0;
  g_ev[i].next_free = g_ev_free;
  g_ev_free = i + 1;
  g_ev_live--;
}

static void foreign_add(CUevent ev, const void *head, int import) {
  pthread_mutex_lock(&g_ev_lock);
  if (g_nevf < EV_FOREIGN_MAX) {
    g_evf[g_nevf].ev = ev;
    memcpy(g_evf[g_nevf].head, head, 8);
    g_evf[g_nevf].import = import;
    g_nevf++;
  } else {
    g_evf_lost++;
  }
  pthread_mutex_unlock(&g_ev_lock);
}

static void foreign_drop(CUevent ev) {
  pthread_mutex_lock(&g_ev_lock);
  for (uint32_t k = 0; k < g_nevf; k++)
    if (g_evf[k].ev == ev) g_evf[k--] = g_evf[--g_nevf];
  pthread_mutex_unlock(&g_ev_lock);
}

/* The driver event behind `e`: itself for any other event; NOT_READY outside ACTIVE or while
 * torn down; INVALID_HANDLE for a destroyed virtual one. */
static CUresult ev_translate(CUevent e, CUevent *out) {
  uint32_t i;
  if (!ev_index(e, &i)) {
    *out = e;
    return CUDA_SUCCESS;
  }
  if (!gate_open()) return CUDA_ERROR_NOT_READY;
  pthread_mutex_lock(&g_ev_lock);
  CUresult r = CUDA_SUCCESS;
  if (i >= g_ev_n || !g_ev[i].live) r = CUDA_ERROR_INVALID_HANDLE;
  else if (!g_ev[i].real) r = CUDA_ERROR_NOT_READY;
  else *out = g_ev[i].real;
  pthread_mutex_unlock(&g_ev_lock);
  return r;
}

/* A sealed memfd holding the driver's 64 handle bytes (what FETCH_FD serves), or -1. */
static int handle_memfd(const CUipcEventHandle *h) {
  int fd = memfd_create("cuinterpose-ipc-event", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return -1;
  if (pwrite(fd, h, sizeof *h, 0) != (ssize_t)sizeof *h ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

/* Export slot i's driver event into the export cache (g_ev_lock held). */
static CUresult ev_export(struct cui_event *ev) {
  EV_REAL_OR(get, cuIpcGetEventHandle, CUDA_ERROR_NOT_SUPPORTED);
  CUipcEventHandle dh;
  CUresult r = get(&dh, ev->real);
  if (r != CUDA_SUCCESS) return r;
  int fd = handle_memfd(&dh);
  if (fd < 0 || cui_cache_put(ev->id, fd) != 0) {
    if (fd >= 0) close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  ev->exported = 1;
  return CUDA_SUCCESS;
}

static CUcontext current_ctx(void) {
  CUcontext c = NULL;
  if (REAL(cuCtxGetCurrent)) REAL(cuCtxGetCurrent)(&c);
  return c;
}

/* ---------- create, record, wait, query, destroy ---------- */

CUI_EXPORT CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) {
  EV_REAL_OR(real, cuEventCreate, CUDA_ERROR_NOT_INITIALIZED);
  CUI_FORK_FORWARD("cuEventCreate", real(phEvent, Flags));
  if (!(Flags & CU_EVENT_INTERPROCESS) || !phEvent) return real(phEvent, Flags);
  if (!gate_open()) return CUDA_ERROR_NOT_READY;
  CUevent e = NULL;
  CUresult r = real(&e, Flags);
  if (r != CUDA_SUCCESS) return r;
  CUcontext ctx = current_ctx();
  pthread_mutex_lock(&g_ev_lock);
  int64_t i = ev_alloc();
  if (i >= 0) {
    g_ev[i].flags = Flags;
    g_ev[i].real = e;
    g_ev[i].ctx = ctx;
    g_ev[i].creator_pid = (uint32_t)getpid();
    cui_random_id(g_ev[i].id);
    *phEvent = ev_value((uint32_t)i);
  }
  pthread_mutex_unlock(&g_ev_lock);
  if (i >= 0) return CUDA_SUCCESS;
  if (REAL(cuEventDestroy_v2)) REAL(cuEventDestroy_v2)(e);
  return CUDA_ERROR_OUT_OF_MEMORY;
}

#define EV_CALL(row, api, ev, ...)                    \
  do {                                                \
    EV_REAL_OR(real_, row, CUDA_ERROR_NOT_SUPPORTED); \
    CUI_FORK_FORWARD(api, real_(__VA_ARGS__));        \
    CUevent e_;                                       \
    CUresult r_ = ev_translate(ev, &e_);              \
    if (r_ != CUDA_SUCCESS) return r_;                \
    ev = e_;                                          \
    return real_(__VA_ARGS__);                        \
  } while (0)

CUI_EXPORT CUresult cuEventRecord(CUevent hEvent, CUstream hStream) {
  EV_CALL(cuEventRecord, "cuEventRecord", hEvent, hEvent, hStream);
}
CUI_EXPORT CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream) {
  EV_CALL(cuEventRecord_ptsz, "cuEventRecord_ptsz", hEvent, hEvent, hStream);
}
CUI_EXPORT CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags) {
  EV_CALL(cuEventRecordWithFlags, "cuEventRecordWithFlags", hEvent, hEvent, hStream, flags);
}
CUI_EXPORT CUresult cuEventRecordWithFlags_ptsz(CUevent hEvent, CUstream hStream, unsigned int flags) {
  EV_CALL(cuEventRecordWithFlags_ptsz, "cuEventRecordWithFlags_ptsz", hEvent, hEvent, hStream, flags);
}
CUI_EXPORT CUresult cuEventQuery(CUevent hEvent) { EV_CALL(cuEventQuery, "cuEventQuery", hEvent, hEvent); }
CUI_EXPORT CUresult cuEventSynchronize(CUevent hEvent) {
  EV_CALL(cuEventSynchronize, "cuEventSynchronize", hEvent, hEvent);
}
CUI_EXPORT CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
  EV_CALL(cuStreamWaitEvent, "cuStreamWaitEvent", hEvent, hStream, hEvent, Flags);
}
CUI_EXPORT CUresult cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags) {
  EV_CALL(cuStreamWaitEvent_ptsz, "cuStreamWaitEvent_ptsz", hEvent, hStream, hEvent, Flags);
}

/* cuEventElapsedTime[_v2]: both events translated (an interprocess event has no timing: the
 * driver answers for it). */
static CUresult elapsed(cui_fn_cuEventElapsedTime_v2 real, float *ms, CUevent a, CUevent b) {
  if (!real) return CUDA_ERROR_NOT_SUPPORTED;
  CUI_FORK_FORWARD("cuEventElapsedTime", real(ms, a, b));
  CUevent ra, rb;
  CUresult r = ev_translate(a, &ra);
  if (r == CUDA_SUCCESS) r = ev_translate(b, &rb);
  return r == CUDA_SUCCESS ? real(ms, ra, rb) : r;
}
CUI_EXPORT CUresult cui_cuEventElapsedTime_v1(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
  return elapsed((cui_fn_cuEventElapsedTime_v2)REAL(cuEventElapsedTime), pMilliseconds, hStart, hEnd);
}
CUI_EXPORT CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
  return elapsed(REAL(cuEventElapsedTime_v2), pMilliseconds, hStart, hEnd);
}

static CUresult destroy(cui_fn_cuEventDestroy_v2 real, const char *api, CUevent e) {
  if (!real) return CUDA_ERROR_NOT_SUPPORTED;
  CUI_FORK_FORWARD(api, real(e));
  uint32_t i;
  if (!ev_index(e, &i)) {
    CUresult r = real(e);
    if (r == CUDA_SUCCESS && g_nevf) foreign_drop(e);
    return r;
  }
  if (!gate_open()) return CUDA_ERROR_NOT_READY;
  pthread_mutex_lock(&g_ev_lock);
  if (i >= g_ev_n || !g_ev[i].live) {
    pthread_mutex_unlock(&g_ev_lock);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  CUevent d = g_ev[i].real;
  if (g_ev[i].exported) {
    cui_cache_close(g_ev[i].id);
    cui_secret_forget(g_ev[i].id, g_ev[i].creator_pid);
  }
  ev_free(i);
  pthread_mutex_unlock(&g_ev_lock);
  return d ? real(d) : CUDA_SUCCESS;
}
CUI_EXPORT CUresult cui_cuEventDestroy_v1(CUevent hEvent) {
  return destroy((cui_fn_cuEventDestroy_v2)REAL(cuEventDestroy), "cuEventDestroy", hEvent);
}
CUI_EXPORT CUresult cuEventDestroy_v2(CUevent hEvent) {
  return destroy(REAL(cuEventDestroy_v2), "cuEventDestroy_v2", hEvent);
}

/* ---------- IPC ---------- */

CUI_EXPORT CUresult cuIpcGetEventHandle(CUipcEventHandle *pHandle, CUevent event) {
  EV_REAL_OR(real, cuIpcGetEventHandle, CUDA_ERROR_NOT_SUPPORTED);
  CUI_FORK_FORWARD("cuIpcGetEventHandle", real(pHandle, event));
  uint32_t i;
  if (!pHandle || !ev_index(event, &i)) {
    CUresult r = real(pHandle, event);
    if (r == CUDA_SUCCESS) foreign_add(event, pHandle->reserved, 0);
    return r;
  }
  if (!gate_open()) return CUDA_ERROR_NOT_READY;
  pthread_mutex_lock(&g_ev_lock);
  struct cui_event *ev = i < g_ev_n && g_ev[i].live ? &g_ev[i] : NULL;
  CUresult r = !ev ? CUDA_ERROR_INVALID_HANDLE : !ev->real ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
  if (r == CUDA_SUCCESS && ev->opened) {   /* the driver's answer for an opened event */
    CUevent d = ev->real;
    pthread_mutex_unlock(&g_ev_lock);
    r = real(pHandle, d);
    if (r == CUDA_SUCCESS) foreign_add(event, pHandle->reserved, 0);
    return r;
  }
  if (r == CUDA_SUCCESS && !ev->exported) r = ev_export(ev);
  uint64_t secret = r == CUDA_SUCCESS ? cui_secret_make(ev->id) : 0;
  if (r == CUDA_SUCCESS && !secret) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    struct cui_ipc_event_handle h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, CUI_IPC_EVENT_MAGIC, 8);
    h.version = CUI_PROTO_VERSION;
    h.creator_pid = ev->creator_pid;
    memcpy(h.event_id, ev->id, 16);
    h.secret = secret;
    h.flags = ev->flags;
    memcpy(pHandle->reserved, &h, sizeof h);
  }
  pthread_mutex_unlock(&g_ev_lock);
  return r;
}

/* The creator's driver handle of `h` (FETCH_FD), opened with the driver into *out. `status`:
 * the creator's reply (CUI_NOT_FOUND: it holds no such event). */
static CUresult open_real(const struct cui_ipc_event_handle *h, CUevent *out, int32_t *status, char *why, size_t cap) {
  EV_REAL_OR(open, cuIpcOpenEventHandle, CUDA_ERROR_NOT_SUPPORTED);
  cui_secret_learn(h->event_id, h->creator_pid, h->secret);
  int fd = cui_fetch_fd_status(h->creator_pid, h->event_id, why, cap, status);
  if (fd < 0) return CUDA_ERROR_INVALID_HANDLE;
  CUipcEventHandle dh;
  ssize_t n = pread(fd, &dh, sizeof dh, 0);
  close(fd);
  if (n != (ssize_t)sizeof dh) {
    snprintf(why, cap, "the creator's handle file holds %zd bytes, not %zu", n, sizeof dh);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  return open(out, dh);
}

CUI_EXPORT CUresult cuIpcOpenEventHandle(CUevent *phEvent, CUipcEventHandle handle) {
  EV_REAL_OR(real, cuIpcOpenEventHandle, CUDA_ERROR_NOT_SUPPORTED);
  CUI_FORK_FORWARD("cuIpcOpenEventHandle", real(phEvent, handle));
  struct cui_ipc_event_handle h;
  memcpy(&h, handle.reserved, sizeof h);
  if (memcmp(h.magic, CUI_IPC_EVENT_MAGIC, 8) != 0) {
    CUresult r = real(phEvent, handle);
    if (r == CUDA_SUCCESS && phEvent) foreign_add(*phEvent, handle.reserved, 1);
    return r;
  }
  if (!phEvent) return CUDA_ERROR_INVALID_VALUE;
  char hex[33], why[256] = "";
  cui_hex_id(h.event_id, hex);
  if (h.version != CUI_PROTO_VERSION) {
    cui_api_warn("cuIpcOpenEventHandle",
                 "IPC event handle of event %s (creator pid %u) has version %u, this shim reads %u: "
                 "CUDA_ERROR_INVALID_VALUE",
                 hex, h.creator_pid, (unsigned)h.version, (unsigned)CUI_PROTO_VERSION);
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!gate_open()) return CUDA_ERROR_NOT_READY;
  CUevent d = NULL;
  int32_t status;
  CUresult r = open_real(&h, &d, &status, why, sizeof why);
  if (r != CUDA_SUCCESS) {
    if (why[0])
      cui_api_warn("cuIpcOpenEventHandle", "cannot open IPC event %s of creator pid %u: %s: %s", hex, h.creator_pid,
                   why, cui_cu_error_name(r));
    return r;
  }
  CUcontext ctx = current_ctx();
  pthread_mutex_lock(&g_ev_lock);
  int64_t i = ev_alloc();
  if (i >= 0) {
    g_ev[i].opened = 1;
    g_ev[i].flags = CU_EVENT_DISABLE_TIMING;
    g_ev[i].real = d;
    g_ev[i].ctx = ctx;
    g_ev[i].creator_pid = h.creator_pid;
    memcpy(g_ev[i].id, h.event_id, 16);
    *phEvent = ev_value((uint32_t)i);
  }
  pthread_mutex_unlock(&g_ev_lock);
  if (i >= 0) return CUDA_SUCCESS;
  if (REAL(cuEventDestroy_v2)) REAL(cuEventDestroy_v2)(d);
  return CUDA_ERROR_OUT_OF_MEMORY;
}

/* ---------- phases (the phase ops call these with op_running set) ---------- */

static void set_ctx(CUcontext c) {
  if (c && REAL(cuCtxSetCurrent)) REAL(cuCtxSetCurrent)(c);
}

static int ev_fail(char *msg, size_t cap, const char *op, const struct cui_event *ev, const char *what, CUresult r) {
  char hex[33];
  cui_hex_id(ev->id, hex);
  snprintf(msg, cap, "%s: pid %u %s IPC event %s (creator pid %u, flags 0x%x): %s failed: %s", op, (unsigned)getpid(),
           ev->opened ? "opened" : "created", hex, ev->creator_pid, ev->flags, what, cui_cu_error_name(r));
  return -1;
}

int cui_events_teardown(char *msg, size_t cap, uint32_t *changed) {
  pthread_mutex_lock(&g_ev_lock);
  int rc = 0;
  for (uint32_t i = 0; i < g_ev_n && rc == 0; i++) {
    struct cui_event *ev = &g_ev[i];
    if (!ev->live || !ev->real) continue;
    set_ctx(ev->ctx);
    CUresult r = REAL(cuEventSynchronize)(ev->real);   /* drained: its recorded work is complete */
    if (r != CUDA_SUCCESS) {
      rc = ev_fail(msg, cap, "PREPARE_UNICAST", ev, "cuEventSynchronize", r);
      break;
    }
    r = REAL(cuEventDestroy_v2)(ev->real);
    if (r != CUDA_SUCCESS) {
      rc = ev_fail(msg, cap, "PREPARE_UNICAST", ev, "cuEventDestroy", r);
      break;
    }
    ev->real = NULL;
    (*changed)++;
  }
  pthread_mutex_unlock(&g_ev_lock);
  return rc;
}

int cui_events_recreate(char *msg, size_t cap, uint32_t *changed) {
  pthread_mutex_lock(&g_ev_lock);
  int rc = 0;
  for (uint32_t i = 0; i < g_ev_n && rc == 0; i++) {
    struct cui_event *ev = &g_ev[i];
    if (!ev->live || ev->opened || ev->real) continue;
    set_ctx(ev->ctx);
    CUresult r = REAL(cuEventCreate)(&ev->real, ev->flags);
    if (r != CUDA_SUCCESS) {
      ev->real = NULL;
      rc = ev_fail(msg, cap, "LOAD_ALLOCATIONS", ev, "cuEventCreate", r);
    } else if (ev->exported && (r = ev_export(ev)) != CUDA_SUCCESS) {
      rc = ev_fail(msg, cap, "LOAD_ALLOCATIONS", ev, "cuIpcGetEventHandle", r);
    } else {
      (*changed)++;
    }
  }
  pthread_mutex_unlock(&g_ev_lock);
  return rc;
}

int cui_events_reopen(char *msg, size_t cap, uint32_t *changed) {
  /* the FETCH_FD round trips run without g_ev_lock: app calls are gated (op_running) */
  for (uint32_t i = 0; i < g_ev_n; i++) {
    struct cui_event *ev = &g_ev[i];
    if (!ev->live || !ev->opened || ev->real) continue;
    set_ctx(ev->ctx);
    struct cui_ipc_event_handle h;
    memset(&h, 0, sizeof h);
    h.creator_pid = ev->creator_pid;
    memcpy(h.event_id, ev->id, 16);
    h.secret = cui_secret_of(ev->id, ev->creator_pid);
    char why[256] = "";
    int32_t status = -1;
    CUevent d = NULL;
    CUresult r = open_real(&h, &d, &status, why, sizeof why);
    if (r != CUDA_SUCCESS && status == CUI_NOT_FOUND) {
      /* the creator destroyed it before the capture: a completed local event stands in */
      r = REAL(cuEventCreate)(&d, CU_EVENT_DISABLE_TIMING);
      if (r == CUDA_SUCCESS) ev->standin = 1;
    }
    if (r != CUDA_SUCCESS) {
      ev_fail(msg, cap, "RESTORE_UNICAST", ev, why[0] ? why : "cuIpcOpenEventHandle", r);
      return -1;
    }
    pthread_mutex_lock(&g_ev_lock);
    ev->real = d;
    pthread_mutex_unlock(&g_ev_lock);
    (*changed)++;
  }
  return 0;
}

void cui_events_inspect(int32_t *status, char *msg, size_t cap, uint32_t *live, uint32_t *opened) {
  pthread_mutex_lock(&g_ev_lock);
  *live = g_ev_live;
  *opened = 0;
  for (uint32_t i = 0; i < g_ev_n; i++) *opened += g_ev[i].live && g_ev[i].opened;
  if ((g_nevf || g_evf_lost) && *status == CUI_OK) {
    unsigned pid = (unsigned)getpid();
    *status = CUI_REFUSED_STATE;
    if (!g_nevf) {
      snprintf(msg, cap,
               "INSPECT: pid %u used more than %d driver CUDA IPC event handles (not the shim's); native "
               "checkpoint cannot carry IPC events: destroy them, or run their creators under the shim",
               pid, EV_FOREIGN_MAX);
    } else {
      const uint8_t *b = g_evf[0].head;
      snprintf(msg, cap,
               "INSPECT: pid %u %s a driver CUDA IPC event handle %02x%02x%02x%02x%02x%02x%02x%02x... (event %p%s; "
               "not a cuinterpose handle: %s); native checkpoint cannot carry IPC events: destroy the event, or run "
               "%s under the shim",
               pid, g_evf[0].import ? "opened" : "exported", b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7],
               (void *)g_evf[0].ev, g_nevf + g_evf_lost > 1 ? ", and more" : "",
               g_evf[0].import ? "its creator does not run under the shim" : "the event was not created under the shim",
               g_evf[0].import ? "its creator" : "this process");
    }
  }
  pthread_mutex_unlock(&g_ev_lock);
}
