/*
 * ops_copies.c: the copies between the device and the staging ring of SAVE_ALLOCATIONS and
 * LOAD_ALLOCATIONS (phase-op layer; docs/shim.md "Chunk files"), pipelined. Each chunk copy
 * goes out on one of `lanes` streams (cuMemcpyDtoHAsync_v2 / cuMemcpyHtoDAsync_v2, driver API
 * "Memory Management"), so that several chunks are in flight at once and the copy engines, the
 * I/O threads and their checksums work at the same time; one copy waited for at a time, alone,
 * ran at 0.26x a pinned cuMemcpy on an H200 (docs/gpu-validation.md). A lane holds one copy: the
 * op waits for it (cuStreamSynchronize) only when it reuses the lane, and then hands the
 * finished copy's ring slot on through the `done` callback (SAVE: to the writers; LOAD: back to
 * the readers). Lanes are taken in turn, so the wait is for the oldest copy. A lane keeps one
 * stream per context it copied in (CU_STREAM_NON_BLOCKING; the caller makes the allocation's
 * device's context current: cui_ensure_context); cui_copies_finish waits for every lane and
 * destroys the streams. With 0 lanes each copy is waited for at once (a ring of one slot has no
 * slot to spare for a copy in flight). Runs on the control worker only.
 */
#define _GNU_SOURCE
#include <stdlib.h>

#include "phase_ops.h"

struct cui_copy_lane {
  struct {
    CUcontext ctx;
    CUstream st;
  } by_ctx[CUI_MC_MAX_DEVICES];   /* one stream per context it copied in, made on first use */
  unsigned nctx;
  CUstream busy;                  /* the stream of the copy in flight, or NULL */
  struct cui_copy c;
};

struct cui_copies {
  unsigned lanes, next;
  cui_copy_done_fn done;
  void *ctx;
  uint64_t ns;   /* time spent issuing copies and waiting for them */
  struct cui_copy_lane lane[];
};

struct cui_copies *cui_copies_start(unsigned lanes, cui_copy_done_fn done, void *ctx) {
  if (lanes > CUI_COPY_LANES_MAX) lanes = CUI_COPY_LANES_MAX;
  unsigned n = lanes ? lanes : 1;
  struct cui_copies *p = calloc(1, sizeof *p + n * sizeof p->lane[0]);
  if (!p) return NULL;
  p->lanes = lanes;
  p->done = done;
  p->ctx = ctx;
  return p;
}

/* Waits for lane `l`'s copy and hands its slot on; the copy's CUresult. */
static CUresult settle(struct cui_copies *p, struct cui_copy_lane *l) {
  if (!l->busy) return CUDA_SUCCESS;
  CUresult r = REAL(cuStreamSynchronize)(l->busy);
  l->busy = NULL;
  p->done(p->ctx, &l->c, r);
  return r;
}

/* Lane `l`'s stream of the current context (a stream belongs to the context it was made in),
 * made on first use. */
static CUresult lane_stream(struct cui_copy_lane *l, CUstream *st, const char **what) {
  CUcontext ctx = NULL;
  CUresult r = REAL(cuCtxGetCurrent)(&ctx);
  if (r != CUDA_SUCCESS || !ctx) {
    *what = "cuCtxGetCurrent (a copy stream needs a current context)";
    return r != CUDA_SUCCESS ? r : CUDA_ERROR_INVALID_CONTEXT;
  }
  for (unsigned k = 0; k < l->nctx; k++)
    if (l->by_ctx[k].ctx == ctx) return *st = l->by_ctx[k].st, CUDA_SUCCESS;
  if (l->nctx == CUI_MC_MAX_DEVICES) {
    *what = "a copy stream (more contexts than devices)";
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  r = REAL(cuStreamCreate)(st, CU_STREAM_NON_BLOCKING);
  if (r != CUDA_SUCCESS) {
    *what = "cuStreamCreate";
    return r;
  }
  l->by_ctx[l->nctx].ctx = ctx;
  l->by_ctx[l->nctx++].st = *st;
  return CUDA_SUCCESS;
}

CUresult cui_copies_put(struct cui_copies *p, int to_device, CUdeviceptr dptr, void *host, const struct cui_copy *c,
                        const char **what) {
  uint64_t t0 = cui_now_ns();
  struct cui_copy_lane *l = &p->lane[p->lanes ? p->next : 0];
  if (p->lanes) p->next = (p->next + 1) % p->lanes;
  CUstream st = NULL;
  CUresult r = settle(p, l);   /* a wait only where the lane is reused */
  if (r != CUDA_SUCCESS) *what = "cuStreamSynchronize";
  if (r == CUDA_SUCCESS) r = lane_stream(l, &st, what);
  if (r == CUDA_SUCCESS) {
    r = to_device ? REAL(cuMemcpyHtoDAsync_v2)(dptr, host, c->len, st)
                  : REAL(cuMemcpyDtoHAsync_v2)(host, dptr, c->len, st);
    if (r != CUDA_SUCCESS) *what = to_device ? "cuMemcpyHtoDAsync_v2" : "cuMemcpyDtoHAsync_v2";
  }
  if (r != CUDA_SUCCESS) {
    p->done(p->ctx, c, r);   /* not issued: its slot goes on at once */
  } else {
    l->busy = st, l->c = *c;
    if (!p->lanes && (r = settle(p, l)) != CUDA_SUCCESS) *what = "cuStreamSynchronize";
  }
  p->ns += cui_now_ns() - t0;
  return r;
}

CUresult cui_copies_drain(struct cui_copies *p, const char **what) {
  if (!p) return CUDA_SUCCESS;
  uint64_t t0 = cui_now_ns();
  CUresult first = CUDA_SUCCESS;
  unsigned n = p->lanes ? p->lanes : 1;
  for (unsigned k = 0; k < n; k++) {   /* oldest first: the lane after the last one used */
    CUresult r = settle(p, &p->lane[(p->next + k) % n]);
    if (r != CUDA_SUCCESS && first == CUDA_SUCCESS) first = r, *what = "cuStreamSynchronize";
  }
  p->ns += cui_now_ns() - t0;
  return first;
}

CUresult cui_copies_finish(struct cui_copies *p, uint64_t *ns, const char **what) {
  if (!p) return CUDA_SUCCESS;
  CUresult first = cui_copies_drain(p, what);
  unsigned n = p->lanes ? p->lanes : 1;
  for (unsigned k = 0; k < n; k++)
    for (unsigned j = 0; j < p->lane[k].nctx; j++) REAL(cuStreamDestroy_v2)(p->lane[k].by_ctx[j].st);
  if (ns) *ns += p->ns;
  free(p);
  return first;
}
