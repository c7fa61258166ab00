/* CPU kernels for bf16 models on CPUs without native bf16 arithmetic (AVX512F or AVX2+FMA, no
 * AVX512-BF16/AMX).
 *
 * There, oneDNN and MKL emulate bf16 matmuls at a fraction of fp32 speed (on AVX2-only CPUs oneDNN
 * cannot even pre-pack bf16 weights), and small-batch fp32 GEMMs are poorly blocked. This linear reads
 * the bf16 weights as they are stored (row-major [N, K], so tied embeddings stay shared) and widens them
 * to fp32 in registers: one vector load holds 2 * LANES bf16 weights as LANES 32-bit words;
 * `word << 16` is the even element as fp32 and `word & 0xffff0000` the odd one. The activations are
 * widened once per call into the matching even/odd order, so every FMA is a plain fp32 FMA and a row's
 * dot product is summed in the same order whatever the batch (batch-invariant).
 *
 * One source for both instruction sets: the few vector operations the kernels need are defined below
 * for AVX512F (16 lanes) and AVX2 (8 lanes), chosen by the compiler flags `cpu_kernels.py` passes.
 * Built once per machine (gcc -O3 -mavx512f or -mavx2 -mfma, -fopenmp) and called through ctypes.
 * OpenMP here resolves to the libgomp that torch already loaded (same soname), so the two share one
 * thread pool instead of fighting over the two cores.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vf;
typedef __m512i vi;
#define vf_zero _mm512_setzero_ps
#define vf_set1 _mm512_set1_ps
#define vf_load _mm512_loadu_ps
#define vf_store _mm512_storeu_ps
#define vf_add _mm512_add_ps
#define vf_sub _mm512_sub_ps
#define vf_mul _mm512_mul_ps
#define vf_div _mm512_div_ps
#define vf_max _mm512_max_ps
#define vf_min _mm512_min_ps
#define vf_fma _mm512_fmadd_ps
#define vf_fnma _mm512_fnmadd_ps
#define vf_as_vi _mm512_castps_si512
#define vi_as_vf _mm512_castsi512_ps
#define vi_load(p) _mm512_loadu_si512((const void *)(p))
#define vi_set1 _mm512_set1_epi32
#define vi_and _mm512_and_si512
#define vi_add _mm512_add_epi32
#define vi_shl _mm512_slli_epi32
#define vi_shr _mm512_srli_epi32
#define vf_round_to_vi(v) _mm512_cvtps_epi32(v) /* nearest, ties to even (default MXCSR) */
#define vi_to_vf _mm512_cvtepi32_ps
static inline float vf_sum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vi widen_u16(const uint16_t *p) { return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)); }
static inline void narrow_u16(uint16_t *p, vi v) { _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(v)); }
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vf;
typedef __m256i vi;
#define vf_zero _mm256_setzero_ps
#define vf_set1 _mm256_set1_ps
#define vf_load _mm256_loadu_ps
#define vf_store _mm256_storeu_ps
#define vf_add _mm256_add_ps
#define vf_sub _mm256_sub_ps
#define vf_mul _mm256_mul_ps
#define vf_div _mm256_div_ps
#define vf_max _mm256_max_ps
#define vf_min _mm256_min_ps
#define vf_fma _mm256_fmadd_ps
#define vf_fnma _mm256_fnmadd_ps
#define vf_as_vi _mm256_castps_si256
#define vi_as_vf _mm256_castsi256_ps
#define vi_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define vi_set1 _mm256_set1_epi32
#define vi_and _mm256_and_si256
#define vi_add _mm256_add_epi32
#define vi_shl _mm256_slli_epi32
#define vi_shr _mm256_srli_epi32
#define vf_round_to_vi(v) _mm256_cvtps_epi32(v)
#define vi_to_vf _mm256_cvtepi32_ps
static inline float vf_sum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline vi widen_u16(const uint16_t *p) { return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline void narrow_u16(uint16_t *p, vi v) { /* values <= 0xffff: unsigned saturation keeps them */
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}
#else
#error "cpu_kernels.c needs AVX512F or AVX2 with FMA"
#endif

#define CHUNK (2 * LANES) /* bf16 weights per vector load */
/* A 4 x 4 register tile: best of 1-8 rows x 1-4 tokens on both ISAs (measured with
 * benchmarks/cpu_kernels.py; on AVX2 the compiler takes activations as memory operands of the FMAs). */
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

/* x [K] bf16 -> xp [K] fp32, each CHUNK-element chunk as its LANES even elements then its LANES odd ones. */
static void widen_deinterleave(const uint16_t *x, float *xp, int K) {
    for (int c = 0; c < K; c += CHUNK)
        for (int j = 0; j < LANES; ++j) {
            xp[c + j] = bf16_to_float(x[c + 2 * j]);
            xp[c + LANES + j] = bf16_to_float(x[c + 2 * j + 1]);
        }
}

/* acc[r][t] = sum_k w[r][k] * x[t][k] for `rows` x `tokens` (both compile-time after inlining). */
static inline __attribute__((always_inline)) void tile(const uint16_t *w, const float *xp, int K, int rows,
                                                      int tokens, float out[ROWS][TOKENS]) {
    vf acc[ROWS][TOKENS];
    const vi odd_mask = vi_set1((int)0xffff0000u);
    for (int r = 0; r < rows; ++r)
        for (int t = 0; t < tokens; ++t) acc[r][t] = vf_zero();
    for (int k = 0; k < K; k += CHUNK) {
        vf even[ROWS], odd[ROWS];
        for (int r = 0; r < rows; ++r) {
            const uint16_t *wr = w + (size_t)r * K + k;
            _mm_prefetch((const char *)wr + ROWS * K * 2, _MM_HINT_T0); /* the next tile's row */
            vi words = vi_load(wr);
            even[r] = vi_as_vf(vi_shl(words, 16));
            odd[r] = vi_as_vf(vi_and(words, odd_mask));
        }
        for (int t = 0; t < tokens; ++t) {
            vf xe = vf_load(xp + (size_t)t * K + k);
            vf xo = vf_load(xp + (size_t)t * K + k + LANES);
            for (int r = 0; r < rows; ++r) {
                acc[r][t] = vf_fma(even[r], xe, acc[r][t]);
                acc[r][t] = vf_fma(odd[r], xo, acc[r][t]);
            }
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int t = 0; t < tokens; ++t) out[r][t] = vf_sum(acc[r][t]);
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
 * paths agree to bf16 rounding. Vector widths must divide the model's dimensions (checked in Python).
 */

static inline vf widen(const uint16_t *p) { /* LANES bf16 -> LANES fp32, in order */
    return vi_as_vf(vi_shl(widen_u16(p), 16));
}

static inline vf round_bf16_ps(vf v) { /* fp32 -> nearest bf16, kept in fp32 (finite inputs) */
    vi bits = vf_as_vi(v);
    vi lsb = vi_and(vi_shr(bits, 16), vi_set1(1));
    bits = vi_add(bits, vi_add(lsb, vi_set1(0x7fff)));
    return vi_as_vf(vi_and(bits, vi_set1((int)0xffff0000u)));
}

static inline void store_bf16(uint16_t *p, vf v) { /* fp32 -> LANES bf16, rounded to nearest even */
    narrow_u16(p, vi_shr(vf_as_vi(round_bf16_ps(v)), 16));
}

/* exp for the softmax and silu: 2^n * p(r), r = x - n ln2, degree-6 polynomial (about 1 ulp). Inputs are
 * clamped to [-87, 88] so 2^n stays a normal float, built directly in its exponent bits. */
static inline vf exp_ps(vf x) {
    x = vf_max(x, vf_set1(-87.0f));
    x = vf_min(x, vf_set1(88.0f));
    vi n = vf_round_to_vi(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf nf = vi_to_vf(n);
    vf r = vf_fnma(nf, vf_set1(0.693359375f), x);
    r = vf_fnma(nf, vf_set1(-2.12194440e-4f), r);
    vf p = vf_set1(1.0f / 720);
    p = vf_fma(p, r, vf_set1(1.0f / 120));
    p = vf_fma(p, r, vf_set1(1.0f / 24));
    p = vf_fma(p, r, vf_set1(1.0f / 6));
    p = vf_fma(p, r, vf_set1(0.5f));
    p = vf_fma(p, r, vf_set1(1.0f));
    p = vf_fma(p, r, vf_set1(1.0f));
    return vf_mul(p, vi_as_vf(vi_shl(vi_add(n, vi_set1(127)), 23)));
}

/* h [T, D] += delta (rounded to bf16, in place; delta may be NULL), then
 * y = bf16(w * bf16(h * rsqrt(mean(h^2) + eps))): RMSNorm in fp32 as the reference computes it. D % LANES == 0. */
void add_rms_norm_bf16(uint16_t *h, const uint16_t *delta, const uint16_t *w, uint16_t *y, int T, int D, float eps,
                       int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && T >= 16)
    for (int t = 0; t < T; ++t) {
        uint16_t *ht = h + (size_t)t * D;
        vf ss = vf_zero();
        for (int i = 0; i < D; i += LANES) {
            vf v = widen(ht + i);
            if (delta) {
                v = round_bf16_ps(vf_add(v, widen(delta + (size_t)t * D + i)));
                store_bf16(ht + i, v);
            }
            ss = vf_fma(v, v, ss);
        }
        vf inv = vf_set1(1.0f / sqrtf(vf_sum(ss) / D + eps));
        for (int i = 0; i < D; i += LANES) {
            vf normed = round_bf16_ps(vf_mul(widen(ht + i), inv));
            store_bf16(y + (size_t)t * D + i, vf_mul(widen(w + i), normed));
        }
    }
}

/* gate_up [T, 2I] -> y [T, I] = bf16(bf16(silu(gate)) * up), as torch's bf16 silu then mul. I % LANES == 0. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *y, int T, int I, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && T >= 16)
    for (int t = 0; t < T; ++t)
        for (int i = 0; i < I; i += LANES) {
            vf g = widen(gate_up + (size_t)t * 2 * I + i);
            vf u = widen(gate_up + (size_t)t * 2 * I + I + i);
            vf e = exp_ps(vf_sub(vf_zero(), g));
            vf s = round_bf16_ps(vf_div(g, vf_add(vf_set1(1.0f), e)));
            store_bf16(y + (size_t)t * I + i, vf_mul(s, u));
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
            for (int i = 0; i < D; i += LANES) {
                int j = (i + half) % D; /* roll by D/2: element i comes from i - D/2 (mod D) */
                vf a = round_bf16_ps(vf_mul(widen(x + i), widen(cs + i)));
                vf b = round_bf16_ps(vf_mul(widen(x + j), widen(sn + i)));
                store_bf16(rotated + i, vf_add(a, b));
            }
            memcpy(x, rotated, D * sizeof(uint16_t));
        }
        memcpy(k_cache + slots[t] * Hkv * D, row + H * D, (size_t)Hkv * D * sizeof(uint16_t));
        memcpy(v_cache + slots[t] * Hkv * D, row + (H + Hkv) * D, (size_t)Hkv * D * sizeof(uint16_t));
    }
}

