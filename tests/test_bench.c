/* ddp-bench smoke test: under ddprun, every collective with checking on reports wrong = 0 for
 * sizes 0, 1 element, odd, prime and large counts on 1-3 ranks (user, registered user and segment
 * buffers, in place and not; registered allreduces above 16 KiB ran "mapped"); a spoiled element
 * is counted and fails the run; bad options exit 2 naming the option.
 * For `-o reducer`: --help exits 0, only PowerSGD reports a compression rate, and both bucket
 * layouts run interleaved.
 * No timing is asserted (the machine is shared): the bench runs with one short round per size. */
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

#ifndef DDPRUN_PATH
#error "DDPRUN_PATH must name build/ddprun"
#endif
#ifndef DDP_BENCH_PATH
#error "DDP_BENCH_PATH must name build/ddp-bench"
#endif

static char tmpdir[512];
static char out_text[1 << 16], err_text[1 << 16];

static void read_file(const char *path, char *buf, size_t size)
{
    FILE *f = fopen(path, "r");
    size_t n = 0;
    if (f) {
        n = fread(buf, 1, size - 1, f);
        fclose(f);
    }
    buf[n] = 0;
}

/* Runs `command` through the shell with stdout and stderr captured; returns the exit code. */
static int run(const char *command)
{
    char full[4096];
    snprintf(full, sizeof full, "%s >%s/out 2>%s/err", command, tmpdir, tmpdir);
    int status = system(full);
    char path[600];
    snprintf(path, sizeof path, "%s/out", tmpdir);
    read_file(path, out_text, sizeof out_text);
    snprintf(path, sizeof path, "%s/err", tmpdir);
    read_file(path, err_text, sizeof err_text);
    CHECK_MSG(status != -1 && WIFEXITED(status), "%s did not exit normally", command);
    return WEXITSTATUS(status);
}

/* Counts the JSON rows of the last run and checks each has "wrong":0 and the given fields
 * ("registered" is 1 when `registered`, else 0). */
static int json_rows(const char *op, int world, int segment, int registered)
{
    int rows = 0;
    char want_op[64], want_world[64], want_segment[64], want_registered[64];
    snprintf(want_op, sizeof want_op, "\"op\":\"%s\"", op);
    snprintf(want_world, sizeof want_world, "\"world_size\":%d", world);
    snprintf(want_segment, sizeof want_segment, "\"segment\":%d", segment);
    snprintf(want_registered, sizeof want_registered, "\"registered\":%d", registered);
    for (char *line = out_text; line && *line;) {
        char *end = strchr(line, '\n');
        if (end) *end = 0;
        if (line[0] == '{') {
            rows++;
            CHECK_MSG(strstr(line, "\"wrong\":0,"), "row with wrong elements: %s", line);
            CHECK_MSG(strstr(line, want_op) && strstr(line, want_world) &&
                          strstr(line, want_segment) && strstr(line, want_registered),
                      "row '%s' lacks %s, %s, %s or %s", line, want_op, want_world, want_segment,
                      want_registered);
            CHECK_MSG(strstr(line, "\"time_us\":") && strstr(line, "\"algbw\":") &&
                          strstr(line, "\"busbw\":") && strstr(line, "\"bytes\":"),
                      "row '%s' lacks a column", line);
        }
        line = end ? end + 1 : NULL;
    }
    return rows;
}

/* After an allreduce sweep with --register 1 on shm: every row above the one-shot size (16 KiB)
 * ran "mapped" in every round, i.e. the bench really registered its buffers. */
static void check_mapped_rows(void)
{
    int mapped = 0;
    for (const char *line = out_text; (line = strchr(line, '{')) != NULL; line++) {
        const char *bytes = strstr(line, "\"bytes\":"), *end = strchr(line, '\n');
        CHECK(bytes);
        if (strtoull(bytes + 8, NULL, 10) <= 16384) continue;
        const char *alg = strstr(line, "\"algorithm\":\"mapped\"");
        CHECK_MSG(alg && (!end || alg < end), "a registered row did not run mapped: %.*s",
                  end ? (int)(end - line) : (int)strlen(line), line);
        mapped++;
    }
    CHECK_MSG(mapped > 0, "no registered row above 16 KiB:\n%s", out_text);
}

#define QUICK "--json -c 1 -n 1 -w 1 --rounds 1 --min-ms 0"

