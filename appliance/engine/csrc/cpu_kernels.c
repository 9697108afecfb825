/* CPU kernels for the engine's hot path, built at first use by appliance/engine/cpu_kernels.py.
 *
 * - paged_attend_*: one query token per row against that row's cached context, read block by
 *   block straight from the paged KV cache (no gathered copy; the tiled bf16 prefill path below
 *   copies a chunk's context once into tiles), softmax per span of SPAN tokens, OpenMP over
 *   (row, KV head); the query heads that share a KV head are served by one pass over it (or
 *   several, HEADS_PER_PASS), in the CPU's own vector width (VN; head_dim a multiple of 16). Each
 *   16 tokens' scores of a query head are folded into 16 lanes (transpose_sumv), exponentiated
 *   together (exp16) once the span's maximum is known. A row is a decode row or one of a prefill
 *   chunk's (a query over its sequence's slots up to itself); the first `cold_rows` rows'
 *   contexts are prefetched ahead (see prefetch_token). In bfloat16 with AVX512-BF16 and head
 *   sizes of whole 32s a prefill chunk's rows share tiles of their context instead (see
 *   chunk_run).
 * - rms_norm_*, rotary_*, silu_mul_*: the llama layer's elementwise work, one pass each where
 *   torch needs five to eight kernels (and as many passes over memory), in 16-float vectors;
 *   silu_mul with exp16 and recip16.
 * - argmax_rows_*: each row's first largest value's index (greedy sampling over the logits).
 *
 * Every function exists for float32 and bfloat16 tensors; arithmetic is float32 throughout. The
 * last argument is the thread count (torch's, which the caller passes: OpenMP's own default is
 * per calling thread and would ignore torch.set_num_threads in the engine's thread).
 * Layouts: q [rows, heads, dim] with the given row and head strides (dim contiguous); out
 * [rows, heads, dim] contiguous; caches [kv_heads, slots, dim] with slot = block * block_size +
 * offset; block_tables [rows, table_width] and ctx_lens [rows] int64. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define CHUNK 16 /* tokens scored together: 16 lanes of scores (LANES) */
/* Tokens of a row's context per softmax pass of the per-row path: every score of the span first,
 * then its maximum, its exps (independent vectors that pipeline) and their sum, then the values.
 * With the softmax taken per 16-token chunk instead, each chunk's max, exp and sum formed one
 * chain of dependent instructions between two chunks' products (8-64 rows whose contexts reach
 * 160-2000 tokens, head size 64 with 3 query heads to a KV head, AMD EPYC Zen 5, 2 threads: the
 * kernel 1.15-1.31x faster with the cache in L3, 1.04-1.09x cold, where reading the cache bounds
 * it; a float32 prefill step of 512 tokens 1.04x). Each span past the first takes one rescale of
 * the running sums. */
#define SPAN 256
_Static_assert(SPAN % CHUNK == 0, "a span is whole chunks: its last chunk's scores fit in s[g]");
#define MAX_GROUP 16
#define MAX_DIM 256
/* Calls touching fewer elements than this run on one thread: a decode step's norm (64 x 576)
 * or a single row's attention over a short context takes microseconds, less than waking and
 * joining the OpenMP team, whose cost soars when other processes hold the cores. */
#define PAR_MIN_ELEMS (1 << 18)

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline bf16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (bf16_t)(bits >> 16);
}

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)
/* A float32 value rounded as a tensor of the type would hold it. */
#define F32_ROUND(x) (x)
#define BF16_ROUND(x) bf16_to_f32(f32_to_bf16(x))

/* 16 floats: one AVX-512 register, two AVX ones (gcc lowers the vector type to what -march has):
 * the elementwise kernels' and the attention softmax's vector. */
typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
#define LANES 16

static inline __attribute__((always_inline)) v16f load16_f32(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) v16f load16_bf16(const bf16_t *p) {
#ifdef __AVX512F__ /* one widening load (gcc builds the generic form below from 128-bit pieces) */
    return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    v16h h;
    memcpy(&h, p, sizeof h);
    const v16u bits = __builtin_convertvector(h, v16u) << 16;
    v16f v;
    memcpy(&v, &bits, sizeof v);
    return v;
#endif
}

static inline __attribute__((always_inline)) float sum16(v16f v) {
    float s = 0.f;
    for (int e = 0; e < LANES; e++) s += v[e];
    return s;
}

static inline __attribute__((always_inline)) float max16(v16f v) {
    float m = v[0];
    for (int e = 1; e < LANES; e++) m = v[e] > m ? v[e] : m;
    return m;
}

/* Lane t of the result = the sum of d[t]'s 16 lanes: four rounds of pairwise folds (two
 * two-source shuffles and one add each; 15 folds for 16 vectors where 16 horizontal sums take
 * about four times the instructions). */
