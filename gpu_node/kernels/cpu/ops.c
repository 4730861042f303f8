/* CPU kernels for the decode step, built once per machine with its own instruction set
 * (gpu_node/kernels/cpu/__init__.py compiles and loads this file; without a compiler the
 * engine keeps its torch path).
 *
 *   es_quantize_rows  activations -> int16 codes, one fp32 scale a block of 32
 *   es_q4_gemv        y = x W^T, W as INT4 groups (packed nibbles, fp16 scale and min)
 *   es_q8_gemv        y = x W^T, W as GGUF Q8_0 (int8 codes, fp16 scale per block of 32)
 *   es_paged_decode   one query a sequence over its pages, read in place (fp32 KV)
 *   es_kv_write       a step's K/V rows into their slots, refusing foreign pages
 *   es_rms_norm, es_add_rms_norm, es_rope, es_silu_mul   the small operations, fused
 *
 * The GEMVs take activations already quantized to int16 a block of 32: integer
 * multiply-adds (16 weights an instruction) at a rounding error of 1/65534 of the block's
 * largest value, below bf16's (int8 codes, llama.cpp's scheme, cost the answers more).
 * All row loops split over the OpenMP threads torch itself uses.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ES_AVX2 1
#endif

#define BLOCK 32
#define MAX_ROWS 64 /* activations rows a GEMV call takes (decode batches) */

static inline float half_to_float(uint16_t h) {
#ifdef ES_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

void es_set_threads(int n) { omp_set_num_threads(n); }

#define QMAX 32767.0f

/* x fp32 [M, K] -> q int16 [M, K], d fp32 [M, K/32] (q * d ~ x), qd fp32 [M, K/32] = d * sum(q). */
void es_quantize_rows(const float *x, int64_t M, int64_t K, int16_t *q, float *d, float *qd) {
    const int64_t nb = K / BLOCK;
    for (int64_t i = 0; i < M * nb; i++) {
        const float *xb = x + i * BLOCK;
        float amax = 0.0f;
        for (int j = 0; j < BLOCK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float scale = amax / QMAX, inv = amax > 0.0f ? QMAX / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < BLOCK; j++) {
            const int v = (int)nearbyintf(xb[j] * inv);
            q[i * BLOCK + j] = (int16_t)v;
            sum += v;
        }
        d[i] = scale;
        qd[i] = scale * (float)sum;
    }
}

#ifdef ES_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* 32 weights (w0: the first 16, w1: the last 16, as int16) times 32 int16 activations,
 * as 8 float lanes of partial sums (each exact: below 2^24) */
static inline __m256 dot_s16(__m256i w0, __m256i w1, const int16_t *x) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)x);
    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(x + 16));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1)));
}

/* a Q4 block's 16 bytes (low nibbles weights 0..15, high ones 16..31) as int16 halves */
static inline void unpack_q4(const uint8_t *w, __m256i *w0, __m256i *w1) {
    const __m128i low = _mm_set1_epi8(0x0f), raw = _mm_loadu_si128((const __m128i *)w);
    *w0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low));
    *w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low));
}

/* a Q8_0 block's 32 int8 weights as int16 halves */
static inline void unpack_q8(const int8_t *w, __m256i *w0, __m256i *w1) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)w);
    *w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(raw));
    *w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(raw, 1));
}
#endif

static inline int64_t dot_q4_scalar(const uint8_t *w, const int16_t *x) {
    int64_t s = 0;
    for (int j = 0; j < 16; j++) s += (w[j] & 0x0f) * x[j] + (w[j] >> 4) * x[16 + j];
    return s;
}

/* y fp32 [M, N] = x W^T. W: packed uint8 [N, K/2] (each 32 weights: 16 bytes, the low
 * nibbles weights 0..15, the high ones 16..31), scales and mins fp16 [N, K/G]; weight =
 * code * scale + min. x given as es_quantize_rows' q, d, qd. */
