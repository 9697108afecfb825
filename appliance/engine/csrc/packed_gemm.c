/* A float32 and bfloat16 matmul for the few rows a decode step multiplies
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
 * AVX2 (12 of the 16 ymm; the bf16 path without AVX512-BF16 keeps three of them on the stack at
 * 6 rows, for the widened weights). Not 12 with AVX-512, though 24 accumulators fit: each row of
 * x is read through its own pointer, and twelve row pointers plus the loop's own (k, panel,
 * prefetch) need more than the 16 general registers, so gcc 12 (-O3 -march=native) kept some in
 * vector registers and moved them back (vmovq) inside the inner loop. At 10 they fit: on an AMD EPYC Zen 5, 2 cores,
 * the model's 120 weights streamed, fp32 24 / 32 / 48 / 64 rows 1.14 / 1.03 / 1.09 / 1.10x faster
 * than at 12, bf16 48-512 rows 1.03-1.05x, 1-20 rows the same.
 *
 * At a decode step's row counts this beats oneDNN's packed matmul, which pays a per-call set-up
 * and splits the work for many rows: the model's 120 weights cold, on an AMD EPYC (Zen 3, AVX2,
 * 2 cores), 1.4-1.6x at 1-16 rows, 1.2-1.3x at 32-96, even at 128, 0.8-0.85x at 256-512 (where
 * it reaches ~100 GFLOP/s against oneDNN's 110-125). The lean forward times the two once a
 * process on every layer's projections, streamed from memory as a step streams them, and uses
 * this one up to the most rows where it won, within a 5 % margin (`own_rows`). */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX__
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
 * (decoder_layers.c), unless TAKEN_BY (a statement run first, given the same arguments) did the
 * share itself and returned; NAME runs it over an OpenMP team of its own. */