#define FOLD(a, b, ...) (__builtin_shufflevector(a, b, __VA_ARGS__))
static inline __attribute__((always_inline)) v16f transpose_sum16(const v16f d[LANES]) {
    v16f c[8], e[4], f[2];
    for (int i = 0; i < 8; i++) /* [first half of d[2i] + its second half | same for d[2i+1]] */
        c[i] = FOLD(d[2 * i], d[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               FOLD(d[2 * i], d[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++) /* four partial sums for each of four vectors */
        e[i] = FOLD(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               FOLD(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++) /* two for each of eight */
        f[i] = FOLD(e[2 * i], e[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               FOLD(e[2 * i], e[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return FOLD(f[0], f[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           FOLD(f[0], f[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

typedef int32_t v16i __attribute__((vector_size(64)));

/* Lane by lane: a where mask (a vector comparison's result) is set, b elsewhere. */
static inline __attribute__((always_inline)) v16f select16(v16i mask, v16f a, v16f b) {
    v16i ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    const v16i bits = (ai & mask) | (bi & ~mask);
    v16f out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* A 16-float vector as the two AVX registers gcc holds it in, and back. */
#define HALF8(v, first)                                                                              \
    ((__m256)__builtin_shufflevector(v, v, (first), (first) + 1, (first) + 2, (first) + 3, (first) + 4, \
                                     (first) + 5, (first) + 6, (first) + 7))
static inline __attribute__((always_inline)) v16f join8(__m256 lo, __m256 hi) {
    return __builtin_shufflevector((v8f)lo, (v8f)hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
#define AVX2_HALVES 1
#endif

/* Lane by lane maximum, and the lanes of v equal to x as bits (lane 0 the lowest). */
static inline __attribute__((always_inline)) v16f max16v(v16f a, v16f b) {
#ifdef __AVX512F__
    return (v16f)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(AVX2_HALVES) /* the generic select takes a compare and three logic operations */
    return join8(_mm256_max_ps(HALF8(a, 0), HALF8(b, 0)), _mm256_max_ps(HALF8(a, 8), HALF8(b, 8)));
#else
    return select16(a > b, a, b);
#endif
}

static inline __attribute__((always_inline)) uint32_t equal16(v16f v, float x) {
#ifdef __AVX512F__
    return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(x), _CMP_EQ_OQ);
#else
    uint32_t bits = 0;
    for (int e = 0; e < LANES; e++) bits |= (uint32_t)(v[e] == x) << e;
    return bits;
#endif
}

/* exp(x), lanes clamped to [-87, 88] (where float32 stays normal and finite): x = n ln2 + r with
 * |r| <= ln2 / 2, exp(r) by its degree-7 Taylor polynomial (relative error under 1e-8 before
 * rounding), 2^n put into the exponent bits. */
#define EXP_LO (-87.f) /* exp16's clamp, also silu_mul's scalar tail's */
#define EXP_HI 88.f
/* exp(x - n ln2) for a vector x (of any width) and n = round(x / ln2) as floats nf: r with ln2 in
 * two parts (Cody-Waite), then the polynomial by Horner's rule. */
#define EXP_REDUCED(x, nf)                                                                           \
    ({                                                                                               \
        const __auto_type r_ = ((x) - (nf) * 0.693359375f) + (nf) * 2.12194440e-4f;                  \
        __auto_type p_ = r_ * (1.f / 5040) + (1.f / 720);                                            \
        p_ = p_ * r_ + (1.f / 120);                                                                  \
        p_ = p_ * r_ + (1.f / 24);                                                                   \
        p_ = p_ * r_ + (1.f / 6);                                                                    \
        p_ = p_ * r_ + 0.5f;                                                                         \
        p_ = p_ * r_ + 1.f;                                                                          \
        p_ * r_ + 1.f;                                                                               \
    })

#ifdef AVX2_HALVES
/* exp16's steps on one AVX register, in instructions AVX2 has (min/max, round, the exponent's bits
 * shifted into place), where the generic form's selects take four instructions each (AMD EPYC
 * Zen 3, the attention kernel alone, its context in cache: about 0.9x the time). */
static inline __attribute__((always_inline)) __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(EXP_HI)), _mm256_set1_ps(EXP_LO));
    const __m256 nf = _mm256_round_ps(x * 1.44269504f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 p = EXP_REDUCED(x, nf);
    const __m256i n = _mm256_cvtps_epi32(nf);
    return p * (__m256)_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
}
#endif

static inline __attribute__((always_inline)) v16f exp16(v16f x) {
#ifdef __AVX512F__ /* the same steps in fewer instructions: min/max, round, scale by 2^n */
    x = (v16f)_mm512_max_ps(_mm512_min_ps((__m512)x, _mm512_set1_ps(EXP_HI)), _mm512_set1_ps(EXP_LO));
    const v16f nf = (v16f)_mm512_roundscale_ps((__m512)(x * 1.44269504f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return (v16f)_mm512_scalef_ps((__m512)EXP_REDUCED(x, nf), (__m512)nf);
#elif defined(AVX2_HALVES)
    return join8(exp8(HALF8(x, 0)), exp8(HALF8(x, 8)));
#else
    const v16f lo = (v16f){0} + EXP_LO, hi = (v16f){0} + EXP_HI, zero = {0};
    x = select16(x < lo, lo, select16(x > hi, hi, x));
    const v16f half = select16(x < zero, zero - 0.5f, zero + 0.5f);
    const v16i n = __builtin_convertvector(x * 1.44269504f + half, v16i); /* truncates: round(x / ln2) */
    const v16f nf = __builtin_convertvector(n, v16f);
    const v16i scale_bits = (n + 127) << 23;
    v16f scale;
    memcpy(&scale, &scale_bits, sizeof scale);
    return EXP_REDUCED(x, nf) * scale;
#endif
}

/* 1 / d: AVX-512's 14-bit reciprocal and one Newton step (relative error about 1e-7, where a
 * vector divide costs several times the rest of silu's lanes); a divide elsewhere. */
static inline __attribute__((always_inline)) v16f recip16(v16f d) {
#ifdef __AVX512F__
    const v16f r = (v16f)_mm512_rcp14_ps((__m512)d);
    return r * (2.f - d * r);
#else
    return 1.f / d;
#endif
}

static inline __attribute__((always_inline)) void store16_f32(float *p, v16f v) { memcpy(p, &v, sizeof v); }

#ifdef __AVX512BF16__
/* v rounded to bfloat16 in one instruction (nearest even, NaN kept quiet; unlike f32_to_bf16 it
 * flushes denormals, under 1.2e-38, to zero). */
static inline __attribute__((always_inline)) __m256i bf16_halves16(v16f v) {
    return (__m256i)_mm512_cvtneps_pbh((__m512)v);
}

static inline __attribute__((always_inline)) v16u bf16_bits16(v16f v) {
    return (v16u)_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_halves16(v)), 16);
}

static inline __attribute__((always_inline)) void store16_bf16(bf16_t *p, v16f v) {
    _mm256_storeu_si256((__m256i *)p, bf16_halves16(v));
}
#else
/* v rounded to bfloat16 as f32_to_bf16 does (nearest even, NaN kept quiet), as float32 bits. */
static inline __attribute__((always_inline)) v16u bf16_bits16(v16f v) {
    v16u bits;
    memcpy(&bits, &v, sizeof bits);
    const v16u rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    const v16i nan = (bits & 0x7fffffffu) > 0x7f800000u;
    v16u quiet = (bits | 0x400000u) & 0xffff0000u, mask;
    memcpy(&mask, &nan, sizeof mask);
    return (quiet & mask) | (rounded & ~mask);
}

static inline __attribute__((always_inline)) void store16_bf16(bf16_t *p, v16f v) {
    const v16h h = __builtin_convertvector(bf16_bits16(v) >> 16, v16h);
    memcpy(p, &h, sizeof h);
}
#endif

static inline __attribute__((always_inline)) v16f round16_f32(v16f v) { return v; }

static inline __attribute__((always_inline)) v16f round16_bf16(v16f v) {
    const v16u bits = bf16_bits16(v);
    v16f out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* The attention kernel's per-row path works in the CPU's own vector width (VN floats: 16 with
 * AVX-512, else 8: one AVX register, two SSE or NEON ones): its queries, accumulators and
 * per-token products. It used 16-float vectors everywhere before, a pair of registers each on
 * AVX2, and there the group's queries and accumulators (2 x 3 x 8 registers at head size 64 with
 * 3 query heads to a KV head) and a chunk's 16 products went through the stack on every token:
 * cold decode attention ran at 4-5 GB/s on two threads where a plain loop reads this access
 * pattern at 10 on one (AMD EPYC Zen 3). HEADS_PER_PASS query heads share each pass over a
 * chunk's keys and values: as many as fit their queries or accumulators (D / VN registers each)
 * into three quarters of the register file, at least one (all of them at head size 64 with up to
 * 6 to a KV head on AVX-512, one at a time on AVX2). */
#ifdef __AVX512F__
#define VN 16
#define VREGS 32
typedef v16f vnf;
#define loadv_f32 load16_f32
#define loadv_bf16 load16_bf16
#define storev_f32 store16_f32
#define transpose_sumv transpose_sum16
#else
#define VN 8
#define VREGS 16
typedef v8f vnf;
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) vnf loadv_f32(const float *p) {
    vnf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) vnf loadv_bf16(const bf16_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    const v8u bits = __builtin_convertvector(h, v8u) << 16;
    vnf v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void storev_f32(float *p, vnf v) { memcpy(p, &v, sizeof v); }

/* Lane t of the result = the sum of d[t]'s 8 lanes (transpose_sum16's folds at 8 lanes: the
 * first pairs d[i] with d[i + 4] so that the lanes come out in order). */
static inline __attribute__((always_inline)) vnf transpose_sumv(const vnf d[VN]) {
    vnf c[4], e[2];
    for (int i = 0; i < 4; i++) /* [first half of d[i] + its second half | same for d[i + 4]] */
        c[i] = FOLD(d[i], d[i + 4], 0, 1, 2, 3, 8, 9, 10, 11) + FOLD(d[i], d[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++) /* two partial sums for each of four vectors */
        e[i] = FOLD(c[2 * i], c[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               FOLD(c[2 * i], c[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return FOLD(e[0], e[1], 0, 2, 8, 10, 4, 6, 12, 14) + FOLD(e[0], e[1], 1, 3, 9, 11, 5, 7, 13, 15);
}
#endif
#define HEADS_PER_PASS(D) ((VREGS * 3 / 4) / ((D) / VN) > 0 ? (VREGS * 3 / 4) / ((D) / VN) : 1)
_Static_assert(CHUNK == LANES && CHUNK % VN == 0, "a chunk's scores: whole vectors, one 16-lane softmax vector");

/* A walk over a row's cached tokens in order: the next token's block (index into the row's
 * block table), its offset in that block, and how many tokens came before it. */
typedef struct {
    int64_t blk, off, token;
} token_walk;

/* The walk's next token's slot (block * block_size + offset); then the walk steps past it. */
static inline __attribute__((always_inline)) int64_t next_slot(token_walk *w, const int64_t *table, int64_t block_size) {
    const int64_t slot = table[w->blk] * block_size + w->off;
    if (++w->off == block_size) {
        w->off = 0;
        ++w->blk;
    }
    ++w->token;
    return slot;
}

/* Prefetching a decode row's context ahead of use: its blocks lie anywhere in the cache, a few KB
 * each, too short and scattered for the hardware prefetchers to run ahead, and cold (a step
 * streams the weights between two reads of a layer's cache). Two walks over the row's tokens run
 * ahead of the one that computes: into L1 PREFETCH_NEAR tokens ahead, into L2 PREFETCH_FAR ahead
 * (64 rows of 160-600 tokens, head size 64, scattered blocks, cold: 1.18-1.26x faster in bfloat16
 * and 1.02-1.05x in float32 than with only the next chunk's keys and this chunk's values asked
 * for, on an AMD EPYC Zen 5). The walks run with the key products; a token's value row, asked for
 * with its key, is read once the span's softmax is done (SPAN), by then often out of L1 into L2
 * (a second prefetch of the values 16 tokens ahead of the value pass changed nothing measurable).
 * A prefill chunk's rows read one context that their neighbours keep in cache: prefetching there
 * only costs instructions (16-22 %), so those rows skip it. */
#define PREFETCH_NEAR 16
#define PREFETCH_FAR 64

/* A thread claims its next item when it starts one (a dynamic schedule one item ahead), so that
 * once the far walk reaches the end of its row it goes on over the next item's first
 * PREFETCH_FAR tokens, which then start warm instead of in one burst of misses; only for decode
 * rows (a prefill chunk's context stays in cache) and while more than two items a thread are left
 * (a few items claimed two at a time would idle threads) (64 rows, contexts
 * of 80-160 and 200-400 tokens, cold, 30 layers, AMD EPYC Zen 5: 1.05-1.14x faster in bfloat16,
 * 1.01-1.12x in float32 over runs an hour apart; a far walk of 128 tokens then gained 0-3 %,
 * inside the noise). */
#define NEXT_ITEM(claimed) __atomic_fetch_add(&(claimed), 1, __ATOMIC_RELAXED)

/* Asks for the key and value rows (`row_bytes` each) of the walk's next token, into L1, or into L2
 * where `far`; then steps the walk. */
static inline __attribute__((always_inline)) void prefetch_token(token_walk *w, const int64_t *table, int64_t block_size,
                                                                 int64_t row_bytes, const char *k, const char *v,
                                                                 const int far) {
    const int64_t at = next_slot(w, table, block_size) * row_bytes;
    for (int64_t b = 0; b < row_bytes; b += 64) {
        if (far) {
            __builtin_prefetch(k + at + b, 0, 2);
            __builtin_prefetch(v + at + b, 0, 2);
        } else {
            __builtin_prefetch(k + at + b, 0, 3);
            __builtin_prefetch(v + at + b, 0, 3);
        }
    }
}

/* The attention kernel's query-key products. query_*: a query head's row as score_* reads it (in
 * float32 vectors; with AVX512-BF16 the bfloat16 row as it is). score_*: one cached key row
 * against G query heads, dots[g][t] = a vector whose lanes sum to q_g . k (unscaled). */
#define DEFINE_SCORE(SUFFIX, T)                                                                      \
    static inline __attribute__((always_inline)) void query_##SUFFIX(const T *q, vnf *qv, int64_t nv) { \
        for (int64_t j = 0; j < nv; j++) qv[j] = loadv_##SUFFIX(q + VN * j);                         \
    }                                                                                                \
    static inline __attribute__((always_inline)) void score_##SUFFIX(                                \
        const vnf qv[][MAX_DIM / VN], int64_t G, const T *k_row, int64_t nv, vnf dots[][CHUNK], int64_t t) { \
        vnf k[MAX_DIM / VN];                                                                         \
        for (int64_t j = 0; j < nv; j++) k[j] = loadv_##SUFFIX(k_row + VN * j);                      \
        for (int64_t g = 0; g < G; g++) {                                                            \
            vnf dot = qv[g][0] * k[0];                                                               \
            for (int64_t j = 1; j < nv; j++) dot += qv[g][j] * k[j];                                 \
            dots[g][t] = dot;                                                                        \
        }                                                                                            \
    }
DEFINE_SCORE(f32, float)
#ifdef __AVX512BF16__
/* bfloat16 pairs multiplied and summed into float32 lanes by the CPU (vdpbf16ps: 32 products
 * per instruction, no conversion of the keys); an odd count of 16-value vectors ends on a
 * half-width load, its upper half zero. (AVX512-BF16 implies AVX-512: VN is LANES here.) */
static inline __attribute__((always_inline)) void query_bf16(const bf16_t *q, vnf *qv, int64_t nv) {
    memset(qv, 0, (size_t)(nv + 1) / 2 * sizeof(vnf));
    memcpy(qv, q, (size_t)nv * VN * sizeof(bf16_t));
}
static inline __attribute__((always_inline)) void score_bf16(
    const vnf qv[][MAX_DIM / VN], int64_t G, const bf16_t *k_row, int64_t nv, vnf dots[][CHUNK], int64_t t) {
    const int64_t pairs = (nv + 1) / 2;
    __m512bh k[MAX_DIM / (2 * VN)];
    for (int64_t j = 0; j < pairs; j++)
        k[j] = (__m512bh)_mm512_maskz_loadu_epi16(2 * j + 1 < nv ? ~0u : 0xffffu, k_row + 2 * VN * j);
    for (int64_t g = 0; g < G; g++) {
        __m512 dot = _mm512_setzero_ps();
        for (int64_t j = 0; j < pairs; j++) dot = _mm512_dpbf16_ps(dot, (__m512bh)qv[g][j], k[j]);
        dots[g][t] = (v16f)dot;
    }
}
#else
DEFINE_SCORE(bf16, bf16_t)
#endif

/* The head shapes with a copy of their own in each attention path, their size and group (query
 * heads per KV head) constant in it so that the query and accumulators stay in registers and the
 * loops over them unroll: head size 64 with groups 1 to 8, 128 with groups 1, 2, 4 and 8 (those of
 * common models; each copy adds to the build's time). HEAD_SHAPE is the switch's key (0: no copy
 * of its own), CASE(X, D, G) one case of it. */
#define HEAD_SHAPE(head_dim, group) ((head_dim) == 64 || (head_dim) == 128 ? (head_dim) * MAX_GROUP + (group) : 0)
#define HEAD_SHAPE_CASES(CASE, X)                                                                    \
    CASE(X, 64, 1) CASE(X, 64, 2) CASE(X, 64, 3) CASE(X, 64, 4) CASE(X, 64, 5) CASE(X, 64, 6)       \
    CASE(X, 64, 7) CASE(X, 64, 8) CASE(X, 128, 1) CASE(X, 128, 2) CASE(X, 128, 4) CASE(X, 128, 8)

/* A prefill chunk's rows, in bfloat16 with AVX512-BF16 (head size a multiple of 32): the rows
 * that follow the decode rows come in runs of one sequence (one block table, each row one
 * position later), each a query over its context up to itself. The per-row path reads that
 * context anew for every row and folds each token's products into a score (transpose_sumv);
 * here each KV head's context is first copied, per 16-token tile, keys transposed into
 * (dimension pair, token) order and values interleaved by token pairs, and then every row's scores
 * for a tile come out of D/2 vdpbf16ps (a broadcast pair of the query against 16 tokens' pairs)
 * and its values' products out of D/2 more (a broadcast pair of probabilities, rounded to
 * bfloat16 as torch's CPU flash kernel rounds them, against 16 dimensions' token pairs). */
typedef struct {
    int64_t row, n, start; /* first row, rows, the first row's position */
    const int64_t *table;
    int64_t tiles, first_tile, first_item; /* the context's 16-token tiles; offsets over all runs */
} chunk_run;

/* Runs of rows first..rows-1; returns their count (`runs` holds rows - first), 0 where a row has no context. */
static int64_t find_chunk_runs(const int64_t *block_tables, int64_t table_width, const int64_t *ctx_lens,
                               int64_t first, int64_t rows, int64_t kv_heads, chunk_run *runs) {
    int64_t count = 0, tiles = 0, items = 0;
    for (int64_t i = first; i < rows; i++)
        if (ctx_lens[i] < 1) return 0; /* a row with no context: every row the per-row way */
    for (int64_t i = first; i < rows;) {
        const int64_t *table = block_tables + i * table_width;
        int64_t j = i + 1;
        while (j < rows && ctx_lens[j] == ctx_lens[j - 1] + 1 &&
               !memcmp(block_tables + j * table_width, table, table_width * sizeof(int64_t)))
            j++;
        const int64_t n_tiles = (ctx_lens[j - 1] + CHUNK - 1) / CHUNK;
        runs[count++] = (chunk_run){i, j - i, ctx_lens[i] - 1, table, n_tiles, tiles, items};
        tiles += n_tiles;
        items += (j - i) * kv_heads;
        i = j;
    }
    return count;
}

#define CHUNK_TILE_WORDS(D) ((D) / 2 * CHUNK + CHUNK / 2 * (D)) /* 32-bit words: keys, then values */

/* What one paged_attend call's rows need, worked out once before its parallel region (or, in
 * decoder_layers, once a step for all its layers): the elements read (whether a team pays), the
 * runs of prefill rows the tiled path takes and their tiles' scratch, and the per-row path's
 * items, (row, KV head) pairs. */
typedef struct {
    chunk_run *runs;
    uint32_t *run_tiles;
    int64_t elems, run_count, tile_count, run_items, items;
} attend_plan;

void attend_plan_free(void *plan_) {
    attend_plan *plan = plan_;
    if (!plan) return;
    free(plan->runs);
    free(plan->run_tiles);
    free(plan);
}

#ifdef __AVX512BF16__
typedef uint32_t __attribute__((may_alias, aligned(2))) pair_word; /* two bfloat16 read as one word */

static inline __attribute__((always_inline)) int tiled_bf16(int64_t head_dim) { return head_dim % 32 == 0; }

/* Tile `tile` of KV head h of `run` into `words`: keys as [D/2][16] pairs, values as [8][D]
 * token pairs (first token in the low half); tokens past the context are zero. */
static inline __attribute__((always_inline)) void build_tile_bf16(const chunk_run *run, int64_t tile, const bf16_t *kh,
                                                                  const bf16_t *vh, int64_t D, int64_t block_size,
                                                                  uint32_t *words) {
    const int64_t context = run->start + run->n, half = D / 2;
    uint32_t *keys = words, *values = words + half * CHUNK;
    for (int64_t e = 0; e < CHUNK; e += 2) {
        const bf16_t *k[2], *v[2];
        for (int64_t u = 0; u < 2; u++) {
            const int64_t t = tile * CHUNK + e + u;
            const int64_t slot = t < context ? run->table[t / block_size] * block_size + t % block_size : -1;
            k[u] = slot < 0 ? NULL : kh + slot * D;
            v[u] = slot < 0 ? NULL : vh + slot * D;
        }
        for (int64_t u = 0; u < 2; u++)
            for (int64_t d2 = 0; d2 < half; d2++) {
                uint32_t pair = 0;
                if (k[u]) memcpy(&pair, k[u] + 2 * d2, sizeof pair);
                keys[d2 * CHUNK + e + u] = pair;
            }
        for (int64_t d = 0; d < D; d++)
            values[e / 2 * D + d] = (uint32_t)(v[0] ? v[0][d] : 0) | (uint32_t)(v[1] ? v[1][d] : 0) << 16;
    }
}

/* One row of a run against its KV head h's tiles: out's G heads of that row. */
static inline __attribute__((always_inline)) void chunk_item_bf16(
    const bf16_t *q, int64_t q_row_stride, int64_t q_head_stride, const chunk_run *run, int64_t r, int64_t h,
    int64_t kv_heads, const int64_t D, const int64_t G, float scale, const uint32_t *tiles, bf16_t *out) {
    const int64_t nv = D / LANES, half = D / 2, row = run->row + r, position = run->start + r;
    const int64_t tile_words = CHUNK_TILE_WORDS(D), last = position / CHUNK;
    const pair_word *qw[MAX_GROUP]; /* the query heads, as bfloat16 pairs */
    __m512 acc[MAX_GROUP][MAX_DIM / LANES];
    float m[MAX_GROUP], l[MAX_GROUP];
    v16i lane;
    for (int e = 0; e < LANES; e++) lane[e] = e;
    for (int64_t g = 0; g < G; g++) {
        qw[g] = (const pair_word *)(q + row * q_row_stride + (h * G + g) * q_head_stride);
        for (int64_t j = 0; j < nv; j++) acc[g][j] = _mm512_setzero_ps();
        m[g] = -3.0e38f;
        l[g] = 0.f;
    }
    for (int64_t b = 0; b <= last; b++) {
        const uint32_t *keys = tiles + ((run->first_tile + b) * kv_heads + h) * tile_words;
        const uint32_t *values = keys + half * CHUNK;
        __m512 sa[MAX_GROUP], sb[MAX_GROUP]; /* two sums per head: half the dependency chain */
        for (int64_t g = 0; g < G; g++) sa[g] = sb[g] = _mm512_setzero_ps();
        for (int64_t d2 = 0; d2 < half; d2 += 2) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(keys + d2 * CHUNK);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(keys + (d2 + 1) * CHUNK);
            for (int64_t g = 0; g < G; g++) {
                sa[g] = _mm512_dpbf16_ps(sa[g], k0, (__m512bh)_mm512_set1_epi32((int)qw[g][d2]));
                sb[g] = _mm512_dpbf16_ps(sb[g], k1, (__m512bh)_mm512_set1_epi32((int)qw[g][d2 + 1]));
            }
        }
        const v16i live = lane <= (int32_t)(position - b * CHUNK); /* the causal mask */
        int32_t pairs[MAX_GROUP][CHUNK / 2];
        for (int64_t g = 0; g < G; g++) {
            const v16f scores = select16(live, (v16f)_mm512_add_ps(sa[g], sb[g]) * scale, (v16f){0} - 3.0e38f);
            const float chunk_top = _mm512_reduce_max_ps((__m512)scores), top = chunk_top > m[g] ? chunk_top : m[g];
            const v16f p = select16(live, exp16(scores - top), (v16f){0});
            const float rescale = expf(m[g] - top);
            l[g] = l[g] * rescale + _mm512_reduce_add_ps((__m512)p);
            m[g] = top;
            const __m256i rounded = (__m256i)_mm512_cvtneps_pbh((__m512)p);
            memcpy(pairs[g], &rounded, sizeof rounded);
            for (int64_t j = 0; j < nv; j++) acc[g][j] = _mm512_mul_ps(acc[g][j], _mm512_set1_ps(rescale));
        }
        const int64_t live_pairs = b < last ? CHUNK / 2 : (position - b * CHUNK) / 2 + 1;
        for (int64_t i2 = 0; i2 < live_pairs; i2++) {
            __m512bh v[MAX_DIM / LANES];
            for (int64_t j = 0; j < nv; j++) v[j] = (__m512bh)_mm512_loadu_si512(values + i2 * D + LANES * j);
            for (int64_t g = 0; g < G; g++) {
                const __m512bh pair = (__m512bh)_mm512_set1_epi32(pairs[g][i2]);
                for (int64_t j = 0; j < nv; j++) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], v[j], pair);
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        bf16_t *og = out + (row * G * kv_heads + h * G + g) * D;
        const float inv = 1.f / l[g];
        for (int64_t j = 0; j < nv; j++) {
            v16f a;
            memcpy(&a, &acc[g][j], sizeof a);
            for (int e = 0; e < LANES; e++) og[LANES * j + e] = f32_to_bf16(a[e] * inv);
        }
    }
}

/* The runs' two phases inside paged_attend's parallel region (its own, or decoder_layers' step):
 * every tile built (split over the threads, then a barrier), then every (row, KV head) of the
 * runs, each run's longest context first. */
#define CHUNK_ITEM_CASE(X, D, G)                                                                     \
    case D * MAX_GROUP + G:                                                                          \
        chunk_item_bf16(q, q_row_stride, q_head_stride, run, r, hh, kv_heads, D, G, scale, run_tiles, out); \
        break;
#define CHUNK_PHASES_bf16                                                                            \
    _Pragma("omp for schedule(static)")                                                              \
    for (int64_t w = 0; w < tile_count * kv_heads; w++) {                                            \
        const int64_t tile = w / kv_heads, hh = w % kv_heads;                                        \
        int64_t k = 0;                                                                               \
        while (k + 1 < run_count && runs[k + 1].first_tile <= tile) k++;                             \
        build_tile_bf16(&runs[k], tile - runs[k].first_tile, k_cache + hh * num_slots * head_dim,    \
                        v_cache + hh * num_slots * head_dim, head_dim, block_size, run_tiles + w * CHUNK_TILE_WORDS(head_dim)); \
    }                                                                                                \
    for (int64_t it = NEXT_ITEM(claimed[1]); it < run_items; it = NEXT_ITEM(claimed[1])) {                     \
        int64_t k = 0;                                                                               \
        while (k + 1 < run_count && runs[k + 1].first_item <= it) k++;                               \
        const chunk_run *run = &runs[k];                                                             \
        const int64_t local = it - run->first_item, r = run->n - 1 - local / kv_heads, hh = local % kv_heads; \
        switch (HEAD_SHAPE(head_dim, group)) {                                                       \
        HEAD_SHAPE_CASES(CHUNK_ITEM_CASE, _)                                                         \
        default:                                                                                     \
            chunk_item_bf16(q, q_row_stride, q_head_stride, run, r, hh, kv_heads, head_dim, group, scale, run_tiles, out); \
        }                                                                                            \
    }
#else
static inline __attribute__((always_inline)) int tiled_bf16(int64_t head_dim) { (void)head_dim; return 0; }
#define CHUNK_PHASES_bf16
#endif
static inline __attribute__((always_inline)) int tiled_f32(int64_t head_dim) { (void)head_dim; return 0; }
#define CHUNK_PHASES_f32

/* One (row, KV head) pair per call of the item function, inlined into a copy per head shape
 * (HEAD_SHAPE_CASES). The switch runs inside the parallel region's loop so that each copy sees
 * its constants. NAME_part is one thread's work inside a parallel region (the items it claims
 * from `claimed`, two counters starting at 0, then the tiled runs), on a plan NAME_plan made;
 * NAME makes the plan and runs NAME_part over a team of its own (decoder_layers.c runs it inside
 * the step's region). */
#define DEFINE_PAGED_ATTEND(NAME, T, SUFFIX, STORE)                                                  \
    static inline __attribute__((always_inline)) int64_t NAME##_item(                                \
        const T *q, int64_t q_row_stride, int64_t q_head_stride, const T *k_cache, const T *v_cache, \
        const int64_t *block_tables, int64_t table_width, const int64_t *ctx_lens, int64_t cold_rows, int64_t kv_heads, \
        const int64_t D, const int64_t G, int64_t block_size, int64_t num_slots, float scale,       \
        T *out, int64_t item, int64_t next, int64_t warm) {                                          \
        const int64_t nv = D / VN, per_pass = HEADS_PER_PASS(D);                                      \
        const int64_t i = item / kv_heads, h = item % kv_heads, ctx = ctx_lens[i];                   \
        const int64_t *table = block_tables + i * table_width;                                       \
        const T *kh = k_cache + h * num_slots * D, *vh = v_cache + h * num_slots * D;                \
        vnf qv[MAX_GROUP][MAX_DIM / VN], acc[MAX_GROUP][MAX_DIM / VN], dots[MAX_GROUP][CHUNK];       \
        float s[MAX_GROUP][SPAN] __attribute__((aligned(64))); /* a span's scores, then their exps */ \
        float m[MAX_GROUP], l[MAX_GROUP];                                                             \
        int64_t slots[SPAN]; /* the span's tokens' cache offsets (slot * D) */                        \
        v16i lane;                                                                                   \
        for (int e = 0; e < LANES; e++) lane[e] = e;                                                 \
        for (int64_t g = 0; g < G; g++) {                                                            \
            const T *qg = q + i * q_row_stride + (h * G + g) * q_head_stride;                        \
            query_##SUFFIX(qg, qv[g], nv);                                                           \
            for (int64_t j = 0; j < nv; j++) acc[g][j] = (vnf){0};                                   \
            m[g] = -3.0e38f; /* finite: -ffast-math assumes no infinities */                         \
            l[g] = 0.f;                                                                              \
        }                                                                                            \
        const int cold = i < cold_rows;                                                              \
        const int64_t row_bytes = D * (int64_t)sizeof(T);                                            \
        /* the first `warm` tokens were asked for into L2 by the item before (see NEXT_ITEM) */      \
        token_walk near = {0, 0, 0}, far = {warm / block_size, warm % block_size, warm};             \
        const char *kb = (const char *)kh, *vb = (const char *)vh;                                   \
        const int64_t ni = next < 0 ? 0 : next / kv_heads, nh = next < 0 ? 0 : next % kv_heads;      \
        const int64_t ahead_end = next < 0 || ni >= cold_rows ? 0 : (ctx_lens[ni] < PREFETCH_FAR ? ctx_lens[ni] : PREFETCH_FAR); \
        const int64_t *next_table = block_tables + ni * table_width;                                 \
        const char *next_kb = (const char *)(k_cache + nh * num_slots * D), *next_vb = (const char *)(v_cache + nh * num_slots * D); \
        token_walk ahead = {0, 0, 0};                                                                \
        while (cold && far.token < ctx && far.token < PREFETCH_FAR) /* the first tokens, at once */  \
            prefetch_token(&far, table, block_size, row_bytes, kb, vb, 1);                           \
        while (cold && near.token < ctx && near.token < PREFETCH_NEAR)                               \
            prefetch_token(&near, table, block_size, row_bytes, kb, vb, 0);                          \
        token_walk walk = {0, 0, 0};                                                                 \
        for (int64_t s0 = 0; s0 < ctx; s0 += SPAN) {                                                 \
            const int64_t span = ctx - s0 < SPAN ? ctx - s0 : SPAN, chunks = (span + CHUNK - 1) / CHUNK; \
            for (int64_t c = 0; c < span; c += CHUNK) { /* the span's scores, a chunk at a time */   \
                const int64_t n = span - c < CHUNK ? span - c : CHUNK;                               \
                /* each key row loaded once for a pass's heads; the first pass's products ride along \
                 * with the walks (the only pass where all the heads fit in one) */                  \
                for (int64_t t = 0; t < n; t++) {                                                    \
                    slots[c + t] = next_slot(&walk, table, block_size) * D;                          \
                    if (cold && near.token < ctx) prefetch_token(&near, table, block_size, row_bytes, kb, vb, 0); \
                    if (cold && far.token < ctx) prefetch_token(&far, table, block_size, row_bytes, kb, vb, 1); \
                    else if (ahead.token < ahead_end) /* the far walk is done: on into the next item's */ \
                        prefetch_token(&ahead, next_table, block_size, row_bytes, next_kb, next_vb, 1); \
                    score_##SUFFIX((const vnf(*)[MAX_DIM / VN])qv, G < per_pass ? G : per_pass, kh + slots[c + t], \
                                   nv, dots, t);                                                     \
                }                                                                                    \
                for (int64_t g0 = per_pass; g0 < G; g0 += per_pass)                                  \
                    for (int64_t t = 0; t < n; t++)                                                  \
                        score_##SUFFIX((const vnf(*)[MAX_DIM / VN])qv + g0, G - g0 < per_pass ? G - g0 : per_pass, \
                                       kh + slots[c + t], nv, dots + g0, t);                         \
                const v16i live = lane < (int32_t)n;                                                 \
                for (int64_t g = 0; g < G; g++) {                                                    \
                    for (int64_t t = n; t < CHUNK; t++) dots[g][t] = (vnf){0};                       \
                    for (int64_t e = 0; e < CHUNK; e += VN)                                          \
                        storev_f32(s[g] + c + e, transpose_sumv(dots[g] + e) * scale);               \
                    if (n < CHUNK) /* the span's last chunk: lanes past its end out of the softmax */ \
                        store16_f32(s[g] + c, select16(live, load16_f32(s[g] + c), (v16f){0} - 3.0e38f)); \
                }                                                                                    \
            }                                                                                        \
            /* softmax over the span, its chunks' exps independent; lanes past its end hold -3e38, whose \
             * exps (clamped: exp(-87)) vanish in l, which is at least 1 (the top's own exp(0)) */     \
            for (int64_t g = 0; g < G; g++) {                                                        \
                v16f top16 = load16_f32(s[g]);                                                       \
                for (int64_t k = 1; k < chunks; k++) top16 = max16v(top16, load16_f32(s[g] + CHUNK * k)); \
                const float span_top = max16(top16), top = span_top > m[g] ? span_top : m[g];        \
                v16f sum = {0};                                                                      \
                for (int64_t k = 0; k < chunks; k++) {                                               \
                    const v16f p = exp16(load16_f32(s[g] + CHUNK * k) - top);                        \
                    sum += p;                                                                        \
                    store16_f32(s[g] + CHUNK * k, p);                                                \
                }                                                                                    \
                if (s0) { /* an earlier span's sums, rescaled to this top */                         \
                    const float rescale = expf(m[g] - top);                                          \
                    l[g] *= rescale;                                                                 \
                    for (int64_t j = 0; j < nv; j++) acc[g][j] *= rescale;                           \
                }                                                                                    \
                l[g] += sum16(sum);                                                                  \
                m[g] = top;                                                                          \
            }                                                                                        \
            for (int64_t c = 0; c < span; c += CHUNK) { /* values: each row loaded once for a pass's heads */ \
                const int64_t n = span - c < CHUNK ? span - c : CHUNK;                               \
                for (int64_t g0 = 0; g0 < G; g0 += per_pass) {                                       \
                    const int64_t g1 = G - g0 < per_pass ? G : g0 + per_pass;                        \
                    for (int64_t t = c; t < c + n; t++) {                                            \
                        vnf v[MAX_DIM / VN];                                                         \
                        for (int64_t j = 0; j < nv; j++) v[j] = loadv_##SUFFIX(vh + slots[t] + VN * j); \
                        for (int64_t g = g0; g < g1; g++)                                            \
                            for (int64_t j = 0; j < nv; j++) acc[g][j] += s[g][t] * v[j];            \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        for (int64_t g = 0; g < G; g++) {                                                            \
            T *og = out + (i * G * kv_heads + h * G + g) * D;                                        \
            const float inv = 1.f / l[g];                                                            \
            for (int64_t j = 0; j < nv; j++)                                                         \
                for (int e = 0; e < VN; e++) og[VN * j + e] = STORE(acc[g][j][e] * inv);             \
        }                                                                                            \
        return ahead.token;                                                                          \
    }                                                                                                \
    static void NAME##_plan_into(attend_plan *plan, const int64_t *block_tables, int64_t table_width, \
                                 const int64_t *ctx_lens, int64_t rows, int64_t cold_rows, int64_t kv_heads, \
                                 int64_t head_dim) {                                                 \
        *plan = (attend_plan){0};                                                                    \
        for (int64_t i = 0; i < rows; i++) plan->elems += 2 * ctx_lens[i] * kv_heads * head_dim;    \
        /* the rows after the decode rows, in runs of one sequence, by the tiled path where built */ \
        if (tiled_##SUFFIX(head_dim) && cold_rows < rows)                                            \
            plan->runs = malloc((size_t)(rows - cold_rows) * sizeof(chunk_run));                     \
        plan->run_count = plan->runs ? find_chunk_runs(block_tables, table_width, ctx_lens, cold_rows, rows, kv_heads, plan->runs) : 0; \
        const chunk_run *last = plan->run_count ? &plan->runs[plan->run_count - 1] : NULL;           \
        plan->tile_count = last ? last->first_tile + last->tiles : 0;                                \
        plan->run_items = last ? last->first_item + last->n * kv_heads : 0;                          \
        if (plan->run_count)                                                                         \
            plan->run_tiles = malloc((size_t)(plan->tile_count * kv_heads * CHUNK_TILE_WORDS(head_dim)) * sizeof(uint32_t)); \
        if (!plan->run_tiles) plan->run_count = 0; /* no room for the tiles: every row by the per-row path */ \
        plan->items = (plan->run_count ? cold_rows : rows) * kv_heads;                               \
    }                                                                                                \
    /* NAME_plan_into's plan on the heap, for decoder_layers (NULL where out of memory). */           \
    void *NAME##_plan(const int64_t *block_tables, int64_t table_width, const int64_t *ctx_lens, int64_t rows,    \
                      int64_t cold_rows, int64_t kv_heads, int64_t head_dim) {                               \
        attend_plan *plan = malloc(sizeof *plan);                                                    \
        if (plan) NAME##_plan_into(plan, block_tables, table_width, ctx_lens, rows, cold_rows, kv_heads, head_dim); \
        return plan;                                                                                 \
    }                                                                                                \
    void NAME##_part(const T *q, int64_t q_row_stride, int64_t q_head_stride, const T *k_cache,      \
                     const T *v_cache, const int64_t *block_tables, int64_t table_width,            \
                     const int64_t *ctx_lens, int64_t cold_rows, int64_t num_heads, int64_t kv_heads, \
                     int64_t head_dim, int64_t block_size, int64_t num_slots, float scale, T *out,   \
                     const void *plan_, int64_t *claimed) {                                          \
        const attend_plan *plan = plan_;                                                             \
        const chunk_run *runs = plan->runs;                                                          \
        const int64_t run_count = plan->run_count, tile_count = plan->tile_count;                    \
        const int64_t run_items = plan->run_items, items = plan->items, group = num_heads / kv_heads; \
        uint32_t *run_tiles = plan->run_tiles;                                                       \
        const int64_t team = omp_get_num_threads();                                                  \
        int64_t item = NEXT_ITEM(claimed[0]), warm = 0;                                              \
        while (item < items) {                                                                       \
            /* the next item claimed now where it pays: a decode row, many items left */              \
            const int ahead = item / kv_heads < cold_rows && items - item > 2 * team;                \
            const int64_t after = ahead ? NEXT_ITEM(claimed[0]) : -1, next = after < items ? after : -1; \
            switch (HEAD_SHAPE(head_dim, group)) {                                                   \
            HEAD_SHAPE_CASES(PAGED_ATTEND_CASE, NAME)                                                \
            default:                                                                                 \
                warm = NAME##_item(q, q_row_stride, q_head_stride, k_cache, v_cache, block_tables, table_width, \
                                   ctx_lens, cold_rows, kv_heads, head_dim, group, block_size, num_slots, scale, \
                                   out, item, next, warm);                                           \
            }                                                                                        \
            item = ahead ? after : NEXT_ITEM(claimed[0]);                                            \
        }                                                                                            \
        if (run_count) { CHUNK_PHASES_##SUFFIX }                                                     \
    }                                                                                                \
    void NAME(const T *q, int64_t q_row_stride, int64_t q_head_stride, const T *k_cache,             \
              const T *v_cache, const int64_t *block_tables, int64_t table_width,                   \
              const int64_t *ctx_lens, int64_t rows, int64_t cold_rows, int64_t num_heads, int64_t kv_heads, \
              int64_t head_dim, int64_t block_size, int64_t num_slots, float scale, T *out,          \
              int64_t threads) {                                                                     \
        attend_plan plan;                                                                            \
        NAME##_plan_into(&plan, block_tables, table_width, ctx_lens, rows, cold_rows, kv_heads, head_dim); \
        int64_t claimed[2] = {0, 0}; /* items handed out so far: dynamic schedules */                \
        _Pragma("omp parallel if (plan.elems >= PAR_MIN_ELEMS) num_threads(threads)")                \
        NAME##_part(q, q_row_stride, q_head_stride, k_cache, v_cache, block_tables, table_width, ctx_lens, \
                    cold_rows, num_heads, kv_heads, head_dim, block_size, num_slots, scale, out, &plan, claimed); \
        free(plan.runs);                                                                             \
        free(plan.run_tiles);                                                                        \
    }

/* One case of the per-row path's switch (HEAD_SHAPE_CASES). */
#define PAGED_ATTEND_CASE(NAME, D, G)                                                                \
    case D * MAX_GROUP + G:                                                                          \
        warm = NAME##_item(q, q_row_stride, q_head_stride, k_cache, v_cache, block_tables, table_width, \
                           ctx_lens, cold_rows, kv_heads, D, G, block_size, num_slots, scale, out, item, next, warm); \
        break;

/* Each elementwise kernel below comes as NAME_part (thread t of nt's share of the rows, rows * t /
 * nt up to rows * (t + 1) / nt, for a caller already inside a parallel region: decoder_layers.c)
 * and NAME, which runs NAME_part over a team of its own (one thread below PAR_MIN_ELEMS): one
 * compiled copy of the work, so that either gives the same bits. */
/* out = weight * round(x * rsqrt(mean(x^2) + eps)): transformers' LlamaRMSNorm, op for op. */
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE, ROUND, SUFFIX)                                         \
    static inline __attribute__((always_inline)) void NAME##_row(const T *xr, const T *weight, float eps, \
                                                                 int64_t dim, T *o) {                \
        const int64_t whole = dim - dim % LANES; /* 16 lanes at a time, then a scalar tail */        \
        v16f squares = {0};                                                                          \
        for (int64_t d = 0; d < whole; d += LANES) {                                                 \
            const v16f v = load16_##SUFFIX(xr + d);                                                  \
            squares += v * v;                                                                        \
        }                                                                                            \
        float ss = sum16(squares);                                                                   \
        for (int64_t d = whole; d < dim; d++) ss += LOAD(xr[d]) * LOAD(xr[d]);                       \
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);                                        \
        for (int64_t d = 0; d < whole; d += LANES)                                                   \
            store16_##SUFFIX(o + d, load16_##SUFFIX(weight + d) * round16_##SUFFIX(load16_##SUFFIX(xr + d) * inv)); \
        for (int64_t d = whole; d < dim; d++) o[d] = STORE(LOAD(weight[d]) * ROUND(LOAD(xr[d]) * inv)); \
    }                                                                                                \
    void NAME##_part(const T *x, const T *weight, float eps, int64_t rows, int64_t dim, T *out, int64_t t, \
                     int64_t nt) {                                                                   \
        for (int64_t r = rows * t / nt; r < rows * (t + 1) / nt; r++)                               \
            NAME##_row(x + r * dim, weight, eps, dim, out + r * dim);                                \
    }                                                                                                \
    void NAME(const T *x, const T *weight, float eps, int64_t rows, int64_t dim, T *out, int64_t threads) { \
        _Pragma("omp parallel if (rows * dim >= PAR_MIN_ELEMS) num_threads(threads)")                \
        NAME##_part(x, weight, eps, rows, dim, out, omp_get_thread_num(), omp_get_num_threads());    \
    }

/* In place on the first `heads` heads of every row: x * cos + rotate_half(x) * sin, with
 * rotate_half(x) = cat(-x[half:], x[:half]) and cos/sin [rows, dim] (each half repeated); 16
 * lanes of each half at a time, then a scalar tail (a half that is not a whole number of vectors). */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE, SUFFIX)                                                  \
    static inline __attribute__((always_inline)) void NAME##_row(T *xr, int64_t heads, int64_t dim, const T *c, \
                                                                 const T *s) {                      \
        const int64_t half = dim / 2, whole = half - half % LANES;                                   \
        for (int64_t h = 0; h < heads; h++) {                                                        \
            T *v = xr + h * dim;                                                                     \
            for (int64_t d = 0; d < whole; d += LANES) {                                             \
                const v16f a = load16_##SUFFIX(v + d), b = load16_##SUFFIX(v + d + half);           \
                store16_##SUFFIX(v + d, a * load16_##SUFFIX(c + d) - b * load16_##SUFFIX(s + d));    \
                store16_##SUFFIX(v + d + half, b * load16_##SUFFIX(c + d + half) + a * load16_##SUFFIX(s + d + half)); \
            }                                                                                        \
            for (int64_t d = whole; d < half; d++) {                                                 \
                const float a = LOAD(v[d]), b = LOAD(v[d + half]);                                   \
                v[d] = STORE(a * LOAD(c[d]) - b * LOAD(s[d]));                                       \
                v[d + half] = STORE(b * LOAD(c[d + half]) + a * LOAD(s[d + half]));                  \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    void NAME##_part(T *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t dim, const T *cos, \
                     const T *sin, int64_t t, int64_t nt) {                                          \
        for (int64_t r = rows * t / nt; r < rows * (t + 1) / nt; r++)                               \
            NAME##_row(x + r * row_stride, heads, dim, cos + r * dim, sin + r * dim);                \
    }                                                                                                \
    void NAME(T *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t dim, const T *cos,     \
              const T *sin, int64_t threads) {                                                       \
        _Pragma("omp parallel if (rows * heads * dim >= PAR_MIN_ELEMS) num_threads(threads)")         \
        NAME##_part(x, rows, row_stride, heads, dim, cos, sin, omp_get_thread_num(), omp_get_num_threads()); \
    }

/* out [rows, inter] = silu(gate_up[:, :inter]) * gate_up[:, inter:], 16 lanes at a time. */
#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE, ROUND, SUFFIX)                                         \
    static inline __attribute__((always_inline)) void NAME##_row(const T *g, int64_t inter, T *o) {  \
        const T *u = g + inter;                                                                      \
        int64_t d = 0;                                                                               \
        for (; d + LANES <= inter; d += LANES) {                                                     \
            const v16f x = load16_##SUFFIX(g + d);                                                   \
            const v16f silu = round16_##SUFFIX(x * recip16(1.f + exp16((v16f){0} - x)));              \
            store16_##SUFFIX(o + d, silu * load16_##SUFFIX(u + d));                                  \
        }                                                                                            \
        for (; d < inter; d++) { /* exp clamped as exp16's: -ffast-math assumes no infinities */     \
            const float x = LOAD(g[d]);                                                              \
            o[d] = STORE(ROUND(x / (1.f + expf(x > -EXP_HI ? -x : EXP_HI))) * LOAD(u[d]));           \
        }                                                                                            \
    }                                                                                                \
    void NAME##_part(const T *gate_up, int64_t rows, int64_t inter, T *out, int64_t t, int64_t nt) {  \
        for (int64_t r = rows * t / nt; r < rows * (t + 1) / nt; r++)                               \
            NAME##_row(gate_up + r * 2 * inter, inter, out + r * inter);                             \
    }                                                                                                \
    void NAME(const T *gate_up, int64_t rows, int64_t inter, T *out, int64_t threads) {              \
        _Pragma("omp parallel if (rows * inter >= PAR_MIN_ELEMS) num_threads(threads)")               \
        NAME##_part(gate_up, rows, inter, out, omp_get_thread_num(), omp_get_num_threads());         \
    }

/* out[r] = the index of row r's largest value, the first of equal ones (torch's max(dim=-1)
 * index), for greedy sampling: one pass for the largest value in 16 lanes, one for where it first
 * is. Rows with NaN are not handled as torch does (-ffast-math): the engine's logits have none. */
#define DEFINE_ARGMAX(NAME, T, LOAD, SUFFIX)                                                         \
    void NAME(const T *x, int64_t rows, int64_t cols, int64_t row_stride, int64_t *out, int64_t threads) { \
        _Pragma("omp parallel for if (rows * cols >= PAR_MIN_ELEMS) num_threads(threads)")           \
        for (int64_t r = 0; r < rows; r++) {                                                         \
            const T *xr = x + r * row_stride;                                                        \
            const int64_t whole = cols < LANES ? 0 : cols - cols % LANES;                            \
            float top = LOAD(xr[0]);                                                                 \
            if (whole) {                                                                             \
                v16f best = load16_##SUFFIX(xr);                                                     \
                for (int64_t c = LANES; c < whole; c += LANES) best = max16v(best, load16_##SUFFIX(xr + c)); \
                top = max16(best);                                                                   \
            }                                                                                        \
            for (int64_t c = whole; c < cols; c++) top = LOAD(xr[c]) > top ? LOAD(xr[c]) : top;      \
            int64_t at = -1;                                                                         \
            for (int64_t c = 0; c < whole && at < 0; c += LANES) {                                   \
                const uint32_t hits = equal16(load16_##SUFFIX(xr + c), top);                         \
                if (hits) at = c + __builtin_ctz(hits);                                              \
            }                                                                                        \
            for (int64_t c = whole; c < cols && at < 0; c++)                                         \
                if (LOAD(xr[c]) == top) at = c;                                                      \
            out[r] = at < 0 ? 0 : at;                                                                \
        }                                                                                            \
    }

DEFINE_PAGED_ATTEND(paged_attend_f32, float, f32, F32_STORE)
DEFINE_PAGED_ATTEND(paged_attend_bf16, bf16_t, bf16, f32_to_bf16)
DEFINE_RMS_NORM(rms_norm_f32, float, F32_LOAD, F32_STORE, F32_ROUND, f32)
DEFINE_RMS_NORM(rms_norm_bf16, bf16_t, bf16_to_f32, f32_to_bf16, BF16_ROUND, bf16)
DEFINE_ROTARY(rotary_f32, float, F32_LOAD, F32_STORE, f32)
DEFINE_ROTARY(rotary_bf16, bf16_t, bf16_to_f32, f32_to_bf16, bf16)
DEFINE_SILU_MUL(silu_mul_f32, float, F32_LOAD, F32_STORE, F32_ROUND, f32)
DEFINE_SILU_MUL(silu_mul_bf16, bf16_t, bf16_to_f32, f32_to_bf16, BF16_ROUND, bf16)
DEFINE_ARGMAX(argmax_rows_f32, float, F32_LOAD, f32)
DEFINE_ARGMAX(argmax_rows_bf16, bf16_t, bf16_to_f32, bf16)

/* Limits the Python side checks before choosing paged_attend. */
int64_t paged_attend_max_group(void) { return MAX_GROUP; }
int64_t paged_attend_max_dim(void) { return MAX_DIM; }
int64_t paged_attend_dim_multiple(void) { return LANES; }
