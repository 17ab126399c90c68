/* SGD with momentum and Adam, with PyTorch's update rules (torch.optim.SGD: no dampening, weight
 * decay added to the gradient; torch.optim.Adam: L2 weight decay, bias-corrected moments), so the
 * trainer's curves can be compared with a PyTorch run of the same model. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "trainer.h"

int fm_optim_create(fm_optim_t *opt, const size_t numel[FM_NPARAMS])
{
    for (int k = 0; k < FM_NPARAMS; k++) {
        opt->numel[k] = numel[k];
        opt->state1[k] = calloc(numel[k] ? numel[k] : 1, sizeof(float));
        opt->state2[k] = opt->kind == FM_OPTIM_ADAM ? calloc(numel[k] ? numel[k] : 1, sizeof(float))
                                                    : NULL;
        if (!opt->state1[k] || (opt->kind == FM_OPTIM_ADAM && !opt->state2[k])) {
            fm_optim_destroy(opt);
            return -1;
        }
    }
    opt->steps = 0;
    return 0;
}

void fm_optim_destroy(fm_optim_t *opt)
{
    for (int k = 0; k < FM_NPARAMS; k++) {
        free(opt->state1[k]);
        free(opt->state2[k]);
        opt->state1[k] = opt->state2[k] = NULL;
    }
}

static void sgd(fm_optim_t *opt, float *p, const float *g, float *buf, size_t n)
{
    const float lr = (float)opt->lr, wd = (float)opt->weight_decay, mu = (float)opt->momentum;
    const int first = opt->steps == 0;
    for (size_t i = 0; i < n; i++) {
        float d = g[i] + wd * p[i];
        if (mu != 0.0f) {
            buf[i] = first ? d : mu * buf[i] + d;
            d = buf[i];
        }
        p[i] -= lr * d;
    }
}

static void adam(fm_optim_t *opt, float *p, const float *g, float *m, float *v, size_t n)
{
    const double t = (double)(opt->steps + 1);
    const float b1 = (float)opt->beta1, b2 = (float)opt->beta2, wd = (float)opt->weight_decay;
    const float eps = (float)opt->eps;
    const float step = (float)(opt->lr / (1.0 - pow(opt->beta1, t)));
    const float inv_c2 = (float)(1.0 / sqrt(1.0 - pow(opt->beta2, t)));
    for (size_t i = 0; i < n; i++) {
        float d = g[i] + wd * p[i];
        m[i] = b1 * m[i] + (1.0f - b1) * d;
        v[i] = b2 * v[i] + (1.0f - b2) * d * d;
        p[i] -= step * m[i] / (sqrtf(v[i]) * inv_c2 + eps);
    }
}

void fm_optim_step(fm_optim_t *opt, float *const params[FM_NPARAMS],
                   float *const grads[FM_NPARAMS])
{
    for (int k = 0; k < FM_NPARAMS; k++) {
        if (opt->kind == FM_OPTIM_ADAM)
            adam(opt, params[k], grads[k], opt->state1[k], opt->state2[k], opt->numel[k]);
        else
            sgd(opt, params[k], grads[k], opt->state1[k], opt->numel[k]);
    }
    opt->steps++;
}
