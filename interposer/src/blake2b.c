/*
 * blake2b.c: BLAKE2b with a 32-byte digest and no key (RFC 7693, sections 2.1-3.3; util layer),
 * the chunk checksum of protocol.h "Carriers". One-shot: the chunk is whole in its staging slot.
 * Tested byte-for-byte against Python's hashlib.blake2b(data, digest_size=32) by
 * tests/shim/test_chunkio.py (lengths 0, 1, 127, 128, 129, ... and chunk sizes).
 */
#include <string.h>

#include "util.h"

/* RFC 7693 section 2.6: the IV (the SHA-512 IV, FIPS 180-4 section 5.3.5). */
static const uint64_t k_iv[8] = {0x6a09e667f3bcc908ull, 0xbb67ae8584caa73bull, 0x3c6ef372fe94f82bull,
                                 0xa54ff53a5f1d36f1ull, 0x510e527fade682d1ull, 0x9b05688c2b3e6c1full,
                                 0x1f83d9abfb41bd6bull, 0x5be0cd19137e2179ull};

/* RFC 7693 section 2.7: the message schedule SIGMA (rounds 10 and 11 repeat rows 0 and 1). */
static const uint8_t k_sigma[12][16] = {
  {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
  {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
  {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
  {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
  {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
  {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t rotr64(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64(const unsigned char *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  uint64_t v;   /* little-endian words (section 2.4): a plain load on a little-endian CPU */
  memcpy(&v, p, sizeof v);
  return v;
#else
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
#endif
}

/* Section 3.1: the mixing function G. */
#define G(a, b, c, d, x, y)         \
  do {                              \
    v[a] = v[a] + v[b] + (x);       \
    v[d] = rotr64(v[d] ^ v[a], 32); \
    v[c] = v[c] + v[d];             \
    v[b] = rotr64(v[b] ^ v[c], 24); \
    v[a] = v[a] + v[b] + (y);       \
    v[d] = rotr64(v[d] ^ v[a], 16); \
    v[c] = v[c] + v[d];             \
    v[b] = rotr64(v[b] ^ v[c], 63); \
  } while (0)

/* Section 3.2: the compression function F; `t` the byte counter (< 2^64 here), `last` the
 * final-block flag. */
static void compress(uint64_t h[8], const unsigned char block[128], uint64_t t, int last) {
  uint64_t m[16], v[16];
  for (int i = 0; i < 16; i++) m[i] = load64(block + 8 * i);
  for (int i = 0; i < 8; i++) v[i] = h[i], v[i + 8] = k_iv[i];
  v[12] ^= t;   /* the high word of the 128-bit counter stays 0 */
  if (last) v[14] = ~v[14];
  /* each round written out with a constant r, so that SIGMA folds into the indices and v[]
   * stays in registers (a loop over r reads SIGMA at run time: about 3x slower) */
#define ROUND(r)                                           \
  do {                                                     \
    G(0, 4, 8, 12, m[k_sigma[r][0]], m[k_sigma[r][1]]);    \
    G(1, 5, 9, 13, m[k_sigma[r][2]], m[k_sigma[r][3]]);    \
    G(2, 6, 10, 14, m[k_sigma[r][4]], m[k_sigma[r][5]]);   \
    G(3, 7, 11, 15, m[k_sigma[r][6]], m[k_sigma[r][7]]);   \
    G(0, 5, 10, 15, m[k_sigma[r][8]], m[k_sigma[r][9]]);   \
    G(1, 6, 11, 12, m[k_sigma[r][10]], m[k_sigma[r][11]]); \
    G(2, 7, 8, 13, m[k_sigma[r][12]], m[k_sigma[r][13]]);  \
    G(3, 4, 9, 14, m[k_sigma[r][14]], m[k_sigma[r][15]]);  \
  } while (0)
  ROUND(0);
  ROUND(1);
  ROUND(2);
  ROUND(3);
  ROUND(4);
  ROUND(5);
  ROUND(6);
  ROUND(7);
  ROUND(8);
  ROUND(9);
  ROUND(10);
  ROUND(11);
#undef ROUND
  for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* Section 3.3 with kk = 0 (no key), nn = 32. */
void cui_blake2b_256(const void *data, size_t length, uint8_t out[CUI_DIGEST_BYTES]) {
  uint64_t h[8];
  memcpy(h, k_iv, sizeof h);
  h[0] ^= 0x01010000ull ^ CUI_DIGEST_BYTES;
  const unsigned char *p = data;
  size_t left = length;
  uint64_t t = 0;
  while (left > 128) {
    t += 128;
    compress(h, p, t, 0);
    p += 128;
    left -= 128;
  }
  unsigned char last[128] = {0};   /* the final block, zero-padded (an empty message: one block) */
  if (left) memcpy(last, p, left);
  compress(h, last, t + left, 1);
  for (unsigned i = 0; i < CUI_DIGEST_BYTES; i++) out[i] = (uint8_t)(h[i / 8] >> (8 * (i % 8)));
}