#ifdef ES_AVX2
/* es_q4_gemv for one row of activations, the accumulator in a register; the same
 * additions in the same order as the rows of a batch (a row's answer is the same alone
 * or batched). */
static void q4_gemv_row(const int16_t *q, const float *d, const float *qd, int64_t K,
                        const uint8_t *packed, const uint16_t *scales, const uint16_t *mins,
                        int64_t G, int64_t N, float *y) {
    const int64_t per = G / BLOCK, ng = K / G;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wrow = packed + n * (K / 2);
        __m256 acc = _mm256_setzero_ps();
        float acc_min = 0.0f;
        for (int64_t g = 0; g < ng; g++) {
            const float scale = half_to_float(scales[n * ng + g]);
            const float min = half_to_float(mins[n * ng + g]);
            for (int64_t c = 0; c < per; c++) {
                const int64_t b = g * per + c;
                __m256i w0, w1;
                unpack_q4(wrow + b * 16, &w0, &w1);
                acc = _mm256_fmadd_ps(dot_s16(w0, w1, q + b * BLOCK), _mm256_set1_ps(scale * d[b]), acc);
                acc_min += min * qd[b];
            }
        }
        y[n] = hsum(acc) + acc_min;
    }
}
#endif

void es_q4_gemv(const int16_t *q, const float *d, const float *qd, int64_t M, int64_t K,
                const uint8_t *packed, const uint16_t *scales, const uint16_t *mins,
                int64_t G, int64_t N, float *y) {
    const int64_t nb = K / BLOCK, ng = K / G, per = G / BLOCK;
#ifdef ES_AVX2
    if (M == 1) {
        q4_gemv_row(q, d, qd, K, packed, scales, mins, G, N, y);
        return;
    }
#endif
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wrow = packed + n * (K / 2);
        float acc_min[MAX_ROWS] = {0};
#ifdef ES_AVX2
        __m256 acc[MAX_ROWS];
        for (int64_t m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
#else
        float acc[MAX_ROWS] = {0};
#endif
        for (int64_t g = 0; g < ng; g++) {
            const float scale = half_to_float(scales[n * ng + g]);
            const float min = half_to_float(mins[n * ng + g]);
            for (int64_t c = 0; c < per; c++) {
                const int64_t b = g * per + c;
#ifdef ES_AVX2
                __m256i w0, w1;
                unpack_q4(wrow + b * 16, &w0, &w1);
#endif
                for (int64_t m = 0; m < M; m++) {
                    const int16_t *x = q + (m * nb + b) * BLOCK;
#ifdef ES_AVX2
                    acc[m] = _mm256_fmadd_ps(dot_s16(w0, w1, x), _mm256_set1_ps(scale * d[m * nb + b]), acc[m]);
#else
                    acc[m] += scale * d[m * nb + b] * (float)dot_q4_scalar(wrow + b * 16, x);
#endif
                    acc_min[m] += min * qd[m * nb + b];
                }
            }
        }
        for (int64_t m = 0; m < M; m++) {
#ifdef ES_AVX2
            y[m * N + n] = hsum(acc[m]) + acc_min[m];
#else
            y[m * N + n] = acc[m] + acc_min[m];
#endif
        }
    }
}

/* y fp32 [M, N] = x W^T, W as Q8_0: codes int8 [N, K], scales fp16 [N, K/32]. */
void es_q8_gemv(const int16_t *q, const float *d, int64_t M, int64_t K, const int8_t *codes,
                const uint16_t *scales, int64_t N, float *y) {
    const int64_t nb = K / BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wrow = codes + n * K;
#ifdef ES_AVX2
        __m256 acc[MAX_ROWS];
        for (int64_t m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const float ws = half_to_float(scales[n * nb + b]);
            __m256i w0, w1;
            unpack_q8(wrow + b * BLOCK, &w0, &w1);
            for (int64_t m = 0; m < M; m++)
                acc[m] = _mm256_fmadd_ps(dot_s16(w0, w1, q + (m * nb + b) * BLOCK),
                                         _mm256_set1_ps(ws * d[m * nb + b]), acc[m]);
        }
        for (int64_t m = 0; m < M; m++) y[m * N + n] = hsum(acc[m]);
#else
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int64_t s = 0;
                for (int j = 0; j < BLOCK; j++) s += wrow[b * BLOCK + j] * q[(m * nb + b) * BLOCK + j];
                acc += half_to_float(scales[n * nb + b]) * d[m * nb + b] * (float)s;
            }
            y[m * N + n] = acc;
        }
