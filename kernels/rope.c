/* kernels/rope.c: rotary position embedding, Hugging Face rotate_half convention
 * (portable C). The frequency and angle arithmetic is done in float32, in the
 * order transformers does it, so that tables match HF's to the last bit or two
 * even at large positions (where the fp32 angle itself carries the error). */
#include "ops.h"

#include <math.h>

/* base ** (arange(0, dim, 2).float() / dim), float32 */
static float pos_freq(float theta, int i, int rotary_dim)
{
    return (float)pow((double)theta, (double)((float)(2 * i) / (float)rotary_dim));
}

/* _compute_yarn_parameters: the dims that turn fewer than beta_slow times over the
 * original context are interpolated (inv_freq / factor), those that turn more than
 * beta_fast times kept, a linear ramp between; the bounds in double as Python has them,
 * the blend in float32 as torch does it. */
static double yarn_dim(double rotations, int dim, double base, double max_pos)
{
    return (dim * log(max_pos / (rotations * 2.0 * 3.14159265358979323846))) / (2.0 * log(base));
}

static void rope_yarn(float *inv_freq, int rotary_dim, const op_rope_params *p)
{
    const int half = rotary_dim / 2;
    const double fast = p->beta_fast != 0 ? p->beta_fast : 32.0, slow = p->beta_slow != 0 ? p->beta_slow : 1.0;
    double low = yarn_dim(fast, rotary_dim, p->theta, p->original_max_pos);
    double high = yarn_dim(slow, rotary_dim, p->theta, p->original_max_pos);
    if (!p->no_truncate) low = floor(low), high = ceil(high);
    low = low > 0 ? low : 0;
    high = high < rotary_dim - 1 ? high : rotary_dim - 1;
    if (low == high) high += 0.001; /* transformers' guard against a zero-width ramp */
    for (int i = 0; i < half; i++) {
        float ramp = ((float)i - (float)low) / (float)(high - low);
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        const float keep = 1.0f - ramp; /* inv_freq_extrapolation_factor */
        const float pf = pos_freq(p->theta, i, rotary_dim), interp = 1.0f / (p->factor * pf);
        inv_freq[i] = interp * (1.0f - keep) + (1.0f / pf) * keep;
    }
}

void op_rope_inv_freq(float *inv_freq, int rotary_dim, const op_rope_params *p)
{
    /* _compute_default_rope_parameters:
     * 1 / base ** (arange(0, dim, 2).float() / dim), all float32, with
     * dim = int(head_dim * partial_rotary_factor): the rotated dims */
    int half = rotary_dim / 2;
    for (int i = 0; i < half; i++) inv_freq[i] = 1.0f / pos_freq(p->theta, i, rotary_dim);
    if (p->type == OP_ROPE_LINEAR) { /* _compute_linear_scaling_rope_parameters: inv_freq /= factor */
        for (int i = 0; i < half; i++) inv_freq[i] /= p->factor;
        return;
    }
    if (p->type == OP_ROPE_YARN) {
        rope_yarn(inv_freq, rotary_dim, p);
        return;
    }
    if (p->type != OP_ROPE_LLAMA3)
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

/* YaRN's get_mscale: 0.1 * m * ln(scale) + 1 past a scale of 1 */
static double yarn_mscale(double scale, double m)
{
    return scale <= 1.0 ? 1.0 : 0.1 * m * log(scale) + 1.0;
}

float op_rope_scale(const op_rope_params *p)
{
    if (p->type != OP_ROPE_YARN) return 1.0f;
    if (p->attention_factor > 0) return (float)p->attention_factor;
    if (p->mscale != 0 && p->mscale_all_dim != 0)
        return (float)(yarn_mscale(p->factor, p->mscale) / yarn_mscale(p->factor, p->mscale_all_dim));
    return (float)yarn_mscale(p->factor, 1.0);
}

void op_rope_table(float *cos_t, float *sin_t, const int32_t *pos, int T,
                   const float *inv_freq, int rotary_dim, float scale)
{
    int half = rotary_dim / 2;
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        float *c = cos_t + (size_t)t * rotary_dim, *s = sin_t + (size_t)t * rotary_dim;
        for (int i = 0; i < half; i++) {
            float angle = (float)pos[t] * inv_freq[i]; /* fp32, as HF */
            /* emb = cat(freqs, freqs): both halves use the same angle */
            c[i] = c[i + half] = (float)cos((double)angle) * scale; /* * attention_scaling, in fp32 */
            s[i] = s[i + half] = (float)sin((double)angle) * scale;
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
