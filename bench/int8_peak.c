/* The machine's VPDPBUSD throughput: the int8 peak a small-batch GEMM kernel is judged against.
 *
 * Ten independent accumulators, register operands only, on 1 and 2 threads, for the 512-bit and
 * 256-bit forms (AVX-512 VNNI; the 256-bit EVEX form needs AVX512VL). Each accumulator gets its own
 * multiplier and an empty asm barrier per step: with identical inputs a compiler may prove the ten
 * chains equal and keep one (GCC 12 -O2 does, which makes such a loop report ten times the rate).
 * 64 (zmm) or 32 (ymm) int8 multiply-adds = 128 or 64 ops per instruction.
 *
 *   gcc -O2 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -pthread -o int8_peak bench/int8_peak.c && ./int8_peak
 *
 * Then the 512-bit loop again with two other instructions per ten VPDPBUSDs, on independent registers:
 * VMULPS, VFMADD231PS, VCVTDQ2PS, VPAND+VPSRLW, VPADDD. Where the VPDPBUSD rate drops, the other
 * instruction takes the units VPDPBUSD runs on (a kernel's per-block float scaling, its unpacking):
 * on AMD Zen 4 the float multiplies and FMAs do, the conversions, logic and integer adds do not.
 *
 * With -mamx-tile -mamx-int8 (a CPU with AMX-INT8) it also times TDPBUSD: four independent 16x16
 * int32 accumulator tiles, each a 16x64 by 64x16 int8 product (16,384 multiply-adds = 32,768 ops per
 * instruction), operands loaded into tiles once (Linux: tile data needs arch_prctl permission first).
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#ifdef __AMX_INT8__
#include <sys/syscall.h>
#include <unistd.h>
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static volatile int sink;
static const long ITERS = 100000000;

#define STEP(W, c, k) do { c = W(c, a, b##k); __asm__ volatile("" : "+v"(c)); } while (0)

enum mix { MIX_NONE, MIX_MUL, MIX_FMA, MIX_CVT, MIX_LOGIC, MIX_ADD };
static const char * const MIX_NAMES[] = { "", " + 2 VMULPS", " + 2 VFMADD231PS", " + 2 VCVTDQ2PS", " + VPAND, VPSRLW",
                                          " + 2 VPADDD" };

/* ten VPDPBUSD zmm chains, plus (unless MIX_NONE) two instructions of another kind per step (*(enum mix *) arg) */
static void * run512(void * arg) {
    const enum mix m = *(const enum mix *) arg;
    const __m512i a = _mm512_set1_epi8(3);
    const __m512i b0 = _mm512_set1_epi8(1), b1 = _mm512_set1_epi8(2), b2 = _mm512_set1_epi8(3), b3 = _mm512_set1_epi8(4),
                  b4 = _mm512_set1_epi8(5), b5 = _mm512_set1_epi8(6), b6 = _mm512_set1_epi8(7), b7 = _mm512_set1_epi8(8),
                  b8 = _mm512_set1_epi8(9), b9 = _mm512_set1_epi8(10);
    __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0, c9 = c0;
    __m512 f0 = _mm512_set1_ps(1.0f), f1 = _mm512_set1_ps(2.0f);
    const __m512 g = _mm512_set1_ps(0.999f);
    __m512i i0 = _mm512_set1_epi32(1), i1 = _mm512_set1_epi32(2);
    const __m512i m4 = _mm512_set1_epi8(15);
    for (long i = 0; i < ITERS; i++) {
        STEP(_mm512_dpbusd_epi32, c0, 0); STEP(_mm512_dpbusd_epi32, c1, 1); STEP(_mm512_dpbusd_epi32, c2, 2);
        STEP(_mm512_dpbusd_epi32, c3, 3); STEP(_mm512_dpbusd_epi32, c4, 4); STEP(_mm512_dpbusd_epi32, c5, 5);
        STEP(_mm512_dpbusd_epi32, c6, 6); STEP(_mm512_dpbusd_epi32, c7, 7); STEP(_mm512_dpbusd_epi32, c8, 8);
        STEP(_mm512_dpbusd_epi32, c9, 9);
        switch (m) {
            case MIX_NONE:  break;
            case MIX_MUL:   f0 = _mm512_mul_ps(f0, g); f1 = _mm512_mul_ps(f1, g); break;
            case MIX_FMA:   f0 = _mm512_fmadd_ps(f0, g, g); f1 = _mm512_fmadd_ps(f1, g, g); break;
            case MIX_CVT:   f0 = _mm512_cvtepi32_ps(i0); f1 = _mm512_cvtepi32_ps(i1); i0 = _mm512_castps_si512(f1);
                            i1 = _mm512_castps_si512(f0); break;
            case MIX_LOGIC: i0 = _mm512_and_si512(i0, m4); i1 = _mm512_srli_epi16(i1, 1); break;
            case MIX_ADD:   i0 = _mm512_add_epi32(i0, m4); i1 = _mm512_add_epi32(i1, m4); break;
        }
        __asm__ volatile("" : "+v"(f0), "+v"(f1), "+v"(i0), "+v"(i1));
    }
    __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)),
                                 _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(_mm512_add_epi32(c6, c7),
                                                                                             _mm512_add_epi32(c8, c9))));
    sink = _mm512_reduce_add_epi32(s) + _mm512_reduce_add_epi32(i0) + (int) _mm512_reduce_add_ps(_mm512_add_ps(f0, f1));
    return 0;
}

