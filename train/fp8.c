/* train/fp8.c: the FP8 recipe: scaling state, amax history, scale updates (fp8.h). */
#include "fp8.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define E4M3_MAX 448.0f
#define E5M2_MAX 57344.0f

const char *fp8_mode_name(fp8_mode m)
{
    return m == FP8_DELAYED ? "delayed" : m == FP8_CURRENT ? "current" : "off";
}

fp8_state *fp8_create(fp8_mode mode, int nlin, int hist_len, float margin)
{
    fp8_state *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->mode = mode;
    s->nlin = nlin;
    s->hist_len = hist_len < 1 ? 1 : hist_len;
    s->margin = margin;
    s->hist = calloc((size_t)nlin * FP8_ROLES * s->hist_len + 1, sizeof(float));
    s->scale = calloc((size_t)nlin * FP8_ROLES + 1, sizeof(float));
    s->step_amax = calloc((size_t)nlin * FP8_ROLES + 1, sizeof(float));
    if (!s->hist || !s->scale || !s->step_amax) {
        fp8_free(s);
        return NULL;
    }
    for (int i = 0; i < nlin * FP8_ROLES; i++) s->scale[i] = 1.0f;
    return s;
}

void fp8_free(fp8_state *s)
{
    if (!s) return;
    free(s->hist); free(s->scale); free(s->step_amax);
    free(s);
}

static float fmt_max(int role)
{
    return role == FP8_ROLE_GRAD ? E5M2_MAX : E4M3_MAX;
}

/* TransformerEngine's scale update: fp8_max / amax / 2^margin, kept when the amax
 * is 0 or not finite */
static float scale_from(float amax, float prev, int role, float margin)
{
    if (!(amax > 0.0f) || !isfinite(amax)) return prev;
    float sc = (float)((double)fmt_max(role) / amax / pow(2.0, margin));
    return isfinite(sc) && sc > 0.0f ? sc : prev;
}

float fp8_use_scale(fp8_state *s, int idx, int role, float amax)
{
    if (s->frozen) /* validation: the same scales, no trace in the step's amaxes */
        return s->mode == FP8_CURRENT ? scale_from(amax, s->scale[idx * FP8_ROLES + role], role, s->margin)
                                      : s->scale[idx * FP8_ROLES + role];
    float *sa = &s->step_amax[idx * FP8_ROLES + role];
    if (amax > *sa || isnan(amax)) *sa = isnan(*sa) ? *sa : amax;
    float *sc = &s->scale[idx * FP8_ROLES + role];
    if (s->mode == FP8_CURRENT) *sc = scale_from(amax, *sc, role, s->margin);
    return *sc;
}

void fp8_step_end(fp8_state *s, int discard)
{
    int n = s->nlin * FP8_ROLES;
    if (!discard) {
        for (int i = 0; i < n; i++) {
            float *h = s->hist + (size_t)i * s->hist_len;
            memmove(h + 1, h, (size_t)(s->hist_len - 1) * sizeof(float));
            h[0] = s->step_amax[i];
            if (s->mode == FP8_DELAYED) {
                float mx = 0.0f;
                for (int k = 0; k < s->hist_len; k++) mx = h[k] > mx ? h[k] : mx;
                s->scale[i] = scale_from(mx, s->scale[i], i % FP8_ROLES, s->margin);
            }
        }
    }
    memset(s->step_amax, 0, (size_t)n * sizeof(float));
}