#define DEFINE_GEMM(NAME, T, MICRO, TAKEN_BY)                                                                   \
    static void NAME##_rows(int64_t rows, const T *x, int64_t ldx, int64_t k, const T *panel, const char *next,   \
                            int64_t lines, const T *init, int64_t ldi, T *out, int64_t ldo) {                     \
        switch (rows) { ROW_CASES(MICRO) }                                                                        \
    }                                                                                                           \
    void NAME##_part(const T *x, int64_t m, int64_t k, int64_t ldx, const T *packed, int64_t n, const T *res,     \
                     T *y, int64_t t, int64_t nt) {                                                             \
        TAKEN_BY;                                                                                               \
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

DEFINE_GEMM(gemm_f32, float, micro_f32, )

/* bfloat16: W packed in k pairs (panel p holds W[p*NR + j][2q + e] at p*k*NR + q*2*NR + 2j + e),
 * so that one 32-bit lane holds a column's pair; the sums are float32, start from res, and are
 * rounded to bfloat16 (to nearest even) once, at the end. k must be even. */
typedef uint16_t bf16_t;

#ifdef __AVX512BF16__
/* With AVX512-BF16, one `vdpbf16ps` multiplies a broadcast pair of x by 16 columns' pairs and adds
 * both products to their float32 sums. */
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX
/* bfloat16 on AMX (Intel Xeon from Sapphire Rapids on): one `tdpbf16ps` multiplies a 16-row by
 * 32-value tile of x by a 16-pair by 16-column tile of W and adds the products to a 16 x 16 float32
 * tile, 16 times the work of a `vdpbf16ps`. The packed panel needs no other layout: its k pairs
 * of 32 columns are two such W tiles side by side (row stride 2 * NR values). A block of up to 32
 * rows keeps four float32 tiles (2 row tiles x 2 column tiles), with two tiles of x and two of W
 * (all eight of the tile registers); the rows past m of the last row tile come from a zero-padded
 * copy (in a buffer of each thread's, grown as calls need: a tile of 16 rows of k values would
 * not always fit on an OpenMP thread's stack). The sums start from zero and res is added once
 * they are done, then rounded to bfloat16 (to nearest even) once. Taken where k is a whole number
 * of 32s and the kernel has permission to use the tiles (gemm_amx). */
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_K 32 /* bfloat16 values of x per tile row */

/* The mask of a 16-lane vector's first `count` lanes (all from 16 on, none below 1). */
static inline __attribute__((always_inline)) __mmask16 first_lanes(int64_t count) {
    return count >= 16 ? 0xffff : count <= 0 ? 0 : (__mmask16)((1u << count) - 1);
}

/* The first `count` of the 16 values at p (first_lanes), as float32, the rest 0. */
static inline __attribute__((always_inline)) __m512 load_bf16_first(const bf16_t *p, int64_t count) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(first_lanes(count), p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static int amx_on;

/* Turn the AMX path on (asking Linux, once, for the tiles' state) or off; whether it is on. */
int gemm_amx(int on) {
    static int permitted = -1;
    if (on && permitted < 0) /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA */
        permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    amx_on = on && permitted > 0;
    return amx_on;
}

static void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config = {.palette = 1};
    for (int i = 0; i < 8; i++) config.colsb[i] = 64, config.rows[i] = 16;
    _tile_loadconfig(&config);
}

/* c [32][NR] float32 = rows a0 (and a1, where given) . panel, 16 rows each; the `lines` cache
 * lines from `next` (none where NULL) prefetched over the k steps. */
static inline __attribute__((always_inline)) void amx_block(const bf16_t *a0, int64_t ld0, const bf16_t *a1,
                                                            int64_t ld1, int64_t k, const bf16_t *panel,
                                                            const char *next, int64_t lines, float *c) {
    const int64_t steps = k / AMX_K;
    int64_t due = 0;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; s++) {
        const bf16_t *w = panel + s * AMX_K * NR;
        _tile_loadd(6, w, 2 * NR * sizeof(bf16_t));
        _tile_loadd(7, w + 32, 2 * NR * sizeof(bf16_t));
        _tile_loadd(4, a0 + s * AMX_K, ld0 * sizeof(bf16_t));
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (a1) {
            _tile_loadd(5, a1 + s * AMX_K, ld1 * sizeof(bf16_t));
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        PREFETCH_SHARE(next, lines, steps, due);
    }
    _tile_stored(0, c, NR * sizeof(float));
    _tile_stored(1, c + 16, NR * sizeof(float));
    if (a1) {
        _tile_stored(2, c + 16 * NR, NR * sizeof(float));
        _tile_stored(3, c + 16 * NR + 16, NR * sizeof(float));
    }
}

/* x's rows from `from` on (fewer than 16) and zero rows after them, 16 rows of k values, in this
 * thread's buffer, grown as calls need (it lives as long as the thread: OpenMP keeps its threads);
 * NULL where it cannot grow. */
static const bf16_t *padded_tail(const bf16_t *x, int64_t m, int64_t k, int64_t ldx, int64_t from) {
    static __thread bf16_t *buffer;
    static __thread int64_t capacity;
    if (16 * k > capacity) {
        free(buffer);
        capacity = 0;
        if (!(buffer = malloc(16 * k * sizeof(bf16_t)))) return NULL;
        capacity = 16 * k;
    }
    for (int64_t i = 0; i < m - from; i++) memcpy(buffer + i * k, x + (from + i) * ldx, k * sizeof(bf16_t));
    memset(buffer + (m - from) * k, 0, (16 - (m - from)) * k * sizeof(bf16_t));
    return buffer;
}

/* gemm_bf16_part's share on AMX: its panels, each over every row block; 0 where the last row
 * tile's padded copy could not be made (nothing written: the caller takes the other path). */
static int gemm_bf16_amx_part(const bf16_t *x, int64_t m, int64_t k, int64_t ldx, const bf16_t *packed, int64_t n,
                              const bf16_t *res, bf16_t *y, int64_t t, int64_t nt) {
    const int64_t panels = (n + NR - 1) / NR, first = panels * t / nt, last = panels * (t + 1) / nt;
    if (first == last) return 1;
    const int64_t tiles = (m + 15) / 16, whole = m / 16, blocks = (tiles + 1) / 2;
    const int64_t panel_lines = k * NR * (int64_t)sizeof(bf16_t) / 64;
    const bf16_t *tail = whole < tiles ? padded_tail(x, m, k, ldx, 16 * whole) : NULL;
    if (whole < tiles && !tail) return 0;
    float c[32 * NR];
    amx_configure();
    for (int64_t p = first; p < last; p++) {
        const bf16_t *panel = packed + p * k * NR;
        const char *next = p + 1 < last ? (const char *)(panel + k * NR) : NULL;
        const int64_t col = p * NR, width = n - col < NR ? n - col : NR;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t r0 = 32 * b, rows = m - r0 < 32 ? m - r0 : 32;
            const bf16_t *a0 = 2 * b < whole ? x + r0 * ldx : tail, *a1 = NULL;
            int64_t ld0 = 2 * b < whole ? ldx : k, ld1 = 0;
            if (2 * b + 1 < tiles) {
                a1 = 2 * b + 1 < whole ? x + (r0 + 16) * ldx : tail;
                ld1 = 2 * b + 1 < whole ? ldx : k;
            }
            const int64_t lo = panel_lines * b / blocks, hi = panel_lines * (b + 1) / blocks;
            amx_block(a0, ld0, a1, ld1, k, panel, next ? next + lo * 64 : NULL, hi - lo, c);
            for (int64_t i = 0; i < rows; i++) {
                bf16_t *out = y + (r0 + i) * n + col;
                __m512 lo16 = _mm512_loadu_ps(c + i * NR), hi16 = _mm512_loadu_ps(c + i * NR + 16);
                if (res) {
                    lo16 = _mm512_add_ps(lo16, load_bf16_first(res + (r0 + i) * n + col, width));
                    hi16 = _mm512_add_ps(hi16, load_bf16_first(res + (r0 + i) * n + col + 16, width - 16));
                }
                _mm256_mask_storeu_epi16(out, first_lanes(width), (__m256i)_mm512_cvtneps_pbh(lo16));
                _mm256_mask_storeu_epi16(out + 16, first_lanes(width - 16), (__m256i)_mm512_cvtneps_pbh(hi16));
            }
        }
    }
    _tile_release();
    return 1;
}
#define AMX_TAKES(x, m, k, ldx, packed, n, res, y, t, nt) \
    if (amx_on && (k) % AMX_K == 0 && gemm_bf16_amx_part(x, m, k, ldx, packed, n, res, y, t, nt)) return