#endif
    }
}

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Paged decode attention over fp32 pages, one query row a sequence.
 * q [B, H, E] (row stride q_stride), caches with strides (page, token, head) in floats,
 * tables int32 [B, table_stride], context_lens int32 [B], page_owner int64 [P], seq_tags
 * int64 [B]. A sequence whose pages break the ownership rule (a page outside [0, P) or
 * owned by another tag) is not attended: its output is zeros and foreign[b] = 1. */
void es_paged_decode(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                     int64_t page_stride, int64_t token_stride, int64_t head_stride,
                     const int32_t *tables, int64_t table_stride, const int32_t *context_lens,
                     const int64_t *page_owner, const int64_t *seq_tags, int check_owner,
                     int64_t num_pages, int64_t B, int64_t H, int64_t KH, int64_t E, int64_t S,
                     float scale, float *out, int32_t *foreign) {
    const int64_t groups = H / KH;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = context_lens[b], used = (len + S - 1) / S;
        int bad = used > table_stride;
        for (int64_t p = 0; p < used && !bad; p++) {
            const int64_t page = tables[b * table_stride + p];
            bad = page < 0 || page >= num_pages || (check_owner && page_owner[page] != seq_tags[b]);
        }
        foreign[b] = bad;
    }
#pragma omp parallel for schedule(dynamic, 1) collapse(2)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t kh = 0; kh < KH; kh++) {
            const int64_t len = context_lens[b];
            float *o = out + (b * H + kh * groups) * E;
            if (foreign[b] || len == 0) {
                memset(o, 0, sizeof(float) * groups * E);
                continue;
            }
            float *scores = malloc(sizeof(float) * groups * len);
            for (int64_t t = 0; t < len; t++) {
                const int64_t page = tables[b * table_stride + t / S];
                const float *k = k_cache + page * page_stride + (t % S) * token_stride + kh * head_stride;
                for (int64_t g = 0; g < groups; g++)
                    scores[g * len + t] = scale * dot_f32(q + b * q_stride + (kh * groups + g) * E, k, E);
            }
            for (int64_t g = 0; g < groups; g++) {
                float *s = scores + g * len, mx = -INFINITY, sum = 0.0f;
                for (int64_t t = 0; t < len; t++) mx = fmaxf(mx, s[t]);
                for (int64_t t = 0; t < len; t++) {
                    s[t] = expf(s[t] - mx);
                    sum += s[t];
                }
                const float inv = 1.0f / sum;
                for (int64_t t = 0; t < len; t++) s[t] *= inv;
            }
            memset(o, 0, sizeof(float) * groups * E);
            for (int64_t t = 0; t < len; t++) {
                const int64_t page = tables[b * table_stride + t / S];
                const float *v = v_cache + page * page_stride + (t % S) * token_stride + kh * head_stride;
                for (int64_t g = 0; g < groups; g++) {
                    const float p = scores[g * len + t];
                    float *og = o + g * E;
#pragma omp simd
                    for (int64_t e = 0; e < E; e++) og[e] += p * v[e];
                }
            }
            free(scores);
        }
    }
}

/* k, v [T, KH, E] (row strides k_stride, v_stride; heads contiguous) into slots [T] of fp32
 * caches; a slot outside the pool or on a page another tag owns is refused (refused[t] = 1),
 * a negative slot (padding) is skipped. */
