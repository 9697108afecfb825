/* Paged decode attention on the CPU: one query token per row against that row's cached context,
 * read block by block straight from the paged KV cache (no gathered copy), online softmax,
 * OpenMP over (row, KV head). Built at first use by appliance/engine/cpu_kernel.py.
 *
 * Layouts (all contiguous): q and out [rows, heads, dim]; caches [kv_heads, slots, dim], slot =
 * block * block_size + offset; block_tables [rows, table_width]; ctx_lens [rows].
 * The query heads that share a KV head (grouped-query attention) are served by one pass over
 * that head's keys and values. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CHUNK 32   /* tokens scored per online-softmax step */
#define MAX_GROUP 16
#define MAX_DIM 256

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

#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                          \
    void NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *block_tables,          \
              int64_t table_width, const int64_t *ctx_lens, int64_t rows, int64_t num_heads,         \
              int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t num_slots, float scale, \
              T *out) {                                                                              \
        const int64_t group = num_heads / kv_heads, D = head_dim;                                    \
        _Pragma("omp parallel for schedule(dynamic, 1)")                                             \
        for (int64_t item = 0; item < rows * kv_heads; item++) {                                     \
            const int64_t i = item / kv_heads, h = item % kv_heads, ctx = ctx_lens[i];               \
            const int64_t *table = block_tables + i * table_width;                                   \
            const T *kh = k_cache + h * num_slots * D, *vh = v_cache + h * num_slots * D;            \
            float qf[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], s[MAX_GROUP][CHUNK];              \
            float m[MAX_GROUP], l[MAX_GROUP];                                                        \
            for (int64_t g = 0; g < group; g++) {                                                    \
                const T *qg = q + (i * num_heads + h * group + g) * D;                               \
                for (int64_t d = 0; d < D; d++) { qf[g][d] = LOAD(qg[d]) * scale; acc[g][d] = 0.f; } \
                m[g] = -3.0e38f;                                                                      \
                l[g] = 0.f;                                                                          \
            }                                                                                        \
            for (int64_t t0 = 0; t0 < ctx; t0 += CHUNK) {                                            \
                const int64_t n = ctx - t0 < CHUNK ? ctx - t0 : CHUNK;                               \
                for (int64_t t = 0; t < n; t++) {                                                    \
                    const int64_t pos = t0 + t;                                                      \
                    const T *kt = kh + (table[pos / block_size] * block_size + pos % block_size) * D; \
                    for (int64_t g = 0; g < group; g++) {                                            \
                        float dot = 0.f;                                                             \
                        _Pragma("omp simd reduction(+ : dot)")                                       \
                        for (int64_t d = 0; d < D; d++) dot += qf[g][d] * LOAD(kt[d]);               \
                        s[g][t] = dot;                                                               \
                    }                                                                                \
                }                                                                                    \
                for (int64_t g = 0; g < group; g++) {                                                \
                    float top = m[g], sum = 0.f;                                                     \
                    for (int64_t t = 0; t < n; t++) top = s[g][t] > top ? s[g][t] : top;            \
                    const float rescale = expf(m[g] - top);                                          \
                    for (int64_t t = 0; t < n; t++) { s[g][t] = expf(s[g][t] - top); sum += s[g][t]; } \
                    l[g] = l[g] * rescale + sum;                                                     \
                    m[g] = top;                                                                      \
                    if (rescale != 1.f)                                                              \
                        for (int64_t d = 0; d < D; d++) acc[g][d] *= rescale;                        \
                }                                                                                    \
                for (int64_t t = 0; t < n; t++) {                                                    \
                    const int64_t pos = t0 + t;                                                      \
                    const T *vt = vh + (table[pos / block_size] * block_size + pos % block_size) * D; \
                    for (int64_t g = 0; g < group; g++) {                                            \
                        const float p = s[g][t];                                                     \
                        _Pragma("omp simd")                                                          \
                        for (int64_t d = 0; d < D; d++) acc[g][d] += p * LOAD(vt[d]);                \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
            for (int64_t g = 0; g < group; g++) {                                                    \
                T *og = out + (i * num_heads + h * group + g) * D;                                   \
                const float inv = 1.f / l[g];                                                        \
                for (int64_t d = 0; d < D; d++) og[d] = STORE(acc[g][d] * inv);                      \
            }                                                                                        \
        }                                                                                            \
    }

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)

DEFINE_KERNEL(paged_decode_f32, float, LOAD_F32, STORE_F32)
DEFINE_KERNEL(paged_decode_bf16, bf16_t, bf16_to_f32, f32_to_bf16)

/* Limits the Python side checks before choosing this kernel. */
int64_t paged_decode_max_group(void) { return MAX_GROUP; }
int64_t paged_decode_max_dim(void) { return MAX_DIM; }
