/*
 * util.h: the lowest layer of libcuinterpose (docs/shim.md "Files and layers"): helpers that
 * know nothing of the driver or the shim's state. util.c (ids, clocks, warnings, paths, names
 * from protocol.h, socket I/O, the hash table) and checksum.c (cui_checksum64).
 * Everything here has hidden visibility; only the hooked names are exported (hooks.def,
 * libcuinterpose.map).
 */
#ifndef CUI_UTIL_H
#define CUI_UTIL_H

#include <cuda.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "cuinterpose/protocol.h"

#define CUI_EXPORT __attribute__((visibility("default")))
#define CUI_HIDDEN __attribute__((visibility("hidden")))

/* ---------- util.c ---------- */

CUI_HIDDEN const char *cui_cu_error_fallback(CUresult r);   /* "CUDA_ERROR_INVALID_VALUE" */
CUI_HIDDEN void cui_random_id(uint8_t id[16]);
CUI_HIDDEN void cui_hex_id(const uint8_t id[16], char out[33]);
CUI_HIDDEN uint64_t cui_now_ns(void);                   /* CLOCK_MONOTONIC, ns */
/* "cuinterpose[<pid>]: <api>: pid <pid> (phase <P>): <message>" as one write to stderr
 * (cui_api_warn in state.h passes the current phase). */
