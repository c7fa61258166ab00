/* CPU kernels for bf16 models on CPUs without native bf16 arithmetic (AVX512F, no AVX512-BF16/AMX).
 *
 * There, oneDNN and MKL emulate bf16 matmuls at a fraction of fp32 speed, and small-batch fp32 GEMMs
 * are poorly blocked. This linear reads the bf16 weights as they are stored (row-major [N, K], so tied
 * embeddings stay shared) and widens them to fp32 in registers: one 512-bit load holds 32 bf16 weights
 * as 16 32-bit words; `word << 16` is the even element as fp32 and `word & 0xffff0000` the odd one.
 * The activations are widened once per call into the matching even/odd order, so every FMA is a plain
 * fp32 FMA and a row's dot product is summed in the same order whatever the batch (batch-invariant).
 *
 * Built once per machine by `cpu_kernels.py` (gcc -O3 -mavx512f -fopenmp) and called through ctypes.
 * OpenMP here resolves to the libgomp that torch already loaded (same soname), so the two share one
 * thread pool instead of fighting over the two cores.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 4          /* output rows per register tile */
#define TOKENS 4        /* tokens per register tile */
#define ROW_BLOCK 64    /* rows whose weights stay in L2 while every token tile passes over them */

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40); /* quiet NaN */
    bits += 0x7fff + ((bits >> 16) & 1); /* round to nearest even, as torch's bf16 casts do */
    return (uint16_t)(bits >> 16);
}

/* x [K] bf16 -> xp [K] fp32, each 32-element chunk as its 16 even elements then its 16 odd ones. */
static void widen_deinterleave(const uint16_t *x, float *xp, int K) {
    for (int c = 0; c < K; c += 32)
        for (int j = 0; j < 16; ++j) {
            xp[c + j] = bf16_to_float(x[c + 2 * j]);
            xp[c + 16 + j] = bf16_to_float(x[c + 2 * j + 1]);
        }
}

/* acc[r][t] = sum_k w[r][k] * x[t][k] for `rows` x `tokens` (both compile-time after inlining). */
static inline __attribute__((always_inline)) void tile(const uint16_t *w, const float *xp, int K, int rows,
                                                      int tokens, float out[ROWS][TOKENS]) {
    __m512 acc[ROWS][TOKENS];
    const __m512i odd_mask = _mm512_set1_epi32((int)0xffff0000u);
    for (int r = 0; r < rows; ++r)
        for (int t = 0; t < tokens; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        __m512 even[ROWS], odd[ROWS];
        for (int r = 0; r < rows; ++r) {
            _mm_prefetch((const char *)(w + (size_t)r * K + k) + 4 * K * 2, _MM_HINT_T0); __m512i words = _mm512_loadu_si512((const void *)(w + (size_t)r * K + k));
            even[r] = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
            odd[r] = _mm512_castsi512_ps(_mm512_and_si512(words, odd_mask));
        }
        for (int t = 0; t < tokens; ++t) {
            __m512 xe = _mm512_loadu_ps(xp + (size_t)t * K + k);
            __m512 xo = _mm512_loadu_ps(xp + (size_t)t * K + k + 16);
            for (int r = 0; r < rows; ++r) {
                acc[r][t] = _mm512_fmadd_ps(even[r], xe, acc[r][t]);
                acc[r][t] = _mm512_fmadd_ps(odd[r], xo, acc[r][t]);
            }
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int t = 0; t < tokens; ++t) out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
}

/* Dispatch to a tile specialized for its shape (full tiles are the hot path). */
static void run_tile(const uint16_t *w, const float *xp, int K, int rows, int tokens, float out[ROWS][TOKENS]) {
#define CASE(R, T) if (rows == R && tokens == T) { tile(w, xp, K, R, T, out); return; }
    CASE(4, 4) CASE(4, 3) CASE(4, 2) CASE(4, 1)
    CASE(3, 4) CASE(3, 3) CASE(3, 2) CASE(3, 1)
    CASE(2, 4) CASE(2, 3) CASE(2, 2) CASE(2, 1)
    CASE(1, 4) CASE(1, 3) CASE(1, 2) CASE(1, 1)
#undef CASE
}

/* y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]); all bf16, fp32 accumulation, one rounding at the end.
 * K must be a multiple of 32 (the caller checks). Returns 0, or -1 if scratch memory ran out. */
int linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int M, int N, int K,
                int num_threads) {
    if (M == 0 || N == 0) return 0;
    float *xp = aligned_alloc(64, ((size_t)M * K * sizeof(float) + 63) / 64 * 64);
    if (xp == NULL) return -1;
    for (int m = 0; m < M; ++m) widen_deinterleave(x + (size_t)m * K, xp + (size_t)m * K, K);
    int blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && blocks > 1)
    for (int b = 0; b < blocks; ++b) {
        int n_end = (b + 1) * ROW_BLOCK < N ? (b + 1) * ROW_BLOCK : N;
        for (int m = 0; m < M; m += TOKENS) {
            int tokens = M - m < TOKENS ? M - m : TOKENS;
            for (int n = b * ROW_BLOCK; n < n_end; n += ROWS) {
                int rows = n_end - n < ROWS ? n_end - n : ROWS;
                float out[ROWS][TOKENS];
                run_tile(w + (size_t)n * K, xp + (size_t)m * K, K, rows, tokens, out);
                for (int r = 0; r < rows; ++r) {
                    float b_r = bias ? bf16_to_float(bias[n + r]) : 0.0f;
                    for (int t = 0; t < tokens; ++t) y[(size_t)(m + t) * N + n + r] = float_to_bf16(out[r][t] + b_r);
                }
            }
        }
    }
    free(xp);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------
 * The small ops of a decode step. Each replaces several torch ops whose fixed cost per call (5-100 us
 * on these cores) dominates at batch 1, and each rounds to bf16 where the torch path does, so the two
 * paths agree to bf16 rounding.
 */

