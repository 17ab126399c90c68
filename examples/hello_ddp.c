/* hello_ddp: the smallest complete data-parallel training loop with libddp, for copying.
 *
 * A linear model y = w.x + b is fitted by SGD to data from a known line. Every rank takes its
 * share of each global batch; the Reducer averages the gradients, so every rank ends with the same
 * weights as one process on the whole batch. Run it with the launcher:
 *
 *     build/ddprun -n 2 build/hello_ddp
 */
#include <stdio.h>
#include <string.h>

#include <ddp/ddp.h>

#define FEATURES 8
#define GLOBAL_BATCH 48
#define STEPS 200

static int fail(const char *what, ddp_status_t status)
{
    fprintf(stderr, "hello_ddp: %s: %s: %s\n", what, ddp_status_string(status), ddp_last_error());
    return 1;
}

/* Sample i of the data set: features from a fixed formula, target from the true line. */
static void sample(int i, float *x, float *y)
{
    float target = 0.5f;
    for (int f = 0; f < FEATURES; f++) {
        x[f] = (float)((i * 7 + f * 13) % 17) / 17.0f - 0.5f;
        target += (float)(f + 1) * x[f];
    }
    *y = target;
}

int main(void)
{
    ddp_group_t *group = NULL;
    ddp_status_t s = ddp_group_create_from_env(NULL, &group);
    if (s != DDP_OK) return fail("creating the process group (run under ddprun)", s);
    int rank = ddp_group_rank(group), world = ddp_group_size(group);
    if (GLOBAL_BATCH % world != 0) {
        fprintf(stderr, "hello_ddp: world size %d does not divide the batch %d\n", world, GLOBAL_BATCH);
        ddp_group_destroy(group);
        return 1;
    }

    float w[FEATURES] = {0}, b = 0.0f;
    ddp_param_t params[2] = {
        {.name = "w", .data = w, .numel = FEATURES, .dtype = DDP_F32},
        {.name = "b", .data = &b, .numel = 1, .dtype = DDP_F32},
    };
    ddp_reducer_config_t config = DDP_REDUCER_CONFIG_INIT;
    ddp_reducer_t *reducer = NULL;
    s = ddp_reducer_create(group, params, 2, NULL, 0, &config, &reducer);
    if (s != DDP_OK) {
        ddp_group_destroy(group);
        return fail("creating the reducer", s);
    }

    const int local = GLOBAL_BATCH / world;
    for (int step = 0; step < STEPS && s == DDP_OK; step++) {
        float *gw, *gb;
        if ((s = ddp_reducer_prepare(reducer)) != DDP_OK) break;
        ddp_reducer_grad(reducer, 0, (void **)&gw);
        ddp_reducer_grad(reducer, 1, (void **)&gb);
        /* Forward and backward of the mean squared error over this rank's share of the batch. */
        for (int k = 0; k < local; k++) {
            float x[FEATURES], y, pred = b;
            sample(step * GLOBAL_BATCH + rank * local + k, x, &y);
            for (int f = 0; f < FEATURES; f++) pred += w[f] * x[f];
            float dloss = 2.0f * (pred - y) / (float)local;
            for (int f = 0; f < FEATURES; f++) gw[f] += dloss * x[f];
            *gb += dloss;
        }
        /* Gradients are complete: hand them over (last layer first in a real network). */
        if ((s = ddp_reducer_grad_ready(reducer, 1)) != DDP_OK) break;
        if ((s = ddp_reducer_grad_ready(reducer, 0)) != DDP_OK) break;
        if ((s = ddp_reducer_finalize(reducer)) != DDP_OK) break; /* averaged over ranks */
        for (int f = 0; f < FEATURES; f++) w[f] -= 0.5f * gw[f];
        b -= 0.5f * *gb;
        ddp_reducer_zero_grad(reducer);
    }
    if (s != DDP_OK) {
        fail("training", s);
    } else if (rank == 0) {
        /* What the launcher gave: shm inside a host, hierarchical across hosts, mpi if asked. */
        printf("hello_ddp: transport %s\n", ddp_group_transport(group));
        printf("hello_ddp: %d ranks, w =", world);
        for (int f = 0; f < FEATURES; f++) printf(" %.3f", w[f]);
        printf(", b = %.3f (true: 1..8, 0.5)\n", b);
    }
    ddp_reducer_destroy(reducer);
    ddp_group_destroy(group);
    return s == DDP_OK ? 0 : 1;
}