static void * run256(void * arg) {
    (void) arg;
    const __m256i a = _mm256_set1_epi8(3);
    const __m256i b0 = _mm256_set1_epi8(1), b1 = _mm256_set1_epi8(2), b2 = _mm256_set1_epi8(3), b3 = _mm256_set1_epi8(4),
                  b4 = _mm256_set1_epi8(5), b5 = _mm256_set1_epi8(6), b6 = _mm256_set1_epi8(7), b7 = _mm256_set1_epi8(8),
                  b8 = _mm256_set1_epi8(9), b9 = _mm256_set1_epi8(10);
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0, c9 = c0;
    for (long i = 0; i < ITERS; i++) {
        STEP(_mm256_dpbusd_epi32, c0, 0); STEP(_mm256_dpbusd_epi32, c1, 1); STEP(_mm256_dpbusd_epi32, c2, 2);
        STEP(_mm256_dpbusd_epi32, c3, 3); STEP(_mm256_dpbusd_epi32, c4, 4); STEP(_mm256_dpbusd_epi32, c5, 5);
        STEP(_mm256_dpbusd_epi32, c6, 6); STEP(_mm256_dpbusd_epi32, c7, 7); STEP(_mm256_dpbusd_epi32, c8, 8);
        STEP(_mm256_dpbusd_epi32, c9, 9);
    }
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
                                 _mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(_mm256_add_epi32(c6, c7),
                                                                                             _mm256_add_epi32(c8, c9))));
    sink = _mm256_extract_epi32(s, 0);
    return 0;
}

#ifdef __AMX_INT8__
static const long AMX_ITERS = 20000000;

struct tile_config {
    unsigned char palette, start_row, reserved[14];
    unsigned short colsb[16];
    unsigned char rows[16];
};

static void * run_amx(void * arg) {
    (void) arg;
    // tmm0..3: accumulators (16 rows x 64 bytes), tmm4, tmm5: A operands (16 x 64), tmm6, tmm7: B (16 x 64)
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    // the asm operand covers the whole struct (GCC's _tile_loadconfig declares 8 bytes: patches/0006)
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
    _Alignas(64) signed char a[16 * 64], b[16 * 64];
    _Alignas(64) int c[16 * 16];
    memset(a, 3, sizeof a);
    memset(b, 1, sizeof b);
    memset(c, 0, sizeof c);
    _tile_loadd(0, c, 64); _tile_loadd(1, c, 64); _tile_loadd(2, c, 64); _tile_loadd(3, c, 64);
    _tile_loadd(4, a, 64); _tile_loadd(5, a, 64); _tile_loadd(6, b, 64); _tile_loadd(7, b, 64);
    for (long i = 0; i < AMX_ITERS; i++) {
        _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 4, 7); _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
    }
    int out[16 * 16];
    _tile_stored(0, out, 64);
    _tile_release();
    sink = out[0];
    return 0;
}
#endif

/* fn(arg) on 1 and 2 threads: each thread runs `iters` instructions of ops_per_insn int8 ops */
static void measure(const char * name, void * (*fn)(void *), void * arg, long iters, int ops_per_insn) {
    for (int th = 1; th <= 2; th++) {
        pthread_t t[2];
        const double t0 = now();
        for (int i = 0; i < th; i++) pthread_create(&t[i], 0, fn, arg);
        for (int i = 0; i < th; i++) pthread_join(t[i], 0);
        const double dt = now() - t0;
        printf("%s, %d thread(s): %.2f G instructions/s, %.0f G int8 ops/s\n", name, th, th * (double) iters / dt / 1e9,
               th * (double) iters * ops_per_insn / dt / 1e9);
    }
}

int main(void) {
    enum mix none = MIX_NONE;
    measure("VPDPBUSD zmm", run512, &none, ITERS * 10, 128);
    measure("VPDPBUSD ymm", run256, 0, ITERS * 10, 64);
    for (enum mix m = MIX_MUL; m <= MIX_ADD; m++) {
        char name[64];
        snprintf(name, sizeof name, "VPDPBUSD zmm%s", MIX_NAMES[m]);
        measure(name, run512, &m, ITERS * 10, 128);
    }
#ifdef __AMX_INT8__
    // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): without it the first tile load faults
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
        printf("TDPBUSD: the kernel refused AMX tile data (arch_prctl)\n");
        return 1;
    }
    measure("TDPBUSD (AMX)", run_amx, 0, AMX_ITERS * 4, 32768);
#endif
    return 0;
}