static inline __m512 widen16(const uint16_t *p) { /* 16 bf16 -> 16 fp32, in order */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 round_bf16_ps(__m512 v) { /* fp32 -> nearest bf16, kept in fp32 (finite inputs) */
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32((int)0xffff0000u)));
}

static inline void store16(uint16_t *p, __m512 v) { /* fp32 (already bf16-rounded) -> 16 bf16 */
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16_ps(v)), 16)));
}

/* h [T, D] += delta (rounded to bf16, in place; delta may be NULL), then
 * y = bf16(w * bf16(h * rsqrt(mean(h^2) + eps))): RMSNorm in fp32 as the reference computes it. D % 16 == 0. */
void add_rms_norm_bf16(uint16_t *h, const uint16_t *delta, const uint16_t *w, uint16_t *y, int T, int D, float eps,
                       int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && T >= 16)
    for (int t = 0; t < T; ++t) {
        uint16_t *ht = h + (size_t)t * D;
        __m512 ss = _mm512_setzero_ps();
        for (int i = 0; i < D; i += 16) {
            __m512 v = widen16(ht + i);
            if (delta) {
                v = round_bf16_ps(_mm512_add_ps(v, widen16(delta + (size_t)t * D + i)));
                store16(ht + i, v);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / D + eps));
        for (int i = 0; i < D; i += 16) {
            __m512 normed = round_bf16_ps(_mm512_mul_ps(widen16(ht + i), inv));
            store16(y + (size_t)t * D + i, _mm512_mul_ps(widen16(w + i), normed));
        }
    }
}

/* gate_up [T, 2I] -> y [T, I] = bf16(bf16(silu(gate)) * up), as torch's bf16 silu then mul. I % 16 == 0. */
static inline __m512 exp_ps(__m512 x);
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *y, int T, int I, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && T >= 16)
    for (int t = 0; t < T; ++t)
        for (int i = 0; i < I; i += 16) {
            __m512 g = widen16(gate_up + (size_t)t * 2 * I + i);
            __m512 u = widen16(gate_up + (size_t)t * 2 * I + I + i);
            __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
            __m512 s = round_bf16_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            store16(y + (size_t)t * I + i, _mm512_mul_ps(s, u));
        }
}

/* qkv [T, (H + 2 Hkv) D]: RoPE on the q and k heads in place (x * cos + roll(x, D/2) * sin_signed, each
 * product and the sum rounded to bf16 as in torch), then k and v written to their cache slots. */
void rope_and_cache_bf16(uint16_t *qkv, const int64_t *positions, const uint16_t *cos_table,
                         const uint16_t *sin_table, uint16_t *k_cache, uint16_t *v_cache,
                         const int64_t *slots, int T, int H, int Hkv, int D) {
    int width = (H + 2 * Hkv) * D, half = D / 2;
    for (int t = 0; t < T; ++t) {
        uint16_t *row = qkv + (size_t)t * width;
        const uint16_t *cs = cos_table + positions[t] * D, *sn = sin_table + positions[t] * D;
        for (int head = 0; head < H + Hkv; ++head) {
            uint16_t *x = row + head * D;
            uint16_t rotated[512];
            for (int i = 0; i < D; i += 16) {
                int j = (i + half) % D; /* roll by D/2: element i comes from i - D/2 (mod D) */
                __m512 a = round_bf16_ps(_mm512_mul_ps(widen16(x + i), widen16(cs + i)));
                __m512 b = round_bf16_ps(_mm512_mul_ps(widen16(x + j), widen16(sn + i)));
                store16(rotated + i, _mm512_add_ps(a, b));
            }
            memcpy(x, rotated, D * sizeof(uint16_t));
        }
        memcpy(k_cache + slots[t] * Hkv * D, row + H * D, (size_t)Hkv * D * sizeof(uint16_t));
        memcpy(v_cache + slots[t] * Hkv * D, row + (H + Hkv) * D, (size_t)Hkv * D * sizeof(uint16_t));
    }
}

