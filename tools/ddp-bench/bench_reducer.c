/* Placeholder for `ddp-bench -o reducer`; the Reducer's author replaces this whole file. */
#include <stdio.h>

#include "bench.h"

int ddp_bench_reducer(ddp_group_t *group, int argc, char **argv)
{
    (void)argc;
    (void)argv;
    if (ddp_group_rank(group) == 0) fprintf(stderr, "ddp-bench: -o reducer is not built yet\n");
    return 2;
}
