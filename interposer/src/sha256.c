/*
 * sha256.c: SHA-256 (FIPS 180-4 sections 4.1.2, 4.2.2, 5.1.1, 5.3.3, 6.2; util layer), the chunk
 * checksum a request selects with CUI_CARRY_SHA256 (protocol.h "Carriers"; decisions D36).
 * One-shot: the chunk is whole in its staging slot. Two compressions of the same function:
 * the x86-64 SHA extensions (SHA-NI: SHA256RNDS2, SHA256MSG1, SHA256MSG2; Intel SDM vol. 2,
 * "Intel SHA Extensions"), chosen at the first call when CPUID leaf 7 reports SHA (EBX bit 29)
 * and leaf 1 SSSE3 and SSE4.1 (ECX bits 9 and 19); and portable C everywhere else.
 * Tested byte for byte against Python's hashlib.sha256, both compressions, by
 * tests/shim/test_chunkio.py (lengths around the block and padding edges, chunk sizes).
 */
#include <string.h>

#include "util.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

/* FIPS 180-4 section 4.2.2: the round constants. */
static const uint32_t k_k[64] = {
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
  0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
  0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
  0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
  0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

/* FIPS 180-4 section 5.3.3: the initial hash value. */
static const uint32_t k_h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

static inline uint32_t rotr32(uint32_t x, unsigned n) { return (x >> n) | (x << (32 - n)); }

static inline uint32_t load_be32(const unsigned char *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

/* Section 6.2.2 on `n` 64-byte blocks, portable. */
static void compress_portable(uint32_t h[8], const unsigned char *p, size_t n) {
  for (; n; n--, p += 64) {
    uint32_t w[64];
    for (int t = 0; t < 16; t++) w[t] = load_be32(p + 4 * t);
    for (int t = 16; t < 64; t++) {
      uint32_t s0 = rotr32(w[t - 15], 7) ^ rotr32(w[t - 15], 18) ^ (w[t - 15] >> 3);
      uint32_t s1 = rotr32(w[t - 2], 17) ^ rotr32(w[t - 2], 19) ^ (w[t - 2] >> 10);
      w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int t = 0; t < 64; t++) {
      uint32_t t1 = hh + (rotr32(e, 6) ^ rotr32(e, 11) ^ rotr32(e, 25)) + ((e & f) ^ (~e & g)) + k_k[t] + w[t];
      uint32_t t2 = (rotr32(a, 2) ^ rotr32(a, 13) ^ rotr32(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      hh = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += hh;
  }
}

#if defined(__x86_64__)
/* The same with the SHA extensions. The state lives in two registers, ABEF and CDGH (the
 * operand layout of SHA256RNDS2); each SHA256RNDS2 does two rounds with the two low words of
 * its third operand (W[t] + K[t]); the message schedule of four words is SHA256MSG1 (the
 * sigma0 terms), the add of W[t-7..t-4], then SHA256MSG2 (the sigma1 terms). */
__attribute__((target("sha,sse4.1,ssse3"))) static void compress_shani(uint32_t h[8], const unsigned char *p,
                                                                       size_t n) {
  const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
  __m128i dcba = _mm_loadu_si128((const __m128i *)&h[0]);
  __m128i hgfe = _mm_loadu_si128((const __m128i *)&h[4]);
  __m128i badc = _mm_shuffle_epi32(dcba, 0xB1);
  __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);
  __m128i abef = _mm_alignr_epi8(badc, efgh, 8);
  __m128i cdgh = _mm_blend_epi16(efgh, badc, 0xF0);
  for (; n; n--, p += 64) {
    __m128i abef0 = abef, cdgh0 = cdgh, m[4];
    for (int g = 0; g < 16; g++) {   /* rounds 4g .. 4g+3; m[g & 3] holds W[4g-16 ..] until replaced */
      if (g < 4) {
        m[g] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * g)), bswap);
      } else {
        __m128i t = _mm_sha256msg1_epu32(m[g & 3], m[(g + 1) & 3]);
        t = _mm_add_epi32(t, _mm_alignr_epi8(m[(g + 3) & 3], m[(g + 2) & 3], 4));
        m[g & 3] = _mm_sha256msg2_epu32(t, m[(g + 3) & 3]);
      }
      __m128i wk = _mm_add_epi32(m[g & 3], _mm_loadu_si128((const __m128i *)&k_k[4 * g]));
      cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);
      abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(wk, 0x0E));
    }
    abef = _mm_add_epi32(abef, abef0);
    cdgh = _mm_add_epi32(cdgh, cdgh0);
  }
  __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
  __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
  _mm_storeu_si128((__m128i *)&h[0], _mm_blend_epi16(feba, dchg, 0xF0));
  _mm_storeu_si128((__m128i *)&h[4], _mm_alignr_epi8(dchg, feba, 8));
}

static int have_shani(void) {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 9)) || !(c & (1u << 19))) return 0;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 29));
}
#endif

typedef void (*compress_fn)(uint32_t h[8], const unsigned char *p, size_t n);

/* Sections 5.1.1 (padding) and 6.2 around `compress`. */
static void sha256_with(compress_fn compress, const void *data, size_t length, uint8_t out[CUI_DIGEST_BYTES]) {
  uint32_t h[8];
  memcpy(h, k_h0, sizeof h);
  const unsigned char *p = data;
  size_t full = length / 64, rest = length % 64;
  if (full) compress(h, p, full);
  unsigned char tail[128] = {0};
  memcpy(tail, p + full * 64, rest);
  tail[rest] = 0x80;
  size_t tl = rest < 56 ? 64 : 128;
  uint64_t bits = (uint64_t)length * 8;
  for (int i = 0; i < 8; i++) tail[tl - 1 - i] = (unsigned char)(bits >> (8 * i));
  compress(h, tail, tl / 64);
  for (int i = 0; i < 8; i++) {
    out[4 * i] = (uint8_t)(h[i] >> 24);
    out[4 * i + 1] = (uint8_t)(h[i] >> 16);
    out[4 * i + 2] = (uint8_t)(h[i] >> 8);
    out[4 * i + 3] = (uint8_t)h[i];
  }
}

int cui_sha256_accelerated(void) {
#if defined(__x86_64__)
  static int known = -1;   /* CPUID does not change: a race computes the same value twice */
  int v = __atomic_load_n(&known, __ATOMIC_RELAXED);
  if (v < 0) {
    v = have_shani();
    __atomic_store_n(&known, v, __ATOMIC_RELAXED);
  }
  return v;
#else
  return 0;
#endif
}

void cui_sha256(const void *data, size_t length, uint8_t out[CUI_DIGEST_BYTES]) {
#if defined(__x86_64__)
  if (cui_sha256_accelerated()) {
    sha256_with(compress_shani, data, length, out);
    return;
  }
#endif
  sha256_with(compress_portable, data, length, out);
}

void cui_sha256_portable(const void *data, size_t length, uint8_t out[CUI_DIGEST_BYTES]) {
  sha256_with(compress_portable, data, length, out);
}