#else
#define AMX_TAKES(...)
#endif
#else
/* Without AVX512-BF16 (AVX2, or any other vector unit): a bfloat16 is the upper half of the
 * float32 of the same value, so each 32-bit lane of a loaded pair gives its even-k value shifted
 * up by 16 bits and its odd-k value with the low half masked off, both exact; x's pair likewise,
 * and the products go into float32 sums by fused multiply-adds. The weight streams at half
 * float32's bytes, which is what bounds a step of a few rows; from 64 rows on it runs at
 * 0.85-0.92x float32's rate (AMD EPYC Zen 3, 2 cores). */
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
/* acc + a * b in one rounding: as intrinsics, so that -ffast-math cannot regroup a row's two
 * products (even k, odd k) into a multiply, a fused multiply-add and an add (one more instruction
 * each; the plain form, where there is no FMA, may be regrouped) */
#if defined(__AVX512F__)
#define FMADD(a, b, acc) ((vf)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(acc)))
#elif defined(__FMA__)
#define FMADD(a, b, acc) ((vf)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(acc)))
#else
#define FMADD(a, b, acc) ((acc) + (a) * (b))
#endif

static inline __attribute__((always_inline)) vf bits_as_float(vu bits) {
    vf v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* Each lane's pair's even-k value (its low half) as float32. */
static inline __attribute__((always_inline)) vf even_half(vu pairs) { return bits_as_float(pairs << 16); }

/* Each lane's pair's odd-k value (its high half) as float32. */
static inline __attribute__((always_inline)) vf odd_half(vu pairs) { return bits_as_float(pairs & 0xffff0000u); }

/* The pair of values at p in every 32-bit lane. Broadcast as a float32 from memory: given the
 * integer, gcc splits the pair with scalar shifts and moves each half over (twice the vector
 * instructions: 120 weights of the model's shapes at 64 rows took 1.37x as long on an AMD EPYC
 * Zen 3). */
static inline __attribute__((always_inline)) vu broadcast_pair(const bf16_t *p) {
    float pair;
    memcpy(&pair, p, sizeof pair);
#if defined(__AVX512F__)
    return (vu)_mm512_set1_ps(pair);
#elif defined(__AVX__)
    return (vu)_mm256_set1_ps(pair);
#else
    uint32_t bits;
    memcpy(&bits, &pair, sizeof bits);
    return (vu){0} + bits;
#endif
}

static inline __attribute__((always_inline)) vf load_bf16(const bf16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return bits_as_float(__builtin_convertvector(h, vu) << 16);
}

/* v rounded to bfloat16 (nearest even, NaN kept quiet) and stored: VL values at p. */
static inline __attribute__((always_inline)) void store_bf16(bf16_t *p, vf v) {
    vu bits;
    memcpy(&bits, &v, sizeof bits);
    const vu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const vu nan = (vu)((bits & 0x7fffffffu) > 0x7f800000u);
    const vh h = __builtin_convertvector((((bits | 0x400000u) >> 16) & nan) | (rounded & ~nan), vh);
    memcpy(p, &h, sizeof h);
}

static inline __attribute__((always_inline)) void micro_bf16(const int rows, const bf16_t *x, int64_t ldx, int64_t k,
                                                             const bf16_t *panel, const char *next, int64_t lines,
                                                             const bf16_t *init, int64_t ldi, bf16_t *out, int64_t ldo) {
    vf acc[MR][2];
    for (int i = 0; i < rows; i++) {
        acc[i][0] = init ? load_bf16(init + i * ldi) : (vf){0};
        acc[i][1] = init ? load_bf16(init + i * ldi + VL) : (vf){0};
    }
    const int64_t pairs = k / 2;
    int64_t due = 0;
    for (int64_t q = 0; q < pairs; q++) {
        vu w0, w1;
        memcpy(&w0, panel + q * 2 * NR, sizeof w0);
        memcpy(&w1, panel + q * 2 * NR + 2 * VL, sizeof w1);
        PREFETCH_SHARE(next, lines, pairs, due);
        const vf even0 = even_half(w0), even1 = even_half(w1), odd0 = odd_half(w0), odd1 = odd_half(w1);
        for (int i = 0; i < rows; i++) {
            const vu a = broadcast_pair(x + i * ldx + 2 * q);
            const vf a_even = even_half(a), a_odd = odd_half(a);
            acc[i][0] = FMADD(a_even, even0, acc[i][0]);
            acc[i][1] = FMADD(a_even, even1, acc[i][1]);
            acc[i][0] = FMADD(a_odd, odd0, acc[i][0]);
            acc[i][1] = FMADD(a_odd, odd1, acc[i][1]);
        }
    }
    for (int i = 0; i < rows; i++) {
        store_bf16(out + i * ldo, acc[i][0]);
        store_bf16(out + i * ldo + VL, acc[i][1]);
    }
}
#define AMX_TAKES(...)
#endif

DEFINE_GEMM(gemm_bf16, bf16_t, micro_bf16, AMX_TAKES(x, m, k, ldx, packed, n, res, y, t, nt))

#ifndef HAVE_AMX
int gemm_amx(int on) { return on && 0; } /* no AMX path built */
#endif