/* Decode attention is split over fixed partitions of a context's positions (flash-decoding): a long
 * context's partitions run on every thread, even at batch 1, and each reads whole cache rows (all kv
 * heads of a slot, contiguous) instead of one head's slice of each. The partition size is fixed, so a
 * sequence's result depends on its context alone, not on the batch or the thread count. */
#define DECODE_PART 256

/* Positions [p0, p0 + n) of one query token's context, all H query heads: acc [H][D] gets the
 * partition's unnormalized softmax(q k^T * scale) v, m [H] each head's largest score and l [H] its sum
 * of exp(score - m). Scratch: qf [H][D], scores [H][DECODE_PART]. */
static void decode_partition(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                             const int64_t *table, int p0, int n, int H, int Hkv, int D, int block_size,
                             float scale, float *qf, float *scores, float *m, float *l, float *acc) {
    int group = H / Hkv;
    size_t row = (size_t)Hkv * D;
    for (int i = 0; i < H * D; ++i) qf[i] = bf16_to_float(q[i]) * scale;
    for (int i = 0; i < n; ++i) {
        int p = p0 + i;
        const uint16_t *k = k_cache + (table[p / block_size] * block_size + p % block_size) * row;
        for (int h = 0; h < H; ++h) {
            const uint16_t *kh = k + (size_t)(h / group) * D;
            vf s = vf_zero();
            for (int d = 0; d < D; d += LANES) s = vf_fma(widen(kh + d), vf_load(qf + h * D + d), s);
            scores[h * DECODE_PART + i] = vf_sum(s);
        }
    }
    for (int h = 0; h < H; ++h) {
        float *sc = scores + h * DECODE_PART, max = -INFINITY;
        for (int i = 0; i < n; ++i) max = sc[i] > max ? sc[i] : max;
        int i = 0;
        vf vsum = vf_zero();
        for (; i + LANES <= n; i += LANES) {
            vf e = exp_ps(vf_sub(vf_load(sc + i), vf_set1(max)));
            vf_store(sc + i, e);
            vsum = vf_add(vsum, e);
        }
        if (i < n) { /* the tail through a buffer padded with -inf, whose exp adds nothing */
            float tail[LANES];
            for (int j = 0; j < LANES; ++j) tail[j] = i + j < n ? sc[i + j] - max : -INFINITY;
            vf e = exp_ps(vf_load(tail));
            vf_store(tail, e);
            for (int j = 0; j < LANES; ++j) if (i + j >= n) tail[j] = 0.0f;
            for (int j = 0; i + j < n; ++j) sc[i + j] = tail[j];
            vsum = vf_add(vsum, vf_load(tail));
        }
        m[h] = max;
        l[h] = vf_sum(vsum);
    }
    memset(acc, 0, (size_t)H * D * sizeof(float));
    for (int i = 0; i < n; ++i) {
        int p = p0 + i;
        const uint16_t *v = v_cache + (table[p / block_size] * block_size + p % block_size) * row;
        for (int kvh = 0; kvh < Hkv; ++kvh)
            for (int d = 0; d < D; d += LANES) {
                vf vv = widen(v + (size_t)kvh * D + d); /* widened once for the heads sharing it */
                for (int g = 0; g < group; ++g) {
                    int h = kvh * group + g;
                    float *a = acc + h * D + d;
                    vf_store(a, vf_fma(vf_set1(scores[h * DECODE_PART + i]), vv, vf_load(a)));
                }
            }
    }
}

