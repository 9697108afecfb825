/* A float32 (and, with AVX512-BF16, bfloat16) matmul for the few rows a decode step multiplies
 * (and, on CPUs where it wins there, a prefill chunk's hundreds): y [m, n] = x [m, k] @ W^T (+ res).
 *
 * W is packed once (CpuKernels.pack_gemm) into panels of NR output columns, k-major: panel p holds
 * W[p*NR + j][kk] at p*k*NR + kk*NR + j (float32; bfloat16 in k pairs, below), zero-padded past
 * n. A panel is then one contiguous stream, read once per block of up to MR rows of x while it
 * sits in L2. Threads split the panels (each streams its own share of the weight from memory,
 * which is what bounds a step of a few rows), and every row block of a panel prefetches its share
 * of the next panel, so the stream runs under all of the panel's arithmetic (prefetched by the
 * first block alone, the next panel arrived while that block ran and the memory idled under the
 * others: a step's matmuls at 16-64 rows took about the sum of their streaming and arithmetic
 * times; on an Intel Xeon with AVX-512, 2 cores, the spread prefetch took the model's 120 weights
 * at 16 / 32 / 64 rows from 32.3 / 42.8 / 67.5 ms to 26.5 / 36.8 / 59.5 ms). The micro-kernel
 * keeps MR x NR outputs in registers: MR = 10 with AVX-512 (20 of the 32 zmm registers), 6 with
 * AVX2 (12 of the 16 ymm). Not 12 with AVX-512, though 24 accumulators fit: each row of x is read
 * through its own pointer, and twelve row pointers plus the loop's own (k, panel, prefetch) need
 * more than the 16 general registers, so gcc 12 (-O3 -march=native) kept some in vector registers
 * and moved them back (vmovq) inside the inner loop. At 10 they fit: on an AMD EPYC Zen 5, 2 cores,
 * the model's 120 weights streamed, fp32 24 / 32 / 48 / 64 rows 1.14 / 1.03 / 1.09 / 1.10x faster
 * than at 12, bf16 48-512 rows 1.03-1.05x, 1-20 rows the same.
 *
 * At a decode step's row counts this beats oneDNN's packed matmul, which pays a per-call set-up
 * and splits the work for many rows: the model's 120 weights cold, on an AMD EPYC (Zen 3, AVX2,
 * 2 cores), 1.4-1.6x at 1-16 rows, 1.2-1.3x at 32-96, even at 128, 0.8-0.85x at 256-512 (where
 * it reaches ~100 GFLOP/s against oneDNN's 110-125). The lean forward times the two once a
 * process on every layer's gate/up weight, streamed from memory as a step streams them, and uses
 * this one up to the most rows where it won, within a 5 % margin (`own_rows`). */
#include <omp.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#ifdef __AVX512F__
#define VL 16 /* floats per vector register */
#define MR 10
#else
#define VL 8
#define MR 6
#endif
#define NR (2 * VL)

typedef float vf __attribute__((vector_size(VL * 4)));

static inline __attribute__((always_inline)) vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* Output columns per packed panel (the Python side packs the weight to match). */
int64_t gemm_panel_width(void) { return NR; }

/* One k step's share of the `lines` cache lines from `next` (none where NULL), so that they are all
 * prefetched, evenly, over `steps` steps; `due` counts the share owed. */
#define PREFETCH_SHARE(next, lines, steps, due)                                                       \
    do {                                                                                              \
        if (next)                                                                                     \
            for (due += lines; due >= steps; due -= steps, next += 64) __builtin_prefetch(next, 0, 3); \
    } while (0)

/* out[i][0:NR] = init[i] (zero where NULL) + x[i] . panel over k steps, for `rows` rows; the
 * `lines` cache lines from `next` (none where NULL) are prefetched, spread evenly over the k steps. */
static inline __attribute__((always_inline)) void micro_f32(const int rows, const float *x, int64_t ldx, int64_t k,
                                                            const float *panel, const char *next, int64_t lines,
                                                            const float *init, int64_t ldi, float *out, int64_t ldo) {
    vf acc[MR][2];
    for (int i = 0; i < rows; i++) {
        acc[i][0] = init ? loadv(init + i * ldi) : (vf){0};
        acc[i][1] = init ? loadv(init + i * ldi + VL) : (vf){0};
    }
    int64_t due = 0;
    for (int64_t kk = 0; kk < k; kk++) {
        const vf b0 = loadv(panel + kk * NR), b1 = loadv(panel + kk * NR + VL);
        PREFETCH_SHARE(next, lines, k, due);
        for (int i = 0; i < rows; i++) {
            const float a = x[i * ldx + kk];
            acc[i][0] += a * b0;
            acc[i][1] += a * b1;
        }
    }
    for (int i = 0; i < rows; i++) {
        storev(out + i * ldo, acc[i][0]);
        storev(out + i * ldo + VL, acc[i][1]);
    }
}

/* A micro-kernel with the row count a constant, so each case keeps its accumulators in registers. */
#define ROW_CASE(R, MICRO) \
    case R: MICRO(R, x, ldx, k, panel, next, lines, init, ldi, out, ldo); break;
#if MR > 6
#define ROW_CASES(MICRO)                                                                                            \
    ROW_CASE(1, MICRO) ROW_CASE(2, MICRO) ROW_CASE(3, MICRO) ROW_CASE(4, MICRO) ROW_CASE(5, MICRO) ROW_CASE(6, MICRO) \
    ROW_CASE(7, MICRO) ROW_CASE(8, MICRO) ROW_CASE(9, MICRO) ROW_CASE(10, MICRO)
#else
#define ROW_CASES(MICRO) \
    ROW_CASE(1, MICRO) ROW_CASE(2, MICRO) ROW_CASE(3, MICRO) ROW_CASE(4, MICRO) ROW_CASE(5, MICRO) ROW_CASE(6, MICRO)