CUI_HIDDEN void cui_api_warn_in(uint32_t phase, const char *api, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* The control directory ($CUINTERPOSE_CONTROL_DIR or CUI_DEFAULT_CONTROL_DIR) and the socket
 * path of `pid` in it. Returns -1 when the path does not fit sockaddr_un.sun_path. */
CUI_HIDDEN const char *cui_control_dir(void);
CUI_HIDDEN int cui_socket_path(uint32_t pid, char *out, size_t cap);
/* <control dir>/cuinterpose-<pid>.claim (protocol.h "Claims"); -1 when it does not fit `cap`. */
CUI_HIDDEN int cui_claim_path(uint32_t pid, char *out, size_t cap);
/* Names from protocol.h: "ACTIVE", "SAVE_ALLOCATIONS" (CUI_OPS); "UNKNOWN" otherwise. */
CUI_HIDDEN const char *cui_phase_name(uint32_t phase);
CUI_HIDDEN const char *cui_op_name(uint32_t op);

/* Stream socket I/O of the control protocol: whole buffers (EINTR retried), and the
 * CUI_IO_TIMEOUT_S send/receive timeout. read/write return 0, or -1 (error or EOF). */
#define CUI_IO_TIMEOUT_S 10
CUI_HIDDEN void cui_set_io_timeouts(int fd);
CUI_HIDDEN int cui_read_full(int fd, void *buf, size_t n);
CUI_HIDDEN int cui_write_full(int fd, const void *buf, size_t n);

/* Small open-addressing hash table, linear probing, backward-shift deletion, grown at half
 * load. Keys are three words: an allocation id (a, b = its two halves, c = creator pid), or a
 * VA (a = va, b = c = 0). Values are 32 bits. The caller provides the locking. */
struct cui_key {
  uint64_t a, b;
  uint32_t c;
};
struct cui_tab {
  struct cui_tslot {
    struct cui_key k;
    uint32_t val;
    uint32_t used;
  } *s;
  uint32_t cap, n;
};
CUI_HIDDEN struct cui_key cui_id_key(const uint8_t id[16], uint32_t pid);
CUI_HIDDEN uint32_t *cui_tab_get(const struct cui_tab *t, struct cui_key k);   /* value or NULL */
CUI_HIDDEN int cui_tab_put(struct cui_tab *t, struct cui_key k, uint32_t val); /* 0, -1 out of memory */
CUI_HIDDEN void cui_tab_del(struct cui_tab *t, struct cui_key k);

/* ---------- checksum.c ---------- */

CUI_HIDDEN uint64_t cui_checksum64(const void *data, size_t length);

/* ---------- blake2b.c ---------- */

/* A chunk checksum: the 32-byte digest of `length` bytes (protocol.h "Carriers"). */
typedef void (*cui_digest_fn)(const void *data, size_t length, uint8_t out[CUI_DIGEST_BYTES]);

/* BLAKE2b-256 of `length` bytes, no key (RFC 7693): the chunk checksum unless the request sets
 * CUI_CARRY_SHA256. */
CUI_HIDDEN void cui_blake2b_256(const void *data, size_t length, uint8_t out[CUI_DIGEST_BYTES]);

/* ---------- sha256.c ---------- */

/* SHA-256 of `length` bytes (FIPS 180-4), with the x86-64 SHA extensions where the CPU has them
 * (cui_sha256_accelerated() == 1), else portable (cui_sha256_portable, also for the tests). */
CUI_HIDDEN void cui_sha256(const void *data, size_t length, uint8_t out[CUI_DIGEST_BYTES]);
CUI_HIDDEN void cui_sha256_portable(const void *data, size_t length, uint8_t out[CUI_DIGEST_BYTES]);
CUI_HIDDEN int cui_sha256_accelerated(void);

/* ---------- chunkio.c ---------- */

/* One chunk file (protocol.h "Carriers"): `fd`, `bytes`, and its `nchunks` digests (SAVE:
 * filled by the writers, all-zero for a zero chunk; LOAD: the expected ones). */
struct cui_cio_stream {
  int fd;
  uint64_t bytes;
  uint32_t nchunks;
  uint8_t (*digests)[CUI_DIGEST_BYTES];
};

enum cui_cio_err { CUI_CIO_OK = 0, CUI_CIO_WRITE, CUI_CIO_READ, CUI_CIO_SHORT, CUI_CIO_CHECKSUM };

/* The staging ring and its threads. Writers (SAVE): the caller fills a slot (cui_cio_slot) and
 * submits it; a writer tests it for zeros, hashes and pwrites it, frees the slot. Readers
 * (LOAD): the caller queues every non-zero chunk (cui_cio_queue_read), readers pread each into
 * a free slot and verify its digest; the caller takes verified slots (cui_cio_next_ready),
 * uses them and frees them (cui_cio_release). The first error stops every thread. */
struct cui_cio;
struct cui_cio_error {
  enum cui_cio_err kind;
  int err;                          /* errno (WRITE, READ) */
  struct cui_cio_stream *stream;
  uint32_t chunk;
  uint8_t found[CUI_DIGEST_BYTES];  /* CHECKSUM: the digest of the bytes read */
};
/* Allocates the ring (staging_bytes / chunk_bytes slots, at least one) and starts `threads`
 * threads (writers when !reading) that hash each chunk with `digest`. Returns NULL on out of memory or a thread that
 * cannot start (errno set). */
CUI_HIDDEN struct cui_cio *cui_cio_start(size_t chunk_bytes, size_t staging_bytes, unsigned threads, int reading,
                                         cui_digest_fn digest);
CUI_HIDDEN void *cui_cio_ring(struct cui_cio *io, size_t *bytes);
/* SAVE: a free slot to fill (blocks until one is free), -1 once an error stopped the ring. */
CUI_HIDDEN int cui_cio_slot(struct cui_cio *io, unsigned char **buf);
CUI_HIDDEN void cui_cio_submit(struct cui_cio *io, int slot, struct cui_cio_stream *s, uint32_t chunk, size_t len);
/* LOAD: queue a read of chunk `chunk` of `s` (`len` bytes at offset `off` of `fd`: its own
 * file at chunk * chunk_bytes, or a source of the chunk store); cui_cio_next_ready blocks for a
 * verified chunk and returns its slot (buffer, stream, chunk, len), or -1 when all queued
 * reads were taken or an error stopped the ring. */
CUI_HIDDEN int cui_cio_queue_read(struct cui_cio *io, struct cui_cio_stream *s, uint32_t chunk, size_t len, int fd,
                                  uint64_t off);
/* SAVE: chunks whose digest is among these `n` (ascending, memcmp order; kept by the caller
 * until cui_cio_finish) are hashed but not written (protocol.h "Chunk store"). */
CUI_HIDDEN void cui_cio_set_known(struct cui_cio *io, const uint8_t (*known)[CUI_DIGEST_BYTES], size_t n);
CUI_HIDDEN int cui_cio_next_ready(struct cui_cio *io, unsigned char **buf, struct cui_cio_stream **s, uint32_t *chunk,
                                  size_t *len);
/* LOAD: the same without waiting, and only when the verified chunk at the head of the queue
 * belongs to a stream before `below` (an element of the caller's stream array): -1 otherwise
 * (none verified yet, a later stream's, or the ring stopped). With `below` NULL: next_ready. */
CUI_HIDDEN int cui_cio_take_ready(struct cui_cio *io, const struct cui_cio_stream *below, unsigned char **buf,
                                  struct cui_cio_stream **s, uint32_t *chunk, size_t *len);
CUI_HIDDEN void cui_cio_release(struct cui_cio *io, int slot);
/* Stops the ring because the caller failed (its own error is reported by the caller). */
CUI_HIDDEN void cui_cio_abort(struct cui_cio *io);
/* SAVE: switches the regular file `fd` to O_DIRECT until cui_cio_finish (before its chunks
 * are submitted). Returns 1 when its writes go direct, 0 when it stays buffered (not a regular
 * file, it refused the flag, or out of memory). */
CUI_HIDDEN int cui_cio_direct(struct cui_cio *io, int fd);
/* What a SAVE moved, in bytes: `written` to the files, `reused` (known chunks not written),
 * `direct` (of `written`, with O_DIRECT). */
struct cui_cio_counts { uint64_t written, reused, direct; };
/* Waits for every submitted chunk, joins the threads, puts back the flags of the descriptors
 * cui_cio_direct switched, frees the ring; returns the first error's kind (details in *e) and
 * the counts (either may be NULL). */
CUI_HIDDEN enum cui_cio_err cui_cio_finish(struct cui_cio *io, struct cui_cio_error *e, struct cui_cio_counts *counts);

#endif
