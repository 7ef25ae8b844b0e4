/* glibc_start.c: the glibc ceiling (GLIBC_2.17, glibc_compat.h) for executables.
 *
 * An executable's start code (Scrt1.o) calls __libc_start_main, whose default version is
 * GLIBC_2.34 since glibc 2.34: from then on the start code passes no `init` function and libc
 * runs the program's constructors itself. glibc_compat.h cannot reach that call (it lives in
 * Scrt1.o, not in our sources), so an executable that must run on an older glibc (fakecuda's
 * cuda-checkpoint tool, shipped in the manylinux_2_17 wheel) is linked with this file and
 * `-Wl,--wrap=__libc_start_main` (top CMakeLists.txt, CUINTERPOSE_GLIBC_EXE_*): the start
 * code then calls __wrap___libc_start_main below, which calls the old version
 * (__libc_start_main@GLIBC_2.2.5 on x86_64, @GLIBC_2.17 on aarch64) with an `init` that does
 * what glibc's __libc_csu_init did before 2.34 in a dynamically linked program: _init, then
 * its init_array, each entry called with (argc, argv, envp). Its preinit_array is not ours to
 * run: ld.so runs it, on every glibc, before any library's constructor.
 *
 * Both glibc 2.34+ (where the old version is the same function, which calls a non-null `init`
 * instead of running the constructors itself) and older ones (whose ld.so never runs the
 * main program's constructors) then run them exactly once. `fini` stays null: ld.so's
 * _dl_fini runs the program's fini_array on every glibc. tests/shim/test_glibc.py checks the
 * built tool with objdump -T, and that a program's constructors and destructors run once. */
#if defined(__linux__) && defined(__LP64__)

typedef int (*cui_main_fn)(int, char **, char **);
typedef void (*cui_init_fn)(int, char **, char **);

/* The old version, bound under its own name so that --wrap does not rename it. */
extern int cui_glibc_start_main_old(cui_main_fn main, int argc, char **argv, cui_init_fn init, void (*fini)(void),
                                    void (*rtld_fini)(void), void *stack_end);
#if defined(__x86_64__)
__asm__(".symver cui_glibc_start_main_old,__libc_start_main@GLIBC_2.2.5");
#elif defined(__aarch64__)
__asm__(".symver cui_glibc_start_main_old,__libc_start_main@GLIBC_2.17");
#else
#error "glibc_start.c: no old __libc_start_main version known for this architecture"
#endif

/* Defined by the linker (the default script's PROVIDE_HIDDEN) and by crti.o. */
extern cui_init_fn __init_array_start[] __attribute__((visibility("hidden")));
extern cui_init_fn __init_array_end[] __attribute__((visibility("hidden")));
extern void _init(void);

static void cui_glibc_run_init(int argc, char **argv, char **envp) {
  _init();
  for (cui_init_fn *f = __init_array_start; f < __init_array_end; f++) (*f)(argc, argv, envp);
}

int __wrap___libc_start_main(cui_main_fn main, int argc, char **argv, cui_init_fn init, void (*fini)(void),
                             void (*rtld_fini)(void), void *stack_end);
int __wrap___libc_start_main(cui_main_fn main, int argc, char **argv, cui_init_fn init, void (*fini)(void),
                             void (*rtld_fini)(void), void *stack_end) {
  (void)init; /* null from a 2.34+ Scrt1.o; an older one passed __libc_csu_init, the same */
  (void)fini;
  return cui_glibc_start_main_old(main, argc, argv, cui_glibc_run_init, 0, rtld_fini, stack_end);
}

#endif /* __linux__ && __LP64__ */
