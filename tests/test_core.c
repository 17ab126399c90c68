/* Core: status names, the version, last-error text, dtype/op tables, half-precision conversions, the env
 * table and the trace writer. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/half.h"
#include "core/internal.h"
#include "harness.h"

#include <unistd.h>

static void test_status_and_errors(void)
{
    CHECK(strcmp(ddp_status_string(DDP_OK), "DDP_OK") == 0);
    CHECK(strcmp(ddp_status_string(DDP_ERR_TIMEOUT), "DDP_ERR_TIMEOUT") == 0);
    CHECK(strcmp(ddp_status_string((ddp_status_t)-999), "DDP_ERR_UNKNOWN") == 0);
    /* ddp_version(): the library's version, the headers' DDP_VERSION_* (CMake refuses a
     * project() version that differs), as "MAJOR.MINOR.PATCH". */
    char headers[32];
    snprintf(headers, sizeof headers, "%d.%d.%d", DDP_VERSION_MAJOR, DDP_VERSION_MINOR,
             DDP_VERSION_PATCH);
    CHECK(ddp_version() != NULL && strcmp(ddp_version(), headers) == 0);
    CHECK(ddp_version() == ddp_version()); /* a static string: callers never free it */
    ddp_dtype_t d;
    CHECK_STATUS(ddp_dtype_parse("f99", &d), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("f99");
    CHECK_STATUS(ddp_dtype_parse(NULL, &d), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("name");
    CHECK_OK(ddp_dtype_parse("bf16", &d));
    CHECK(d == DDP_BF16);
    ddp_reduce_op_t op;
    CHECK_OK(ddp_reduce_op_parse("prod", &op));
    CHECK(op == DDP_PROD);
    CHECK_STATUS(ddp_reduce_op_parse("mean", &op), DDP_ERR_INVALID_ARGUMENT);
    CHECK(ddp_dtype_size(DDP_F16) == 2 && ddp_dtype_size(DDP_I64) == 8);
    CHECK(ddp_dtype_size((ddp_dtype_t)42) == 0);
    CHECK(strcmp(ddp_dtype_name((ddp_dtype_t)42), "invalid") == 0);
}

static void test_half_conversions(void)
{
    /* Every f16 value round-trips exactly through f32. */
    for (uint32_t h = 0; h < 0x10000u; h++) {
        float f = ddp_f16_to_f32((uint16_t)h);
        if (isnan(f)) {
            CHECK(isnan(ddp_f16_to_f32(ddp_f32_to_f16(f))));
            continue;
        }
        CHECK_MSG(ddp_f32_to_f16(f) == h, "f16 0x%04x -> %g -> 0x%04x", h, f, ddp_f32_to_f16(f));
    }
    CHECK(ddp_f16_to_f32(0x3c00) == 1.0f);
    CHECK(ddp_f16_to_f32(0x7bff) == 65504.0f);
    CHECK(ddp_f32_to_f16(65520.0f) == 0x7c00);  /* rounds to infinity */
    CHECK(ddp_f32_to_f16(65519.0f) == 0x7bff);
    /* Ties go to even: 1 + 2^-11 lies halfway between 1 and 1 + 2^-10. */
    CHECK(ddp_f32_to_f16(1.0f + 0x1p-11f) == 0x3c00);
    CHECK(ddp_f32_to_f16(1.0f + 3 * 0x1p-11f) == 0x3c02);
    CHECK(ddp_f32_to_f16(0x1p-25f) == 0x0000);       /* half the smallest subnormal: to even 0 */
    CHECK(ddp_f32_to_f16(0x1.8p-25f) == 0x0001);
    CHECK(ddp_f32_to_f16(-0.0f) == 0x8000);
    for (uint32_t b = 0; b < 0x10000u; b++) {
        float f = ddp_bf16_to_f32((uint16_t)b);
        if (isnan(f)) continue;
        CHECK(ddp_f32_to_bf16(f) == b);
    }
    CHECK(ddp_f32_to_bf16(1.0f + 0x1p-8f) == 0x3f80);  /* tie to even */
    CHECK(ddp_f32_to_bf16(1.0f + 3 * 0x1p-8f) == 0x3f82);
    CHECK(isnan(ddp_bf16_to_f32(ddp_f32_to_bf16(NAN))));
    /* The bulk conversions (vectorised, with AVX-512 BF16 where the CPU has it) give the
     * scalar's bits: f32 patterns across every exponent, denormals, ties, infinities and NaNs,
     * in runs long enough for the vector loops and a tail. */
    enum { N = 1 << 16 };
    static float f[N + 7];
    static uint16_t h[N + 7];
    static float back[N + 7];
    for (uint32_t i = 0; i < N + 7; i++) {
        uint32_t u = i * 0x9e3779b9u; /* every exponent, varied mantissas */
        if (i % 5 == 0) u &= 0x807fffffu;          /* denormal (or zero) */
        if (i % 7 == 0) u = (u & 0xffff0000u) | 0x8000u; /* a tie */
        if (i % 11 == 0) u |= 0x7f800000u;         /* infinity or NaN */
        memcpy(&f[i], &u, sizeof u);
    }
    ddp__f32_to_half(DDP_BF16, f, h, N + 7);
    for (uint32_t i = 0; i < N + 7; i++)
        CHECK_MSG(h[i] == ddp_f32_to_bf16(f[i]), "bulk bf16 of element %u: 0x%04x, scalar 0x%04x",
                  i, h[i], ddp_f32_to_bf16(f[i]));
    for (uint32_t i = 0; i < N + 7; i++) h[i] = (uint16_t)(i * 40503u);
    ddp__half_to_f32(DDP_BF16, h, back, N + 7);
    for (uint32_t i = 0; i < N + 7; i++) {
        float want = ddp_bf16_to_f32(h[i]);
        CHECK_MSG(memcmp(&back[i], &want, sizeof want) == 0, "bulk widening of 0x%04x", h[i]);
    }
}

static void test_env_table(void)
{
    const ddp_env_var_t *table;
    size_t n = ddp_env_vars(&table);
    int found = 0;
    for (size_t i = 0; i < n; i++) {
        CHECK(strncmp(table[i].name, "DDP_", 4) == 0 || strchr(table[i].name, '_') || 1);
        CHECK(table[i].help && table[i].help[0]);
        CHECK(table[i].accepted != NULL);
        if (strcmp(table[i].name, "DDP_TIMEOUT") == 0) {
            found = 1;
            CHECK(strstr(table[i].accepted, "2000000"));
        }
        if (strncmp(table[i].name, "DDP_", 4) == 0) CHECK(table[i].accepted[0]);
    }
    CHECK(found);
    unsetenv("DDP_TIMEOUT");
    int ms = 0;
    CHECK(ddp_default_timeout_ms() == 300000);
    CHECK_OK(ddp_config_timeout_ms(&ms));
    CHECK(ms == 300000);
    CHECK_OK(ddp_config_check());
    setenv("DDP_TIMEOUT", "2.5", 1);
    CHECK(ddp_default_timeout_ms() == 2500);
    CHECK_OK(ddp_config_timeout_ms(&ms));
    CHECK(ms == 2500);
    setenv("DDP_TIMEOUT", "0.0001", 1); /* below a millisecond: 1 ms, as before */
    CHECK_OK(ddp_config_timeout_ms(&ms));
    CHECK(ms == 1);
    setenv("DDP_TIMEOUT", "1e3", 1);
    CHECK_OK(ddp_config_timeout_ms(&ms));
    CHECK(ms == 1000000);
    /* A bad value: the unchecked call gives the default and leaves the last error alone; the
     * checked ones name the variable, the value and what is accepted. */
    setenv("DDP_TIMEOUT", "garbage", 1);
    ddp__error(DDP_ERR_TIMEOUT, "an earlier error");
    CHECK(ddp_default_timeout_ms() == 300000);
    CHECK_ERROR_MENTIONS("an earlier error");
    ms = 7;
    CHECK_STATUS(ddp_config_timeout_ms(&ms), DDP_ERR_INVALID_ARGUMENT);
    CHECK(ms == 7);
    CHECK_ERROR_MENTIONS("DDP_TIMEOUT='garbage'");
    CHECK_ERROR_MENTIONS("seconds");
    CHECK_STATUS(ddp_config_check(), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("DDP_TIMEOUT='garbage'");
    unsetenv("DDP_TIMEOUT");
    setenv("DDP_LOG_LEVEL", "loud", 1);
    CHECK_STATUS(ddp_config_check(), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("DDP_LOG_LEVEL='loud'");
    CHECK_ERROR_MENTIONS("none|error|warn|info|debug");
    setenv("DDP_LOG_LEVEL", "", 1); /* empty is unset */
    CHECK_OK(ddp_config_check());
    unsetenv("DDP_LOG_LEVEL");
}

static void test_trace(void)
{
    const char *dir = ddp_test_tmpdir();
    CHECK(dir);
    char path[600];
    snprintf(path, sizeof path, "%s/t.json", dir);
    ddp_trace_t *t;
    CHECK_OK(ddp_trace_open(path, 3, &t));
    CHECK_OK(ddp_trace_name_lane(t, 1, "comm"));
    CHECK_OK(ddp_trace_span(t, "bucket \"0\"", "allreduce", 1, 10.0, 25.5));
    const char *args[4] = {"variant", "staged:\"nt\"", "bytes", "65536-131071"};
    CHECK_OK(ddp_trace_instant(t, "shm tune", "tune", 0, 30.25, args, 2));
    CHECK_OK(ddp_trace_instant(t, "no args", NULL, 0, 31.0, NULL, 0));
    CHECK_STATUS(ddp_trace_instant(t, "x", "tune", 0, INFINITY, NULL, 0), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("ts_us");
    CHECK_STATUS(ddp_trace_instant(t, "x", "tune", 0, 1.0, NULL, 1), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("nargs");
    const char *half[2] = {"key", NULL};
    CHECK_STATUS(ddp_trace_instant(t, "x", "tune", 0, 1.0, half, 1), DDP_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("args[1]");
    CHECK_STATUS(ddp_trace_instant(NULL, "x", "tune", 0, 1.0, NULL, 0), DDP_ERR_INVALID_ARGUMENT);
    CHECK_OK(ddp_trace_close(t));
    FILE *f = fopen(path, "r");
    CHECK(f);
    char buf[4096];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    CHECK(strstr(buf, "\"traceEvents\""));
    CHECK(strstr(buf, "bucket \\\"0\\\""));
    CHECK(strstr(buf, "\"dur\":15.500"));
    CHECK(strstr(buf, "\"pid\":3"));
    CHECK(strstr(buf, "{\"name\":\"shm tune\",\"cat\":\"tune\",\"ph\":\"i\",\"s\":\"p\",\"pid\":3,"
                      "\"tid\":0,\"ts\":30.250,\"args\":{\"variant\":\"staged:\\\"nt\\\"\","
                      "\"bytes\":\"65536-131071\"}}"));
    CHECK(strstr(buf, "\"name\":\"no args\",\"cat\":\"ddp\",\"ph\":\"i\""));
    CHECK(!strstr(buf, "\"x\""));
    remove(path);
    rmdir(dir);
    CHECK_STATUS(ddp_trace_open("/nonexistent-dir/x.json", 0, &t), DDP_ERR_SYSTEM);
    CHECK_ERROR_MENTIONS("/nonexistent-dir/x.json");
}

int main(void)
{
    test_status_and_errors();
    test_half_conversions();
    test_env_table();
    test_trace();
    printf("test_core: ok\n");
    return 0;
}
