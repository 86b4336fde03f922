/* The machine's VPDPBUSD throughput: the int8 peak a small-batch GEMM kernel is judged against.
 *
 * Ten independent accumulators, register operands only, on 1 and 2 threads, for the 512-bit and
 * 256-bit forms (AVX-512 VNNI; the 256-bit EVEX form needs AVX512VL). Each accumulator gets its own
 * multiplier and an empty asm barrier per step: with identical inputs a compiler may prove the ten
 * chains equal and keep one (GCC 12 -O2 does, which makes such a loop report ten times the rate).
 * 64 (zmm) or 32 (ymm) int8 multiply-adds = 128 or 64 ops per instruction.
 *
 *   gcc -O2 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -pthread -o int8_peak bench/int8_peak.c && ./int8_peak
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static volatile int sink;
static const long ITERS = 100000000;

#define STEP(W, c, k) do { c = W(c, a, b##k); __asm__ volatile("" : "+v"(c)); } while (0)

static void * run512(void * arg) {
    (void) arg;
    const __m512i a = _mm512_set1_epi8(3);
    const __m512i b0 = _mm512_set1_epi8(1), b1 = _mm512_set1_epi8(2), b2 = _mm512_set1_epi8(3), b3 = _mm512_set1_epi8(4),
                  b4 = _mm512_set1_epi8(5), b5 = _mm512_set1_epi8(6), b6 = _mm512_set1_epi8(7), b7 = _mm512_set1_epi8(8),
                  b8 = _mm512_set1_epi8(9), b9 = _mm512_set1_epi8(10);
    __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0, c9 = c0;
    for (long i = 0; i < ITERS; i++) {
        STEP(_mm512_dpbusd_epi32, c0, 0); STEP(_mm512_dpbusd_epi32, c1, 1); STEP(_mm512_dpbusd_epi32, c2, 2);
        STEP(_mm512_dpbusd_epi32, c3, 3); STEP(_mm512_dpbusd_epi32, c4, 4); STEP(_mm512_dpbusd_epi32, c5, 5);
        STEP(_mm512_dpbusd_epi32, c6, 6); STEP(_mm512_dpbusd_epi32, c7, 7); STEP(_mm512_dpbusd_epi32, c8, 8);
        STEP(_mm512_dpbusd_epi32, c9, 9);
    }
    __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)),
                                 _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(_mm512_add_epi32(c6, c7),
                                                                                             _mm512_add_epi32(c8, c9))));
    sink = _mm512_reduce_add_epi32(s);
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

static void measure(const char * name, void * (*fn)(void *), int ops_per_insn) {
    for (int th = 1; th <= 2; th++) {
        pthread_t t[2];
        const double t0 = now();
        for (int i = 0; i < th; i++) pthread_create(&t[i], 0, fn, 0);
        for (int i = 0; i < th; i++) pthread_join(t[i], 0);
        const double dt = now() - t0;
        printf("%s, %d thread(s): %.2f G instructions/s, %.0f G int8 ops/s\n", name, th, th * (double) ITERS * 10 / dt / 1e9,
               th * (double) ITERS * 10 * ops_per_insn / dt / 1e9);
    }
}

int main(void) {
    measure("VPDPBUSD zmm", run512, 128);
    measure("VPDPBUSD ymm", run256, 64);
    return 0;
}
