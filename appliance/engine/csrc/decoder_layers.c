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
 *
 * The whole step is one OpenMP parallel region: each thread runs its share of every kernel (the
 * GEMMs' panels, the elementwise kernels' rows, the attention's (row, KV head) items as it claims
 * them; the kernels' _part functions), with a barrier wherever the next kernel reads what another
 * thread wrote. Called one by one, each GEMM and attention opened a team of its own (up to 150
 * forks and joins a step) and the elementwise kernels ran on the calling thread alone while the
 * others waited: in lockstep with that way on the same requests (AMD EPYC Zen 5, 2 threads),
 * skewed-64 took 0.95-0.98x its time in bfloat16 and 0.985x in float32, steady decode at 16 and 64
 * rows 0.96-0.99x. As with the forks and joins, a thread taken off its core by another process
 * holds the others at the next barrier.
 *
 * Layout of `layers`: per layer LAYER_POINTERS addresses (ln1, ln2, qkv, o, gate_up, down: the
 * norms' weights and the own GEMM's packed copies; then the layer's K and V caches: the order
 * fast_llama.py's table lists them in), and `eps` two floats per layer. `h` [rows, hidden] is
 * updated in place; `work` holds rows * (2 hidden + qkv width + heads * head_dim + 3 inter)
 * values (LayerShape.work_size). */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16_t;

enum { LN1, LN2, QKV, O, GATE_UP, DOWN, K_CACHE, V_CACHE, LAYER_POINTERS };

int64_t decoder_layer_pointers(void) { return LAYER_POINTERS; }

void attend_plan_free(void *plan);

#define DEFINE_DECODER_LAYERS(SUFFIX, T)                                                                          \
    void rms_norm_##SUFFIX##_part(const T *x, const T *weight, float eps, int64_t rows, int64_t dim, T *out,      \
                                  int64_t t, int64_t nt);                                                          \
    void rotary_##SUFFIX##_part(T *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t dim, const T *cos, \
                                const T *sin, int64_t t, int64_t nt);                                              \
    void silu_mul_##SUFFIX##_part(const T *gate_up, int64_t rows, int64_t inter, T *out, int64_t t, int64_t nt);  \
    void gemm_##SUFFIX##_part(const T *x, int64_t m, int64_t k, int64_t ldx, const T *packed, int64_t n,          \
                              const T *res, T *y, int64_t t, int64_t nt);                                          \
    void *paged_attend_##SUFFIX##_plan(const int64_t *block_tables, int64_t table_width, const int64_t *ctx_lens,  \
                                       int64_t rows, int64_t cold_rows, int64_t kv_heads, int64_t head_dim);      \
    void paged_attend_##SUFFIX##_part(const T *q, int64_t q_row_stride, int64_t q_head_stride, const T *k_cache,  \
                                      const T *v_cache, const int64_t *block_tables, int64_t table_width,        \
                                      const int64_t *ctx_lens, int64_t cold_rows, int64_t num_heads,             \
                                      int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t num_slots,  \
                                      float scale, T *out, const void *plan, int64_t *claimed);                   \
    int decoder_layers_##SUFFIX(T *h, int64_t rows, int64_t hidden, int64_t num_layers, const int64_t *layers,   \
                                const float *eps, int64_t heads, int64_t kv_heads, int64_t head_dim,              \
                                int64_t inter, const T *cos, const T *sin, const int64_t *slot_mapping,           \
                                const int64_t *block_tables, int64_t table_width, const int64_t *ctx_lens,        \
                                int64_t cold_rows, int64_t block_size, int64_t num_slots, float scale, T *work,   \
                                int64_t threads) {                                                                \
        const int64_t width = (heads + 2 * kv_heads) * head_dim, attn_width = heads * head_dim;                  \
        T *x = work, *h2 = x + rows * hidden, *qkv = h2 + rows * hidden, *attn = qkv + rows * width;             \
        T *gate_up = attn + rows * attn_width, *act = gate_up + rows * 2 * inter;                                 \
        /* the rows' attention work, the same in every layer; each layer's two claim counters */                 \
        void *plan = paged_attend_##SUFFIX##_plan(block_tables, table_width, ctx_lens, rows, cold_rows, kv_heads, \
                                                  head_dim);                                                      \
        int64_t *claimed = calloc(2 * num_layers + 2, sizeof(int64_t)); /* never 0 bytes */                     \
        if (!plan || !claimed) {                                                                                  \
            attend_plan_free(plan);                                                                               \
            free(claimed);                                                                                        \
            return -1;                                                                                            \
        }                                                                                                         \
        _Pragma("omp parallel num_threads(threads)") {                                                            \
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();                                   \
            for (int64_t l = 0; l < num_layers; l++) {                                                            \
                const int64_t *p = layers + l * LAYER_POINTERS;                                                   \
                T *k_cache = (T *)p[K_CACHE], *v_cache = (T *)p[V_CACHE];                                         \
                rms_norm_##SUFFIX##_part(h, (const T *)p[LN1], eps[2 * l], rows, hidden, x, t, nt);                \
                _Pragma("omp barrier")                                                                            \
                gemm_##SUFFIX##_part(x, rows, hidden, hidden, (const T *)p[QKV], width, NULL, qkv, t, nt);         \
                _Pragma("omp barrier")                                                                            \
                rotary_##SUFFIX##_part(qkv, rows, width, heads + kv_heads, head_dim, cos, sin, t, nt);             \
                _Pragma("omp barrier")                                                                            \
                /* the new keys and values, by one thread in row order, as the loop's index_copy_ writes them: \
                 * static batching's padding rows all map to the scratch slot, and the last one's is kept */     \
                if (t == 0)                                                                                       \
                    for (int64_t r = 0; r < rows; r++)                                                            \
                        for (int64_t g = 0; g < kv_heads; g++) {                                                  \
                            const T *k = qkv + r * width + (heads + g) * head_dim, *v = k + kv_heads * head_dim; \
                            const int64_t at = (g * num_slots + slot_mapping[r]) * head_dim;                      \
                            memcpy(k_cache + at, k, head_dim * sizeof(T));                                        \
                            memcpy(v_cache + at, v, head_dim * sizeof(T));                                        \
                        }                                                                                         \
                _Pragma("omp barrier") /* every new key and value is in the cache before any row reads it */     \
                paged_attend_##SUFFIX##_part(qkv, width, head_dim, k_cache, v_cache, block_tables, table_width,   \
                                             ctx_lens, cold_rows, heads, kv_heads, head_dim, block_size,         \
                                             num_slots, scale, attn, plan, claimed + 2 * l);                      \
                _Pragma("omp barrier")                                                                            \
                gemm_##SUFFIX##_part(attn, rows, attn_width, attn_width, (const T *)p[O], hidden, h, h2, t, nt);   \
                _Pragma("omp barrier")                                                                            \
                rms_norm_##SUFFIX##_part(h2, (const T *)p[LN2], eps[2 * l + 1], rows, hidden, x, t, nt);           \
                _Pragma("omp barrier")                                                                            \
                gemm_##SUFFIX##_part(x, rows, hidden, hidden, (const T *)p[GATE_UP], 2 * inter, NULL, gate_up, t, nt); \
                _Pragma("omp barrier")                                                                            \
                silu_mul_##SUFFIX##_part(gate_up, rows, inter, act, t, nt);                                        \
                _Pragma("omp barrier")                                                                            \
                gemm_##SUFFIX##_part(act, rows, inter, inter, (const T *)p[DOWN], hidden, h2, h, t, nt);           \
                _Pragma("omp barrier")                                                                            \
            }                                                                                                     \
        }                                                                                                         \
        attend_plan_free(plan);                                                                                   \
        free(claimed);                                                                                            \
        return 0;                                                                                                 \
    }

DEFINE_DECODER_LAYERS(f32, float)
DEFINE_DECODER_LAYERS(bf16, bf16_t)
