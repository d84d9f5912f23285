/* kernels/rope.c: rotary position embedding, Hugging Face rotate_half convention
 * (portable C). The frequency and angle arithmetic is done in float32, in the
 * order transformers does it, so that tables match HF's to the last bit or two
 * even at large positions (where the fp32 angle itself carries the error). */
#include "ops.h"

#include <math.h>

void op_rope_inv_freq(float *inv_freq, int rotary_dim, const op_rope_params *p)
{
    /* _compute_default_rope_parameters:
     * 1 / base ** (arange(0, dim, 2).float() / dim), all float32, with
     * dim = int(head_dim * partial_rotary_factor): the rotated dims */
    int half = rotary_dim / 2;
    for (int i = 0; i < half; i++) {
        float e = (float)(2 * i) / (float)rotary_dim;
        inv_freq[i] = 1.0f / (float)pow((double)p->theta, (double)e);
    }
    if (!p->llama3)
        return;
    /* _compute_llama3_parameters: keep high frequencies, divide low ones by
     * factor, interpolate smoothly in between */
    const float two_pi = (float)(2.0 * 3.14159265358979323846); /* 2 * math.pi */
    float low_wavelen = p->original_max_pos / p->low_freq_factor;
    float high_wavelen = p->original_max_pos / p->high_freq_factor;
    for (int i = 0; i < half; i++) {
        float f = inv_freq[i];
        float wavelen = two_pi / f;
        float fl = wavelen > low_wavelen ? f / p->factor : f;
        if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
            float smooth = (p->original_max_pos / wavelen - p->low_freq_factor) /
                           (p->high_freq_factor - p->low_freq_factor);
            fl = (1.0f - smooth) * fl / p->factor + smooth * fl;
        }
        inv_freq[i] = fl;
    }
}

void op_rope_table(float *cos_t, float *sin_t, const int32_t *pos, int T,
                   const float *inv_freq, int rotary_dim)
{
    int half = rotary_dim / 2;
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        float *c = cos_t + (size_t)t * rotary_dim, *s = sin_t + (size_t)t * rotary_dim;
        for (int i = 0; i < half; i++) {
            float angle = (float)pos[t] * inv_freq[i]; /* fp32, as HF */
            /* emb = cat(freqs, freqs): both halves use the same angle */
            c[i] = c[i + half] = (float)cos((double)angle);
            s[i] = s[i + half] = (float)sin((double)angle);
        }
    }
}

/* On the first rotary_dim dims of a head (GPT-NeoX: cat(rotate(x_rot), x_pass)):
 * out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1); per
 * half-index i: y1 = c1 x1 - s1 x2, y2 = c2 x2 + s2 x1 (c1 = c[i], c2 = c[i+half]).
 * backward applies the transpose: dx1 = c1 dy1 + s2 dy2, dx2 = c2 dy2 - s1 dy1,
 * a rotation by -angle. The dims past rotary_dim are left as they are. */
static void rope_rotate(float *x, const float *cos_t, const float *sin_t,
                        int B, int T, int nh, int head_dim, int rotary_dim, int backward)
{
    int half = rotary_dim / 2;
    #pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            const float *c = cos_t + (size_t)t * rotary_dim, *s = sin_t + (size_t)t * rotary_dim;
            for (int h = 0; h < nh; h++) {
                float *v = x + (((size_t)b * T + t) * nh + h) * head_dim;
                for (int i = 0; i < half; i++) {
                    float x1 = v[i], x2 = v[i + half];
                    if (!backward) {
                        v[i] = c[i] * x1 - s[i] * x2;
                        v[i + half] = c[i + half] * x2 + s[i + half] * x1;
                    } else {
                        v[i] = c[i] * x1 + s[i + half] * x2;
                        v[i + half] = c[i + half] * x2 - s[i] * x1;
                    }
                }
            }
        }
    }
}

void op_rope_forward(float *x, const float *cos_t, const float *sin_t,
                     int B, int T, int nh, int head_dim, int rotary_dim)
{
    rope_rotate(x, cos_t, sin_t, B, T, nh, head_dim, rotary_dim, 0);
}

void op_rope_backward(float *dx, const float *cos_t, const float *sin_t,
                      int B, int T, int nh, int head_dim, int rotary_dim)
{
    rope_rotate(dx, cos_t, sin_t, B, T, nh, head_dim, rotary_dim, 1);
}
