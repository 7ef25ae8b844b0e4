/* Prints cui_checksum64 (interposer/src/checksum.c) of each file named on the command line,
 * one 16-digit hex value per line. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

uint64_t cui_checksum64(const void *data, size_t length);

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    FILE *f = fopen(argv[i], "rb");
    if (!f) return 2;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc(n ? (size_t)n : 1);
    if (n && fread(b, 1, (size_t)n, f) != (size_t)n) return 2;
    fclose(f);
    printf("%016llx\n", (unsigned long long)cui_checksum64(b, (size_t)n));
    free(b);
  }
  return 0;
}