/* One checked sweep; `rows` is how many sizes the sweep has. */
static void sweep(int world, const char *op, const char *args, int segment, int rows)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s -n %d --no-prefix %s -o %s %s --segment %d " QUICK, DDPRUN_PATH,
             world, DDP_BENCH_PATH, op, args, segment);
    int rc = run(cmd);
    CHECK_MSG(rc == 0, "'%s' exited %d\nstdout:\n%s\nstderr:\n%s", cmd, rc, out_text, err_text);
    int registered = strstr(args, "--register 1") != NULL;
    if (registered && world > 1 && !strcmp(op, "allreduce")) check_mapped_rows();
    int got = json_rows(op, world, segment, registered); /* cuts out_text into lines */
    CHECK_MSG(got == rows, "'%s' printed %d rows, expected %d:\n%s", cmd, got, rows, out_text);
}

static void bad_option(const char *args, const char *mention)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s %s", DDP_BENCH_PATH, args);
    int rc = run(cmd);
    CHECK_MSG(rc == 2, "'%s' exited %d, expected 2 (stderr: %s)", cmd, rc, err_text);
    CHECK_MSG(strstr(err_text, mention), "'%s': stderr '%s' does not mention '%s'", cmd, err_text,
              mention);
}

int main(void)
{
    const char *dir = ddp_test_tmpdir();
    CHECK(dir != NULL);
    snprintf(tmpdir, sizeof tmpdir, "%s", dir);

    /* f32 counts 1, 7, 49, 343, 2401, 16807, 117649 (odd; 7 is prime) and 1 MiB + a prime. */
    const char *odd = "-d f32 -b 4 -e 500K -f 7";
    sweep(2, "allreduce", odd, 0, 7);
    sweep(2, "allreduce", odd, 1, 7);
    sweep(2, "allreduce", "-d f32 -b 4194316 -e 4194316", 0, 1); /* 1 Mi + 3 elements */
    sweep(2, "allreduce", "-d f32 -b 0 -e 0", 0, 1);               /* count 0 */
    sweep(2, "allreduce", "-d i32 -r prod -b 4 -e 4K -f 11 --inplace 1", 0, 3);
    sweep(2, "allreduce", "-d f16 -r avg -b 2 -e 2K -f 13 --inplace 1", 1, 3);
    sweep(2, "allreduce", "-d bf16 -r max -b 6 -e 6K -f 10", 0, 4);
    sweep(2, "allreduce", "-d f64 -r min -b 8 -e 8K -f 10", 0, 4);
    sweep(2, "allreduce", "-d i64 -r avg -b 8 -e 8K -f 10", 0, 4);
    sweep(2, "broadcast", "-d f32 -b 4 -e 1M -f 7 --root 1", 0, 7);
    sweep(2, "reduce_scatter", "-d f32 -b 8 -e 1M -f 9", 0, 6);
    sweep(2, "reduce_scatter", "-d f32 -b 8 -e 1M -f 9 --inplace 1", 1, 6);
    sweep(2, "allgather", "-d f32 -b 8 -e 1M -f 9", 1, 6);
    sweep(2, "allgather", "-d f32 -b 8 -e 1M -f 9 --inplace 1", 0, 6);
    sweep(2, "barrier", "", 0, 1);
    /* Registered malloc'd buffers (--register 1): checked, and mapped above 16 KiB on shm. */
    sweep(2, "allreduce", "-d f32 -b 4 -e 4194316 -f 7 --register 1", 0, 8);
    sweep(3, "allreduce", "-d bf16 -r avg -b 2 -e 1M -f 9 --inplace 1 --register 1", 0, 6);
    sweep(2, "reduce_scatter", "-d f32 -b 8 -e 1M -f 9 --register 1", 0, 6);
    /* Three ranks (blocks of a third) and one rank (no peers). */
    sweep(3, "allreduce", odd, 0, 7);
    sweep(3, "reduce_scatter", "-d f32 -b 12 -e 1M -f 9 -r max", 1, 6);
    sweep(3, "allgather", "-d i32 -b 12 -e 1M -f 9 --inplace 1", 0, 6);
    sweep(1, "allreduce", "-d f32 -b 4 -e 64K -f 16", 0, 4);

    /* The collectives built from the five, and send/recv: checked sweeps on 3 ranks (unequal
     * blocks for the v forms; the last rank idles in sendrecv) and a spoiled element caught. */
    static const char *const more[] = {"reduce", "gather", "scatter", "alltoall", "allgatherv",
                                       "reduce_scatterv", "alltoallv", "allreduce_coalesced",
                                       "broadcast_coalesced", "sendrecv"};
    for (size_t k = 0; k < sizeof more / sizeof more[0]; k++) {
        sweep(3, more[k], "-d f32 -b 4 -e 1M -f 9 --root 2", k % 2, 6);
        char spoil[1024];
        snprintf(spoil, sizeof spoil, "%s -n 2 --no-prefix %s -o %s -b 64 -e 64 --test-corrupt 1 " QUICK,
                 DDPRUN_PATH, DDP_BENCH_PATH, more[k]);
        int spoiled = run(spoil);
        CHECK_MSG(spoiled != 0 && strstr(out_text, "\"wrong\":1,"),
                  "-o %s: a spoiled element went unnoticed:\n%s", more[k], out_text);
    }
    sweep(2, "reduce_scatterv", "-d bf16 -r avg -b 2 -e 64K -f 15", 0, 4);
    sweep(2, "allreduce_coalesced", "-d i32 -r prod -b 4 -e 4K -f 11", 0, 3);

    /* The check catches a wrong element: the run fails and the row counts it. */
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s -n 2 --no-prefix %s -o allreduce -b 64 -e 64 --test-corrupt 1 " QUICK,
             DDPRUN_PATH, DDP_BENCH_PATH);
    int rc = run(cmd);
    CHECK_MSG(rc != 0, "a spoiled element went unnoticed:\n%s", out_text);
    CHECK_MSG(strstr(out_text, "\"wrong\":1,"), "the spoiled element is not counted:\n%s", out_text);

    /* Rank 0 alone prints the table. */
    snprintf(cmd, sizeof cmd, "%s -n 2 %s -o allreduce -b 8 -e 32 -c 1 -n 1 -w 0 --rounds 1 --min-ms 0",
             DDPRUN_PATH, DDP_BENCH_PATH);
    rc = run(cmd);
    CHECK_MSG(rc == 0, "table run exited %d: %s", rc, err_text);
    CHECK_MSG(strstr(out_text, "algbw(GB/s)") && strstr(out_text, "busbw(GB/s)"), "no header:\n%s",
              out_text);
    CHECK_MSG(strstr(out_text, "[1]") == NULL, "rank 1 printed:\n%s", out_text);

    /* `-o reducer --help` prints the reducer benchmark's options and exits 0 (it used to stop at
     * "option needs a value" with exit code 2). */
    rc = run(DDP_BENCH_PATH " -o reducer --help");
    CHECK_MSG(rc == 0, "-o reducer --help exited %d: %s", rc, err_text);
    CHECK_MSG(strstr(out_text, "--preset") && strstr(out_text, "--layout"),
              "-o reducer --help printed:\n%s", out_text);

    /* The hook line: only PowerSGD has a compression rate to report. */
    static const char *const half_hooks[2] = {"fp16", "bf16"};
    for (int k = 0; k < 2; k++) {
        snprintf(cmd, sizeof cmd,
                 "%s -o reducer --preset mlp -n 1 -w 0 --compute-us 0 --hook %s", DDP_BENCH_PATH,
                 half_hooks[k]);
        rc = run(cmd);
        CHECK_MSG(rc == 0, "'%s' exited %d: %s", cmd, rc, err_text);
        char want[32];
        snprintf(want, sizeof want, "# hook %s: wire", half_hooks[k]);
        CHECK_MSG(strstr(out_text, want), "'%s' printed no hook line:\n%s", cmd, out_text);
        CHECK_MSG(strstr(out_text, "PowerSGD") == NULL, "'%s' mentions PowerSGD:\n%s", cmd,
                  out_text);
    }
    snprintf(cmd, sizeof cmd, "%s -o reducer --preset mlp -n 1 -w 0 --compute-us 0 --hook powersgd:1",
             DDP_BENCH_PATH);
    rc = run(cmd);
    if (rc == 2 && strstr(err_text, "not built with PowerSGD")) {
        printf("test_bench: ddp-bench has no PowerSGD (no CBLAS): its hook line is not checked\n");
    } else {
        CHECK_MSG(rc == 0, "'%s' exited %d: %s", cmd, rc, err_text);
        CHECK_MSG(strstr(out_text, "PowerSGD compression rate"), "'%s' printed:\n%s", cmd,
                  out_text);
    }

    /* Both initial bucket layouts, interleaved, with the rebuild off: one JSON row per run. */
    snprintf(cmd, sizeof cmd,
             "%s -n 2 --no-prefix %s -o reducer --preset mlp -n 1 -w 0 --compute-us 0 "
             "--layout both --no-rebuild --repeat 2 --json",
             DDPRUN_PATH, DDP_BENCH_PATH);
    rc = run(cmd);
    CHECK_MSG(rc == 0, "'%s' exited %d: %s", cmd, rc, err_text);
    static const char *const layout_rows[2] = {"\"layout\":\"last-first\",\"rebuild\":0",
                                               "\"layout\":\"c10d\",\"rebuild\":0"};
    int rows[2] = {0, 0};
    for (int k = 0; k < 2; k++)
        for (const char *at = out_text; (at = strstr(at, layout_rows[k])) != NULL; at++) rows[k]++;
    CHECK_MSG(rows[0] == 2 && rows[1] == 2, "expected 2 runs per layout:\n%s", out_text);

    /* Every gradient memory mode, interleaved: one JSON row each, the same buckets. */
    snprintf(cmd, sizeof cmd,
             "%s -n 2 --no-prefix %s -o reducer --preset mlp -n 1 -w 0 --compute-us 0 "
             "--grads buckets,block,user-block,user-malloc,copy --json",
             DDPRUN_PATH, DDP_BENCH_PATH);
    rc = run(cmd);
    CHECK_MSG(rc == 0, "'%s' exited %d: %s", cmd, rc, err_text);
    static const char *const grads_rows[5] = {"\"grads\":\"buckets\",", "\"grads\":\"block\",",
                                              "\"grads\":\"user-block\",",
                                              "\"grads\":\"user-malloc\",", "\"grads\":\"copy\","};
    for (int k = 0; k < 5; k++) {
        int n = 0;
        for (const char *at = out_text; (at = strstr(at, grads_rows[k])) != NULL; at++) n++;
        CHECK_MSG(n == 1, "expected one run with %s:\n%s", grads_rows[k], out_text);
    }
    int same = 0;
    for (const char *at = out_text; (at = strstr(at, "\"buckets\":2,")) != NULL; at++) same++;
    CHECK_MSG(same == 5, "a gradient mode changed the MLP's 2 buckets:\n%s", out_text);

    /* Bad options: exit 2 with the option named, before any group exists. */
    bad_option("--bogus", "--bogus");
    bad_option("-o reducer --grads block,nope", "--grads");
    bad_option("-o allreduce_all", "-o");
    bad_option("-d f17", "-d");
    bad_option("-r mean", "-r");
    bad_option("-b 8 -e 4", "-b");
    bad_option("-b 12Q", "-b");
    bad_option("-f 1", "-f");
    bad_option("-n 0", "-n");
    bad_option("-c 2", "-c");
    bad_option("--segment", "--segment");
    bad_option("--register 2", "--register");
    bad_option("--register 1 --segment 1", "--register");
    bad_option("-n 3 -o reducer", "-o reducer");
    bad_option("-o reducer --layout sideways", "--layout");
    bad_option("-o reducer --repeat 0", "--repeat");
    snprintf(cmd, sizeof cmd, "%s -n 2 %s --bogus", DDPRUN_PATH, DDP_BENCH_PATH);
    rc = run(cmd);
    CHECK_MSG(rc != 0 && strstr(err_text, "--bogus"), "under ddprun --bogus exited %d: %s", rc,
              err_text);
    snprintf(cmd, sizeof cmd, "%s -n 2 %s --root 2 -b 8 -e 8 -o broadcast", DDPRUN_PATH,
             DDP_BENCH_PATH);
    rc = run(cmd);
    CHECK_MSG(rc != 0 && strstr(err_text, "--root"), "--root 2 of 2 ranks exited %d: %s", rc,
              err_text);

    char rm[600];
    snprintf(rm, sizeof rm, "rm -rf %s", tmpdir);
    if (system(rm) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
    printf("test_bench: ok\n");
    return 0;
}
