/* Every decoder layer of a llama step in one call: the same kernels, in the same order, on the
 * same operands as the lean forward's Python loop (fast_llama.py) calls them one by one, so the
 * result is the same to the bit; what goes is the Python between them (about ten calls a layer,
 * each with its argument checks, output allocation and ctypes conversion: 1.5-2 ms of a step).
 *
 * It applies to a step whose every matmul takes the own GEMM (plain_rows < rows <= own_rows) and
 * whose every row the attention kernel takes (decode rows and short prefill chunks); the forward
 * checks that and loops in Python otherwise. Per layer:
 *   x = rms_norm(h, ln1); qkv = x @ Wqkv^T; rotate q and k in qkv; write k, v into the cache at
 *   their slots; attn = paged_attend(q); h2 = h + attn @ Wo^T; x = rms_norm(h2, ln2);
 *   gu = x @ Wgate_up^T; act = silu(gate) * up; h = h2 + act @ Wdown^T.
 * Layout of `layers`: per layer LAYER_POINTERS addresses (ln1, ln2, qkv, o, gate_up, down: the
 * norms' weights and the own GEMM's packed copies; then the layer's K and V caches: the order
 * fast_llama.py's table lists them in), and `eps` two floats per layer. `h` [rows, hidden] is
 * updated in place; `work` holds rows * (2 hidden + qkv width + heads * head_dim + 3 inter)
 * values (LayerShape.work_size). */
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16_t;

enum { LN1, LN2, QKV, O, GATE_UP, DOWN, K_CACHE, V_CACHE, LAYER_POINTERS };

int64_t decoder_layer_pointers(void) { return LAYER_POINTERS; }

#define DEFINE_DECODER_LAYERS(SUFFIX, T)                                                                          \
    void rms_norm_##SUFFIX(const T *x, const T *weight, float eps, int64_t rows, int64_t dim, T *out, int64_t threads); \
    void rotary_##SUFFIX(T *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t dim, const T *cos,       \
                         const T *sin, int64_t threads);                                                           \
    void silu_mul_##SUFFIX(const T *gate_up, int64_t rows, int64_t inter, T *out, int64_t threads);              \
    void gemm_##SUFFIX(const T *x, int64_t m, int64_t k, int64_t ldx, const T *packed, int64_t n, const T *res,  \
                       T *y, int64_t threads);                                                                     \
    void paged_attend_##SUFFIX(const T *q, int64_t q_row_stride, int64_t q_head_stride, const T *k_cache,         \
                               const T *v_cache, const int64_t *block_tables, int64_t table_width,               \
                               const int64_t *ctx_lens, int64_t rows, int64_t cold_rows, int64_t num_heads,      \
                               int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t num_slots,        \
                               float scale, T *out, int64_t threads);                                             \
    void decoder_layers_##SUFFIX(T *h, int64_t rows, int64_t hidden, int64_t num_layers, const int64_t *layers,  \
                                 const float *eps, int64_t heads, int64_t kv_heads, int64_t head_dim,             \
                                 int64_t inter, const T *cos, const T *sin, const int64_t *slot_mapping,          \
                                 const int64_t *block_tables, int64_t table_width, const int64_t *ctx_lens,       \
                                 int64_t cold_rows, int64_t block_size, int64_t num_slots, float scale, T *work,  \
                                 int64_t threads) {                                                               \
        const int64_t width = (heads + 2 * kv_heads) * head_dim, attn_width = heads * head_dim;                  \
        T *x = work, *h2 = x + rows * hidden, *qkv = h2 + rows * hidden, *attn = qkv + rows * width;             \
        T *gate_up = attn + rows * attn_width, *act = gate_up + rows * 2 * inter;                                 \
        for (int64_t l = 0; l < num_layers; l++) {                                                                \
            const int64_t *p = layers + l * LAYER_POINTERS;                                                       \
            T *k_cache = (T *)p[K_CACHE], *v_cache = (T *)p[V_CACHE];                                             \
            rms_norm_##SUFFIX(h, (const T *)p[LN1], eps[2 * l], rows, hidden, x, threads);                         \
            gemm_##SUFFIX(x, rows, hidden, hidden, (const T *)p[QKV], width, NULL, qkv, threads);                  \
            rotary_##SUFFIX(qkv, rows, width, heads + kv_heads, head_dim, cos, sin, threads);                     \
            for (int64_t r = 0; r < rows; r++) /* the new keys and values, before any row reads them */          \
                for (int64_t g = 0; g < kv_heads; g++) {                                                          \
                    const T *k = qkv + r * width + (heads + g) * head_dim, *v = k + kv_heads * head_dim;         \
                    const int64_t at = (g * num_slots + slot_mapping[r]) * head_dim;                              \
                    memcpy(k_cache + at, k, head_dim * sizeof(T));                                                \
                    memcpy(v_cache + at, v, head_dim * sizeof(T));                                                \
                }                                                                                                 \
            paged_attend_##SUFFIX(qkv, width, head_dim, k_cache, v_cache, block_tables, table_width, ctx_lens,   \
                                  rows, cold_rows, heads, kv_heads, head_dim, block_size, num_slots, scale, attn, \
                                  threads);                                                                       \
            gemm_##SUFFIX(attn, rows, attn_width, attn_width, (const T *)p[O], hidden, h, h2, threads);           \
            rms_norm_##SUFFIX(h2, (const T *)p[LN2], eps[2 * l + 1], rows, hidden, x, threads);                    \
            gemm_##SUFFIX(x, rows, hidden, hidden, (const T *)p[GATE_UP], 2 * inter, NULL, gate_up, threads);      \
            silu_mul_##SUFFIX(gate_up, rows, inter, act, threads);                                                \
            gemm_##SUFFIX(act, rows, inter, inter, (const T *)p[DOWN], hidden, h2, h, threads);                   \
        }                                                                                                         \
    }

DEFINE_DECODER_LAYERS(f32, float)
#ifdef __AVX512BF16__ /* where gemm_bf16 is built */
DEFINE_DECODER_LAYERS(bf16, bf16_t)
#endif