/* Attention of B single-token queries over the paged cache. q: row b at q + b * q_stride, [H, D];
 * caches [slots, Hkv, D]; tables [B, max_blocks]; lens [B] (each >= 1); out [B, H, D]. Needs D % LANES == 0
 * and D <= 256. Every partition's result, then per (sequence, head) their combination in partition order, rounded
 * to bf16 once. Returns 0, or -1 if scratch memory ran out. */
int paged_decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                                const int64_t *tables, int max_blocks, const int64_t *lens, uint16_t *out, int B,
                                int H, int Hkv, int D, int block_size, float scale, int num_threads) {
    int *first = malloc((size_t)(B + 1) * sizeof(int)); /* sequence b's partitions: [first[b], first[b + 1]) */
    if (first == NULL) return -1;
    first[0] = 0;
    for (int b = 0; b < B; ++b) first[b + 1] = first[b] + (int)((lens[b] + DECODE_PART - 1) / DECODE_PART);
    int parts = first[B], failed = 0;
    size_t per_part = (size_t)H * (D + 2); /* acc [H][D], then m [H], then l [H] */
    float *partial = malloc((size_t)parts * per_part * sizeof(float));
    if (partial == NULL) { free(first); return -1; }
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && parts > 1)
    {
        float *scratch = malloc((size_t)H * (D + DECODE_PART) * sizeof(float)); /* qf, then scores */
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int j = 0; j < parts; ++j) {
            if (scratch == NULL) continue;
            int b = 0;
            while (first[b + 1] <= j) ++b;
            int p0 = (j - first[b]) * DECODE_PART, L = (int)lens[b];
            int n = L - p0 < DECODE_PART ? L - p0 : DECODE_PART;
            float *acc = partial + (size_t)j * per_part;
            decode_partition(q + b * q_stride, k_cache, v_cache, tables + (size_t)b * max_blocks, p0, n, H, Hkv, D,
                             block_size, scale, scratch, scratch + (size_t)H * D, acc + (size_t)H * D,
                             acc + (size_t)H * D + H, acc);
        }
        free(scratch);
#pragma omp for schedule(static)
        for (int task = 0; task < B * H; ++task) {
            int b = task / H, h = task % H;
            if (failed) continue;
            float max = -INFINITY, sum = 0.0f;
            for (int j = first[b]; j < first[b + 1]; ++j) {
                float mj = partial[(size_t)j * per_part + (size_t)H * D + h];
                max = mj > max ? mj : max;
            }
            vf o[256 / LANES];
            for (int d = 0; d < D; d += LANES) o[d / LANES] = vf_zero();
            for (int j = first[b]; j < first[b + 1]; ++j) {
                const float *acc = partial + (size_t)j * per_part;
                float scale_j = expf(acc[(size_t)H * D + h] - max);
                sum += scale_j * acc[(size_t)H * D + H + h];
                for (int d = 0; d < D; d += LANES)
                    o[d / LANES] = vf_fma(vf_set1(scale_j), vf_load(acc + h * D + d), o[d / LANES]);
            }
            vf inv = vf_set1(1.0f / sum);
            for (int d = 0; d < D; d += LANES) store_bf16(out + ((size_t)b * H + h) * D + d, vf_mul(o[d / LANES], inv));
        }
    }
    free(partial);
    free(first);
    return failed ? -1 : 0;
}