/* exp for the softmax: 2^n * p(r), r = x - n ln2, degree-6 polynomial (about 1 ulp); x <= 0 here. */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* One query token against its context in the paged cache, for the `group` query heads that share
 * kv head `kvh`: out = softmax(q k^T * scale) v in fp32, rounded to bf16 once. scores: scratch [group][L]. */
static void decode_one(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *table,
                       int L, int kvh, int group, int Hkv, int D, int block_size, float scale, float *scores,
                       uint16_t *out) {
    float qf[8][256], acc[8][256];
    for (int g = 0; g < group; ++g)
        for (int d = 0; d < D; ++d) { qf[g][d] = bf16_to_float(q[g * D + d]) * scale; acc[g][d] = 0.0f; }
    for (int p = 0; p < L; ++p) {
        const uint16_t *k = k_cache + ((table[p / block_size] * block_size + p % block_size) * Hkv + kvh) * D;
        for (int g = 0; g < group; ++g) {
            __m512 s = _mm512_setzero_ps();
            for (int d = 0; d < D; d += 16) s = _mm512_fmadd_ps(widen16(k + d), _mm512_loadu_ps(qf[g] + d), s);
            scores[g * L + p] = _mm512_reduce_add_ps(s);
        }
    }
    for (int g = 0; g < group; ++g) {
        float *sc = scores + g * L, max = -INFINITY, sum = 0.0f;
        for (int p = 0; p < L; ++p) max = sc[p] > max ? sc[p] : max;
        int p = 0;
        __m512 vsum = _mm512_setzero_ps();
        for (; p + 16 <= L; p += 16) {
            __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sc + p), _mm512_set1_ps(max)));
            _mm512_storeu_ps(sc + p, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        if (p < L) {
            __mmask16 m = (__mmask16)((1u << (L - p)) - 1);
            __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + p), _mm512_set1_ps(max)));
            e = _mm512_maskz_mov_ps(m, e);
            _mm512_mask_storeu_ps(sc + p, m, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        sum = _mm512_reduce_add_ps(vsum);
        for (int i = 0; i < L; ++i) sc[i] /= sum;
    }
    for (int p = 0; p < L; ++p) {
        const uint16_t *v = v_cache + ((table[p / block_size] * block_size + p % block_size) * Hkv + kvh) * D;
        for (int d = 0; d < D; d += 16) {
            __m512 vv = widen16(v + d);
            for (int g = 0; g < group; ++g)
                _mm512_storeu_ps(acc[g] + d, _mm512_fmadd_ps(_mm512_set1_ps(scores[g * L + p]), vv,
                                                             _mm512_loadu_ps(acc[g] + d)));
        }
    }
    for (int g = 0; g < group; ++g)
        for (int d = 0; d < D; d += 16) store16(out + g * D + d, _mm512_loadu_ps(acc[g] + d));
}

/* Attention of B single-token queries over the paged cache. q: row b at q + b * q_stride, [H, D];
 * caches [slots, Hkv, D]; tables [B, max_blocks]; lens [B]; out [B, H, D]. Needs D % 16 == 0,
 * D <= 256, H / Hkv <= 8. Returns 0, or -1 if scratch memory ran out. */
int paged_decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                                const int64_t *tables, int max_blocks, const int64_t *lens, uint16_t *out, int B,
                                int H, int Hkv, int D, int block_size, float scale, int num_threads) {
    int group = H / Hkv, failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads) if (num_threads > 1 && B * Hkv > 1)
    for (int task = 0; task < B * Hkv; ++task) {
        int b = task / Hkv, kvh = task % Hkv, L = (int)lens[b];
        float *scores = malloc((size_t)group * L * sizeof(float));
        if (scores == NULL) { failed = 1; continue; }
        decode_one(q + b * q_stride + (size_t)kvh * group * D, k_cache, v_cache, tables + (size_t)b * max_blocks, L,
                   kvh, group, Hkv, D, block_size, scale, scores, out + ((size_t)b * H + (size_t)kvh * group) * D);
        free(scores);
    }
    return failed ? -1 : 0;
}
