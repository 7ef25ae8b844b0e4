/* Probe of interposer/src/blake2b.c, sha256.c and chunkio.c (tests/shim/test_chunkio.py), built
 * with and without ASan/UBSan:
 *   chunkio_probe hash FILE...                 BLAKE2b-256 of each file, 64 hex per line
 *   chunkio_probe sha256 FILE...               SHA-256 (accelerated where the CPU allows)
 *   chunkio_probe sha256-portable FILE...      SHA-256, portable compression
 *   chunkio_probe accelerated                  "1" when cui_sha256 uses the SHA extensions
 * write and read hash with BLAKE2b-256, or SHA-256 when $PROBE_SHA256 is set.
 *   chunkio_probe write OUT CHUNK STAGING N [direct]
 *                                              stdin -> OUT through the writers (N threads;
 *                                               "direct": OUT given to cui_cio_direct): one line
 *                                               per chunk (64 hex, or "zero"), then "written
 *                                               <bytes> direct <bytes> flags <same|changed>"
 *                                               (OUT's F_GETFL after cui_cio_finish against
 *                                               before), or "error <kind> <chunk> <errno>"
 *   chunkio_probe read IN CHUNK STAGING N      IN through the readers, verified against the
 *                                               digests on stdin (the write mode's lines): the
 *                                               bytes on stdout (zero chunks as zeros), or
 *                                               "error <kind> <chunk> <errno> <found hex>" on stderr */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>

#include "util.h"

static unsigned char *slurp(FILE *f, size_t *n) {
  size_t cap = 1 << 16, len = 0;
  unsigned char *b = malloc(cap);
  size_t k;
  while ((k = fread(b + len, 1, cap - len, f)) > 0) {
    len += k;
    if (len == cap) b = realloc(b, cap *= 2);
  }
  *n = len;
  return b;
}

static void hex(const uint8_t *d) {
  for (int i = 0; i < 32; i++) printf("%02x", d[i]);
}

int main(int argc, char **argv) {
  if (argc == 2 && !strcmp(argv[1], "accelerated")) {
    printf("%d\n", cui_sha256_accelerated());
    return 0;
  }
  cui_digest_fn fn = argc >= 2 && !strcmp(argv[1], "hash")              ? cui_blake2b_256
                     : argc >= 2 && !strcmp(argv[1], "sha256")          ? cui_sha256
                     : argc >= 2 && !strcmp(argv[1], "sha256-portable") ? cui_sha256_portable
                                                                        : NULL;
  if (fn) {
    for (int i = 2; i < argc; i++) {
      FILE *f = fopen(argv[i], "rb");
      size_t n;
      unsigned char *b = slurp(f, &n);
      fclose(f);
      uint8_t d[32];
      fn(b, n, d);
      hex(d);
      printf("\n");
      free(b);
    }
    return 0;
  }
  if (argc != 6 && argc != 7) return 2;
  size_t cb = strtoull(argv[3], NULL, 0), staging = strtoull(argv[4], NULL, 0);
  unsigned threads = (unsigned)atoi(argv[5]);
  int reading = !strcmp(argv[1], "read");
  struct cui_cio_stream s;
  memset(&s, 0, sizeof s);
  size_t n = 0;
  unsigned char *data = NULL;
  if (!reading) {
    data = slurp(stdin, &n);
    s.fd = open(argv[2], O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (s.fd < 0) return 3;
    if (ftruncate(s.fd, (off_t)n) != 0 && strncmp(argv[2], "/dev/", 5)) return 3;
  } else {
    s.fd = open(argv[2], O_RDONLY);
    if (s.fd < 0) return 3;
    n = (size_t)lseek(s.fd, 0, SEEK_END);
  }
  s.bytes = n;
  s.nchunks = (uint32_t)((n + cb - 1) / cb);
  s.digests = calloc(s.nchunks ? s.nchunks : 1, 32);
  if (reading) {
    char line[80];
    for (uint32_t i = 0; i < s.nchunks && fgets(line, sizeof line, stdin); i++)
      if (strncmp(line, "zero", 4))
        for (int k = 0; k < 32; k++) sscanf(line + 2 * k, "%2hhx", &s.digests[i][k]);
  }
  struct cui_cio *io = cui_cio_start(cb, staging, threads, reading,
                                     getenv("PROBE_SHA256") ? cui_sha256 : cui_blake2b_256);
  if (!io) return 4;
  struct cui_cio_error e;
  struct cui_cio_counts counts = {0};
  int flags = fcntl(s.fd, F_GETFL);
  if (!reading && argc == 7 && !strcmp(argv[6], "direct")) (void)cui_cio_direct(io, s.fd);
  if (!reading) {
    for (uint32_t i = 0; i < s.nchunks; i++) {
      unsigned char *buf;
      int slot = cui_cio_slot(io, &buf);
      if (slot < 0) break;
      size_t len = n - (size_t)i * cb < cb ? n - (size_t)i * cb : cb;
      memcpy(buf, data + (size_t)i * cb, len);
      cui_cio_submit(io, slot, &s, i, len);
    }
    if (cui_cio_finish(io, &e, &counts) != CUI_CIO_OK) {
      printf("error %d %u %d\n", (int)e.kind, e.chunk, e.err);
      free(data), free(s.digests), close(s.fd);
      return 1;
    }
    for (uint32_t i = 0; i < s.nchunks; i++) {
      static const uint8_t z[32];
      if (!memcmp(s.digests[i], z, 32)) printf("zero\n");
      else hex(s.digests[i]), printf("\n");
    }
    printf("written %llu direct %llu flags %s\n", (unsigned long long)counts.written, (unsigned long long)counts.direct,
           fcntl(s.fd, F_GETFL) == flags ? "same" : "changed");
    free(data), free(s.digests), close(s.fd);
    return 0;
  }
  unsigned char *out = calloc(n ? n : 1, 1);
  static const uint8_t z[32];
  for (uint32_t i = 0; i < s.nchunks; i++) {
    size_t len = n - (size_t)i * cb < cb ? n - (size_t)i * cb : cb;
    if (memcmp(s.digests[i], z, 32)) cui_cio_queue_read(io, &s, i, len, s.fd, (uint64_t)i * cb);
  }
  unsigned char *buf;
  struct cui_cio_stream *got;
  uint32_t chunk;
  size_t len;
  int slot;
  while ((slot = cui_cio_next_ready(io, &buf, &got, &chunk, &len)) >= 0) {
    memcpy(out + (size_t)chunk * cb, buf, len);
    cui_cio_release(io, slot);
  }
  if (cui_cio_finish(io, &e, NULL) != CUI_CIO_OK) {
    fprintf(stderr, "error %d %u %d ", (int)e.kind, e.chunk, e.err);
    for (int k = 0; k < 32; k++) fprintf(stderr, "%02x", e.found[k]);
    fprintf(stderr, "\n");
    free(out), free(s.digests), close(s.fd);
    return 1;
  }
  fwrite(out, 1, n, stdout);
  free(out), free(s.digests), close(s.fd);
  return 0;
}