void es_kv_write(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                 float *k_cache, float *v_cache, int64_t page_stride, int64_t token_stride,
                 int64_t head_stride, const int64_t *slots, const int64_t *page_owner,
                 const int64_t *token_tags, int check_owner, int64_t num_pages, int64_t S,
                 int64_t T, int64_t KH, int64_t E, uint8_t *refused) {
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        refused[t] = 0;
        if (slot < 0) continue;
        const int64_t page = slot / S, offset = slot % S;
        if (page >= num_pages || (check_owner && page_owner[page] != token_tags[t])) {
            refused[t] = 1;
            continue;
        }
        for (int64_t h = 0; h < KH; h++) {
            const int64_t at = page * page_stride + offset * token_stride + h * head_stride;
            memcpy(k_cache + at, k + t * k_stride + h * E, sizeof(float) * E);
            memcpy(v_cache + at, v + t * v_stride + h * E, sizeof(float) * E);
        }
    }
}

/* out [T, D] = x * rsqrt(mean(x^2) + eps) * w (rows of x with stride x_stride). */
void es_rms_norm(const float *x, int64_t x_stride, const float *w, float eps, int64_t T,
                 int64_t D, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *r = x + t * x_stride;
        const float inv = 1.0f / sqrtf(dot_f32(r, r, D) / (float)D + eps);
        float *o = out + t * D;
#pragma omp simd
        for (int64_t i = 0; i < D; i++) o[i] = r[i] * inv * w[i];
    }
}

/* summed = x + residual, out = rms_norm(summed); both [T, D] contiguous. */
void es_add_rms_norm(const float *x, const float *residual, const float *w, float eps, int64_t T,
                     int64_t D, float *out, float *summed) {
    for (int64_t t = 0; t < T; t++) {
        const float *a = x + t * D, *r = residual + t * D;
        float *s = summed + t * D;
#pragma omp simd
        for (int64_t i = 0; i < D; i++) s[i] = a[i] + r[i];
    }
    es_rms_norm(summed, D, w, eps, T, D, out);
}

/* RoPE in place on rows x [T, N, E] (token stride x_stride, heads contiguous); cos, sin
 * [T, E/2]. interleaved: pairs (2i, 2i+1); else halves (i, i + E/2). */
void es_rope(float *x, int64_t x_stride, int64_t T, int64_t N, int64_t E, const float *cos,
             const float *sin, int interleaved) {
    const int64_t half = E / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < N; h++) {
            float *r = x + t * x_stride + h * E;
            if (interleaved) {
                for (int64_t i = 0; i < half; i++) {
                    const float a = r[2 * i], b = r[2 * i + 1];
                    r[2 * i] = a * c[i] - b * s[i];
                    r[2 * i + 1] = b * c[i] + a * s[i];
                }
            } else {
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    const float a = r[i], b = r[i + half];
                    r[i] = a * c[i] - b * s[i];
                    r[i + half] = b * c[i] + a * s[i];
                }
            }
        }
    }
}