#endif

/* NAME: y [m, n] (contiguous) = x [m, k] (row stride ldx) @ W^T, plus res [m, n] (contiguous)
 * unless NULL, in T, through MICRO; W packed as `pack_gemm` packs it (k * NR values a panel).
 * NAME_part: thread t of nt's share of the panels, for a caller already inside a parallel region
 * (decoder_layers.c); NAME runs it over an OpenMP team of its own. */
#define DEFINE_GEMM(NAME, T, MICRO)                                                                             \
    static void NAME##_rows(int64_t rows, const T *x, int64_t ldx, int64_t k, const T *panel, const char *next,   \
                            int64_t lines, const T *init, int64_t ldi, T *out, int64_t ldo) {                     \
        switch (rows) { ROW_CASES(MICRO) }                                                                        \
    }                                                                                                           \
    void NAME##_part(const T *x, int64_t m, int64_t k, int64_t ldx, const T *packed, int64_t n, const T *res,     \
                     T *y, int64_t t, int64_t nt) {                                                             \
        const int64_t panels = (n + NR - 1) / NR, blocks = (m + MR - 1) / MR;                                   \
        const int64_t panel_lines = k * NR * (int64_t)sizeof(T) / 64;                                           \
        const int64_t first = panels * t / nt, last = panels * (t + 1) / nt;                                    \
        for (int64_t p = first; p < last; p++) {                                                                \
            const T *panel = packed + p * k * NR;                                                               \
            const char *next = p + 1 < last ? (const char *)(panel + k * NR) : NULL;                            \
            const int64_t col = p * NR, width = n - col < NR ? n - col : NR;                                    \
            if (width < NR) { /* the last, partial panel: through a full-width scratch tile */                  \
                T tile[MR * NR];                                                                                \
                for (int64_t b = 0, row = 0, rows; b < blocks; b++, row += rows) {                              \
                    rows = m * (b + 1) / blocks - row;                                                          \
                    if (res)                                                                                    \
                        for (int i = 0; i < rows; i++)                                                          \
                            memcpy(tile + i * NR, res + (row + i) * n + col, width * sizeof(T));                \
                    NAME##_rows(rows, x + row * ldx, ldx, k, panel, NULL, 0, res ? tile : NULL, NR, tile, NR);     \
                    for (int i = 0; i < rows; i++) memcpy(y + (row + i) * n + col, tile + i * NR, width * sizeof(T));     \
                }                                                                                               \
                continue;                                                                                       \
            }                                                                                                   \
            for (int64_t b = 0, row = 0, rows; b < blocks; b++, row += rows) {                                  \
                rows = m * (b + 1) / blocks - row; /* rows spread evenly over the blocks */                     \
                /* block b prefetches its share of the next panel, so the stream runs under every block */      \
                const int64_t lo = panel_lines * b / blocks, hi = panel_lines * (b + 1) / blocks;               \
                NAME##_rows(rows, x + row * ldx, ldx, k, panel, next ? next + lo * 64 : NULL, hi - lo,          \
                            res ? res + row * n + col : NULL, n, y + row * n + col, n);                         \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    void NAME(const T *x, int64_t m, int64_t k, int64_t ldx, const T *packed, int64_t n, const T *res, T *y,      \
              int64_t threads) {                                                                                \
        const int64_t panels = (n + NR - 1) / NR;                                                               \
        if (threads > panels) threads = panels;                                                                 \
        _Pragma("omp parallel num_threads(threads)")                                                            \
        NAME##_part(x, m, k, ldx, packed, n, res, y, omp_get_thread_num(), omp_get_num_threads());              \
    }

DEFINE_GEMM(gemm_f32, float, micro_f32)

#ifdef __AVX512BF16__
/* bfloat16 (AVX512-BF16): W packed in k pairs (panel p holds W[p*NR + j][2q + e] at
 * p*k*NR + q*2*NR + 2j + e), so that one `vdpbf16ps` multiplies a broadcast pair of x by 16
 * columns' pairs and adds both products to their float32 sums; the sums start from res, and are
 * rounded to bfloat16 (to nearest even) once, at the end. k must be even. */
typedef uint16_t bf16_t;

static inline __attribute__((always_inline)) __m512 load_bf16(const bf16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline __attribute__((always_inline)) void micro_bf16(const int rows, const bf16_t *x, int64_t ldx, int64_t k,
                                                             const bf16_t *panel, const char *next, int64_t lines,
                                                             const bf16_t *init, int64_t ldi, bf16_t *out, int64_t ldo) {
    __m512 acc[MR][2];
    for (int i = 0; i < rows; i++) {
        acc[i][0] = init ? load_bf16(init + i * ldi) : _mm512_setzero_ps();
        acc[i][1] = init ? load_bf16(init + i * ldi + 16) : _mm512_setzero_ps();
    }
    const int64_t pairs = k / 2;
    int64_t due = 0;
    for (int64_t q = 0; q < pairs; q++) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + q * 2 * NR);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + q * 2 * NR + 32);
        PREFETCH_SHARE(next, lines, pairs, due);
        for (int i = 0; i < rows; i++) {
            int32_t pair;
            memcpy(&pair, x + i * ldx + 2 * q, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
        }
    }
    for (int i = 0; i < rows; i++) {
        _mm256_storeu_si256((__m256i *)(out + i * ldo), (__m256i)_mm512_cvtneps_pbh(acc[i][0]));
        _mm256_storeu_si256((__m256i *)(out + i * ldo + 16), (__m256i)_mm512_cvtneps_pbh(acc[i][1]));
    }
}

DEFINE_GEMM(gemm_bf16, bf16_t, micro_bf16)
#endif
