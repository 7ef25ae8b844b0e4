/* checksum.c: cui_checksum64 (util layer), exactly as specified in protocol.h (the carrier checksum). */
#include <string.h>

#include "util.h"

static inline uint64_t rotl64(uint64_t x, unsigned r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t load_le64(const unsigned char *p) {
  uint64_t w = 0;
  for (int i = 7; i >= 0; i--) w = (w << 8) | p[i];
  return w;
}

uint64_t cui_checksum64(const void *data, size_t length) {
  const unsigned char *p = data;
  uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)length;
  size_t full = length / 8;
  for (size_t i = 0; i < full; i++) {
    uint64_t w;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(&w, p + i * 8, 8);
#else
    w = load_le64(p + i * 8);
#endif
    h = rotl64(h ^ (w * 0xC2B2AE3D27D4EB4FULL), 31) * 0x9E3779B97F4A7C15ULL;
  }
  size_t rest = length % 8;
  if (rest) {
    unsigned char tail[8] = {0};
    memcpy(tail, p + full * 8, rest);
    uint64_t w = load_le64(tail);
    h = rotl64(h ^ (w * 0xC2B2AE3D27D4EB4FULL), 31) * 0x9E3779B97F4A7C15ULL;
  }
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDULL;
  h ^= h >> 33;
  return h;
}