/* out [T, F] = silu(gate) * up; gate and up rows with strides gate_stride, up_stride. */
void es_silu_mul(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride,
                 int64_t T, int64_t F, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate + t * gate_stride, *u = up + t * up_stride;
        float *o = out + t * F;
        for (int64_t i = 0; i < F; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* ---- A whole decode step of llama-family layers in one call ---------------------------- */

typedef struct {
    const uint8_t *packed;
    const uint16_t *scales, *mins;
    int64_t group, n, k;
} es_q4;

typedef struct {
    const float *attn_norm, *mlp_norm; /* [D] */
    es_q4 qkv, o, gate_up, down;       /* q|k|v rows fused, gate|up rows fused */
    float *k_cache, *v_cache;          /* this layer's fp32 pools */
} es_layer;

typedef struct {
    int64_t layers, D, H, KH, E, F;
    float eps, attn_scale;
    int interleaved;
    int64_t page_stride, token_stride, head_stride, num_pages, S;
    const es_layer *layer;
} es_model;

static void q4_apply(const es_q4 *w, const float *x, int64_t M, int16_t *q, float *d, float *qd, float *y) {
    es_quantize_rows(x, M, w->k, q, d, qd);
    es_q4_gemv(q, d, qd, M, w->k, w->packed, w->scales, w->mins, w->group, w->n, y);
}

/* x [B, D]: the residual stream of B sequences' one new token each, updated in place to
 * the last layer's output (before the final norm). cos, sin [B, E/2] at their positions;
 * slots, token_tags [B]; the paged metadata as es_paged_decode takes it. violations[b]
 * counts, over the layers, refused writes and foreign pages of sequence b (es_kv_write,
 * es_paged_decode). Returns 0, or -1 if scratch could not be allocated. */
int es_llama_decode(const es_model *m, float *x, int64_t B, const float *cos, const float *sin,
                    const int64_t *slots, const int64_t *token_tags, const int32_t *tables,
                    int64_t table_stride, const int32_t *context_lens, const int64_t *page_owner,
                    const int64_t *seq_tags, int check_owner, int32_t *violations) {
    const int64_t D = m->D, E = m->E, QKV = (m->H + 2 * m->KH) * E, F = m->F;
    const int64_t widest = QKV > 2 * F ? QKV : 2 * F;
    const int64_t kmax = D > F ? (D > m->H * E ? D : m->H * E) : (F > m->H * E ? F : m->H * E);
    float *h = malloc(sizeof(float) * B * D), *wide = malloc(sizeof(float) * B * widest);
    float *attn = malloc(sizeof(float) * B * m->H * E), *act = malloc(sizeof(float) * B * F);
    float *tmp = malloc(sizeof(float) * B * D);
    int16_t *q = malloc(sizeof(int16_t) * B * kmax);
    float *d = malloc(sizeof(float) * B * (kmax / BLOCK)), *qd = malloc(sizeof(float) * B * (kmax / BLOCK));
    uint8_t *refused = malloc(B);
    int32_t *foreign = malloc(sizeof(int32_t) * B);
    int status = 0;
    if (!h || !wide || !attn || !act || !tmp || !q || !d || !qd || !refused || !foreign) {
        status = -1;
        goto done;
    }
    for (int64_t b = 0; b < B; b++) violations[b] = 0;
    for (int64_t l = 0; l < m->layers; l++) {
        const es_layer *L = &m->layer[l];
        es_rms_norm(x, D, L->attn_norm, m->eps, B, D, h);
        q4_apply(&L->qkv, h, B, q, d, qd, wide); /* [B, QKV] */
        es_rope(wide, QKV, B, m->H, E, cos, sin, m->interleaved);
        es_rope(wide + m->H * E, QKV, B, m->KH, E, cos, sin, m->interleaved);
        es_kv_write(wide + m->H * E, QKV, wide + (m->H + m->KH) * E, QKV, L->k_cache, L->v_cache,
                    m->page_stride, m->token_stride, m->head_stride, slots, page_owner, token_tags,
                    check_owner, m->num_pages, m->S, B, m->KH, E, refused);
        es_paged_decode(wide, QKV, L->k_cache, L->v_cache, m->page_stride, m->token_stride,
                        m->head_stride, tables, table_stride, context_lens, page_owner, seq_tags,
                        check_owner, m->num_pages, B, m->H, m->KH, E, m->S, m->attn_scale, attn,
                        foreign);
        for (int64_t b = 0; b < B; b++) violations[b] += refused[b] + foreign[b];
        q4_apply(&L->o, attn, B, q, d, qd, tmp); /* [B, D] */
        es_add_rms_norm(tmp, x, L->mlp_norm, m->eps, B, D, h, x); /* x += attended */
        q4_apply(&L->gate_up, h, B, q, d, qd, wide); /* [B, 2F] */
        es_silu_mul(wide, 2 * F, wide + F, 2 * F, B, F, act);
        q4_apply(&L->down, act, B, q, d, qd, tmp);
        for (int64_t i = 0; i < B * D; i++) x[i] += tmp[i];
    }
done:
    free(h), free(wide), free(attn), free(act), free(tmp), free(q), free(d), free(qd);
    free(refused), free(foreign);
    return status;
}
