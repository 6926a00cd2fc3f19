/* Decode-step glue of a Llama-family layer, in C: everything between the
 * matmuls (which stay library kernels called from Python).
 *
 * A decode step has one new token per sequence; in eager PyTorch each layer
 * is ~40 small ops (norms, RoPE, cache writes, batched attention, SwiGLU),
 * each costing a dispatch of several microseconds for a handful of rows.
 * These three functions do that work in three calls per layer, reading and
 * writing raw buffers, and keep the residual stream in float32.
 *
 * Buffers: `io` tensors (matmul inputs and outputs) are bf16 when io_bf16,
 * else float32; the KV cache is bf16 when cache_bf16, else float32, laid out
 * [slots, kv_heads, max_len, head_dim] (element strides given); conversions in bf16.h.
 *
 * Built with -O3 -march=native -ffast-math (finite values only) by quanta/model/native/__init__.py, so the
 * loops vectorize for the CPU it runs on (AVX2 or AVX-512).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* x[r] += add[r] (when add is not NULL); out[r] = rmsnorm(x[r]) * weight.
 * x: float32 [rows, dim], updated in place; add, out: io dtype [rows, dim];
 * scratch: float32 [dim]. */
void residual_rms_norm(int rows, int dim, float *x, const void *add, const float *weight, float eps,
                       void *out, int io_bf16, float *scratch) {
    for (int r = 0; r < rows; r++) {
        float *xr = x + (int64_t)r * dim;
        if (add) {
            load_row(add, io_bf16, (int64_t)r * dim, dim, scratch);
            for (int i = 0; i < dim; i++) xr[i] += scratch[i];
        }
        float ss = 0.0f;
        for (int i = 0; i < dim; i++) ss += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int i = 0; i < dim; i++) scratch[i] = xr[i] * inv * weight[i];
        store_row(out, io_bf16, (int64_t)r * dim, dim, scratch);
    }
}

/* Rotate-half RoPE of `heads` heads of `dim` in place, for angles pos * inv_freq. */
static void rope(float *x, int heads, int dim, const float *cos_t, const float *sin_t) {
    int half = dim / 2;
    for (int h = 0; h < heads; h++) {
        float *v = x + h * dim;
        for (int i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cos_t[i] - b * sin_t[i];
            v[i + half] = b * cos_t[i] + a * sin_t[i];
        }
    }
}

/* One KV head's group of query heads (q: float32 [group, dim], pre-scaled) over cache
 * positions 0..len-1 at element offset `head`: each key and value row is converted to float32
 * once for the whole group. out: float32 [group, dim]; scores: [group, len]; row: [dim]. */
static inline __attribute__((always_inline)) void attend_group(const float *q, int group, int dim, const void *k_cache, const void *v_cache, int bf16,
                         int64_t head, int64_t len, float *scores, float *row, float *out) {
    for (int64_t t = 0; t < len; t++) {
        load_row(k_cache, bf16, head + t * dim, dim, row);
        for (int j = 0; j < group; j++) {
            const float *qj = q + j * dim;
            float dot = 0.0f;
            for (int i = 0; i < dim; i++) dot += qj[i] * row[i];
            scores[j * len + t] = dot;
        }
    }
    for (int j = 0; j < group; j++) {
        float *sj = scores + j * len, top = -3.402823466e38f, total = 0.0f; /* finite: built with -ffast-math */
        for (int64_t t = 0; t < len; t++) top = sj[t] > top ? sj[t] : top;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; t++) {
            sj[t] = expf(sj[t] - top);
            total += sj[t];
        }
        float inv = 1.0f / total;
        for (int64_t t = 0; t < len; t++) sj[t] *= inv;
    }
    memset(out, 0, (size_t)group * dim * sizeof(float));
    for (int64_t t = 0; t < len; t++) {
        load_row(v_cache, bf16, head + t * dim, dim, row);
        for (int j = 0; j < group; j++) {
            float p = scores[j * len + t], *oj = out + j * dim;
            for (int i = 0; i < dim; i++) oj[i] += p * row[i];
        }
    }
}

/* One decode token per row: RoPE on q and k, write k and v into the cache at
 * (slots[r], :, positions[r]), then attend over positions 0..positions[r].
 * qkv: io [rows, (heads + 2 kv_heads) * dim] (q, then k, then v);
 * inv_freq: float32 [dim / 2]; out: io [rows, heads * dim];
 * scratch: float32 [(heads + 2 kv_heads) * dim + (heads / kv_heads + 2) * dim + heads / kv_heads * max_len]. */
void attention_decode(int rows, const void *qkv, int io_bf16, int heads, int kv_heads, int dim,
                      const float *inv_freq, const int64_t *slots, const int64_t *positions,
                      void *k_cache, void *v_cache, int cache_bf16, int64_t slot_stride,
                      int64_t head_stride, void *out, float *scratch) {
    int width = (heads + 2 * kv_heads) * dim, half = dim / 2, group = heads / kv_heads;
    float *row = scratch, *cos_t = row + width, *sin_t = cos_t + half, *acc = sin_t + half;
    float *kv_row = acc + group * dim, *scores = kv_row + dim;
    float scale = 1.0f / sqrtf((float)dim);
    for (int r = 0; r < rows; r++) {
        int64_t pos = positions[r];
        int64_t base = slots[r] * slot_stride;
        load_row(qkv, io_bf16, (int64_t)r * width, width, row);
        for (int i = 0; i < half; i++) {
            float angle = (float)pos * inv_freq[i];
            cos_t[i] = cosf(angle);
            sin_t[i] = sinf(angle);
        }
        rope(row, heads + kv_heads, dim, cos_t, sin_t);
        float *q = row, *k = row + heads * dim, *v = k + kv_heads * dim;
        for (int g = 0; g < kv_heads; g++) {
            int64_t at = base + g * head_stride + pos * dim;
            store_row(k_cache, cache_bf16, at, dim, k + g * dim);
            store_row(v_cache, cache_bf16, at, dim, v + g * dim);
        }
        for (int h = 0; h < heads; h++) {
            float *qh = q + h * dim;
            for (int i = 0; i < dim; i++) qh[i] *= scale;
        }
        for (int g = 0; g < kv_heads; g++) {
            const float *qg = q + g * group * dim;
            int64_t head = base + g * head_stride;
            if (dim == 64) /* the common head sizes as constants, so the row loops unroll */
                attend_group(qg, group, 64, k_cache, v_cache, cache_bf16, head, pos + 1, scores, kv_row, acc);
            else if (dim == 128)
                attend_group(qg, group, 128, k_cache, v_cache, cache_bf16, head, pos + 1, scores, kv_row, acc);
            else
                attend_group(qg, group, dim, k_cache, v_cache, cache_bf16, head, pos + 1, scores, kv_row, acc);
            store_row(out, io_bf16, (int64_t)r * heads * dim + g * group * dim, group * dim, acc);
        }
    }
}

/* out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:]; io [rows, 2 inter] -> io [rows, inter].
 * scratch: float32 [2 inter]. */
void silu_mul(int rows, int inter, const void *gate_up, int io_bf16, void *out, float *scratch) {
    for (int r = 0; r < rows; r++) {
        load_row(gate_up, io_bf16, (int64_t)r * 2 * inter, 2 * inter, scratch);
#pragma omp simd
        for (int i = 0; i < inter; i++) {
            float g = scratch[i];
            scratch[i] = g / (1.0f + expf(-g)) * scratch[inter + i];
        }
        store_row(out, io_bf16, (int64_t)r * inter, inter, scratch);
    }
}
