/*
 * A scripted legacy-IPC application for the IPC adapter tests (docs/shim.md "IPC adapter"):
 * cudaMalloc-style cuMemAlloc_v2 memory shared through cuIpcGetMemHandle / cuIpcOpenMemHandle.
 * Linked against libcuda.so.1 (fakecuda); the IPC and pointer-attribute functions are taken
 * with dlsym(RTLD_DEFAULT) (fakecuda may not export them; under the shim they are its wrappers),
 * the rest binds by ELF name. One command per line on stdin, one line on stdout:
 *   "ok [values...]"  or  "err <CUresult> <name>".
 *
 *   init [dev]                    cuInit(0); primary context of dev (default 0) current
 *   alloc <bytes>                 cuMemAlloc_v2                       -> ok <va>
 *   free <va>                     cuMemFree_v2
 *   range <ptr>                   cuMemGetAddressRange_v2             -> ok <base> <size>
 *   attr <ptr> <attribute>        cuPointerGetAttribute (8-byte slot) -> ok <value>
 *   attrs <ptr>                   cuPointerGetAttributes of RANGE_START_ADDR, RANGE_SIZE,
 *                                 IS_LEGACY_CUDA_IPC_CAPABLE, MEMORY_TYPE -> ok <4 values>
 *   gethandle <ptr>               cuIpcGetMemHandle                   -> ok <128 hex digits>
 *   open <hex> [flags]            cuIpcOpenMemHandle_v2               -> ok <va>
 *   open1 <hex>                   the ELF v1 cuIpcOpenMemHandle       -> ok <va>
 *   open_threads <hex> <n>        n threads (this context current) open at once -> ok <n VAs>
 *   close <va>                    cuIpcCloseMemHandle
 *   fill <va> <n> <seed>          cuMemcpyHtoD of pattern(seed)
 *   check <va> <n> <seed>         cuMemcpyDtoH and compare           -> ok | err -1 mismatch@<i>
 *   pid                           -> ok <pid>
 *   quit
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static unsigned long long num(const char *s) { return strtoull(s, NULL, 0); }

static void pattern(unsigned char *p, size_t n, unsigned seed) {
  unsigned x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; i++) {
    x = x * 1103515245u + 12345u;
    p[i] = (unsigned char)(x >> 16);
  }
}

static int report(CUresult r) {
  if (r == CUDA_SUCCESS) return 0;
  const char *name = "?";
  cuGetErrorName(r, &name);
  printf("err %d %s\n", (int)r, name ? name : "?");
  return 1;
}

typedef CUresult (*get_fn)(CUipcMemHandle *, CUdeviceptr);
typedef CUresult (*open_fn)(CUdeviceptr *, CUipcMemHandle, unsigned int);
typedef CUresult (*close_fn)(CUdeviceptr);
typedef CUresult (*attr_fn)(void *, CUpointer_attribute, CUdeviceptr);
typedef CUresult (*attrs_fn)(unsigned int, CUpointer_attribute *, void **, CUdeviceptr);

static void *sym(const char *name) {
  void *p = dlsym(RTLD_DEFAULT, name);
  if (!p) fprintf(stderr, "ipc_app: %s not found\n", name);
  return p;
}

struct opener {
  open_fn f;
  CUipcMemHandle h;
  CUcontext ctx;
  CUdeviceptr va;
  CUresult r;
};

static void *open_thread(void *arg) {
  struct opener *o = arg;
  o->r = cuCtxSetCurrent(o->ctx);
  if (o->r == CUDA_SUCCESS) o->r = o->f(&o->va, o->h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  return NULL;
}

static int parse_handle(const char *hx, CUipcMemHandle *h) {
  if (strlen(hx) != 2 * CU_IPC_HANDLE_SIZE) return -1;
  for (int i = 0; i < CU_IPC_HANDLE_SIZE; i++) {
    unsigned v;
    if (sscanf(hx + 2 * i, "%2x", &v) != 1) return -1;
    h->reserved[i] = (char)v;
  }
  return 0;
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  get_fn get = (get_fn)sym("cuIpcGetMemHandle");
  open_fn open2 = (open_fn)sym("cuIpcOpenMemHandle_v2"), open1 = (open_fn)sym("cuIpcOpenMemHandle");
  close_fn closeh = (close_fn)sym("cuIpcCloseMemHandle");
  attr_fn attr = (attr_fn)sym("cuPointerGetAttribute");
  attrs_fn attrs = (attrs_fn)sym("cuPointerGetAttributes");
  char line[4096];
  while (fgets(line, sizeof line, stdin)) {
    char *argv[16];
    int argc = 0;
    for (char *t = strtok(line, " \t\r\n"); t && argc < 16; t = strtok(NULL, " \t\r\n")) argv[argc++] = t;
    if (argc == 0) continue;
    const char *c = argv[0];
    if (!strcmp(c, "quit")) {
      printf("ok\n");
      return 0;
    } else if (!strcmp(c, "pid")) {
      printf("ok %d\n", (int)getpid());
    } else if (!strcmp(c, "init")) {
      CUdevice d;
      CUcontext ctx;
      if (report(cuInit(0)) || report(cuDeviceGet(&d, argc > 1 ? (int)num(argv[1]) : 0)) ||
          report(cuDevicePrimaryCtxRetain(&ctx, d)) || report(cuCtxSetCurrent(ctx)))
        continue;
      printf("ok\n");
    } else if (!strcmp(c, "alloc")) {
      CUdeviceptr p = 0;
      if (!report(cuMemAlloc(&p, num(argv[1])))) printf("ok 0x%llx\n", (unsigned long long)p);
    } else if (!strcmp(c, "free")) {
      if (!report(cuMemFree(num(argv[1])))) printf("ok\n");
    } else if (!strcmp(c, "range")) {
      CUdeviceptr base = 0;
      size_t size = 0;
      if (!report(cuMemGetAddressRange(&base, &size, num(argv[1]))))
        printf("ok 0x%llx 0x%zx\n", (unsigned long long)base, size);
    } else if (!strcmp(c, "attr")) {
      unsigned long long v = 0;
      if (!attr) printf("err -2 missing\n");
      else if (!report(attr(&v, (CUpointer_attribute)num(argv[2]), num(argv[1])))) printf("ok 0x%llx\n", v);
    } else if (!strcmp(c, "attrs")) {
      CUpointer_attribute which[4] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                      CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                                      CU_POINTER_ATTRIBUTE_MEMORY_TYPE};
      unsigned long long v[4] = {0, 0, 0, 0};
      void *data[4] = {&v[0], &v[1], &v[2], &v[3]};
      if (!attrs) printf("err -2 missing\n");
      else if (!report(attrs(4, which, data, num(argv[1]))))
        printf("ok 0x%llx 0x%llx 0x%llx 0x%llx\n", v[0], v[1], v[2], v[3]);
    } else if (!strcmp(c, "gethandle")) {
      CUipcMemHandle h;
      memset(&h, 0, sizeof h);
      if (!get) printf("err -2 missing\n");
      else if (!report(get(&h, num(argv[1])))) {
        printf("ok ");
        for (int i = 0; i < CU_IPC_HANDLE_SIZE; i++) printf("%02x", (unsigned char)h.reserved[i]);
        printf("\n");
      }
    } else if (!strcmp(c, "open") || !strcmp(c, "open1")) {
      CUipcMemHandle h;
      CUdeviceptr p = 0;
      open_fn f = !strcmp(c, "open") ? open2 : open1;
      if (parse_handle(argv[1], &h) != 0 || !f) printf("err -2 bad-handle\n");
      else if (!report(f(&p, h, argc > 2 ? (unsigned)num(argv[2]) : CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)))
        printf("ok 0x%llx\n", (unsigned long long)p);
    } else if (!strcmp(c, "open_threads")) {
      struct opener o[16];
      int n = (int)num(argv[2]);
      pthread_t t[16];
      if (n < 1 || n > 16 || !open2 || parse_handle(argv[1], &o[0].h) != 0) {
        printf("err -2 bad-args\n");
        continue;
      }
      for (int k = 0; k < n; k++) {
        o[k].f = open2;
        o[k].h = o[0].h;
        cuCtxGetCurrent(&o[k].ctx);
        pthread_create(&t[k], NULL, open_thread, &o[k]);
      }
      CUresult r = CUDA_SUCCESS;
      for (int k = 0; k < n; k++) {
        pthread_join(t[k], NULL);
        if (o[k].r != CUDA_SUCCESS) r = o[k].r;
      }
      if (report(r)) continue;
      printf("ok");
      for (int k = 0; k < n; k++) printf(" 0x%llx", (unsigned long long)o[k].va);
      printf("\n");
    } else if (!strcmp(c, "close")) {
      if (!closeh) printf("err -2 missing\n");
      else if (!report(closeh(num(argv[1])))) printf("ok\n");
    } else if (!strcmp(c, "fill") || !strcmp(c, "check")) {
      size_t n = num(argv[2]);
      unsigned char *want = malloc(n), *got = malloc(n);
      pattern(want, n, (unsigned)num(argv[3]));
      if (!strcmp(c, "fill")) {
        if (!report(cuMemcpyHtoD(num(argv[1]), want, n))) printf("ok\n");
      } else if (!report(cuMemcpyDtoH(got, num(argv[1]), n))) {
        size_t i = 0;
        while (i < n && got[i] == want[i]) i++;
        if (i == n) printf("ok\n");
        else printf("err -1 mismatch@%zu\n", i);
      }
      free(want);
      free(got);
    } else {
      printf("err -3 unknown-command\n");
    }
  }
  return 0;
}
