/* Writes the seed corpus of every fuzz target (tests/fuzz/corpus/<target>/) with the project's
 * own code: a store session recorded between the real TCP store client and server, replies of
 * a real c10d TCPStore (torch's, when its port is given) recorded under the real c10d client,
 * the hello the TCP transport sends, the descriptions two real shm ranks publish, DDP_*
 * settings from the config table, and real checkpoints and states of every kind (libddp's
 * optimizer and ZeRO, PowerSGD after compressed steps, both trainers' files).
 *
 *     make_seeds OUT_DIR [C10D_PORT]        (tests/fuzz/make_seeds.sh runs it with torch's store)
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define FUZZ_WITH_POWERSGD 1
#define FUZZ_WITH_FM 1
#define FUZZ_WITH_GPT 1
#include "fuzz_common.h"
#include "fuzz_setups.h"
#include "transport/tcp/tcp.h"

static const char *out_dir;

static void die(const char *what)
{
    fprintf(stderr, "make_seeds: %s: %s\n", what, ddp_last_error());
    exit(1);
}

#define OK(call)                                                                                   \
    do {                                                                                           \
        if ((call) != DDP_OK) die(#call);                                                          \
    } while (0)

static void write_seed(const char *target, const char *name, const void *data, size_t len)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", out_dir, target);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/%s/%s", out_dir, target, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, len, f) != len || fclose(f) != 0) {
        perror(path);
        exit(1);
    }
    printf("%s/%s: %zu bytes\n", target, name, len);
}

/* ---- a recording proxy: relays connections to a server, keeping both directions' bytes ---- */
#define PROXY_CONNS 8
typedef struct proxy {
    int listen_fd, port, target_port, stop[2];
    int nconns;
    int client[PROXY_CONNS], server[PROXY_CONNS];
    uint8_t *sent[PROXY_CONNS], *answered[PROXY_CONNS]; /* client -> server, server -> client */
    size_t sent_len[PROXY_CONNS], answered_len[PROXY_CONNS];
    pthread_t thread;
} proxy_t;

static void append(uint8_t **buf, size_t *len, const uint8_t *data, size_t n)
{
    *buf = realloc(*buf, *len + n);
    memcpy(*buf + *len, data, n);
    *len += n;
}

static void *proxy_run(void *arg)
{
    proxy_t *p = arg;
    for (;;) {
        struct pollfd fds[2 + 2 * PROXY_CONNS];
        int n = 0;
        fds[n++] = (struct pollfd){p->stop[0], POLLIN, 0};
        fds[n++] = (struct pollfd){p->listen_fd, POLLIN, 0};
        for (int i = 0; i < p->nconns; i++) {
            fds[n++] = (struct pollfd){p->client[i], POLLIN, 0};
            fds[n++] = (struct pollfd){p->server[i], POLLIN, 0};
        }
        if (poll(fds, (nfds_t)n, 1000) < 0) continue;
        if (fds[0].revents) return NULL;
        if (fds[1].revents & POLLIN && p->nconns < PROXY_CONNS) {
            int c = accept(p->listen_fd, NULL, NULL);
            int s = socket(AF_INET, SOCK_STREAM, 0);
            struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)p->target_port)};
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            if (c < 0 || s < 0 || connect(s, (struct sockaddr *)&a, sizeof a) != 0) {
                perror("proxy");
                exit(1);
            }
            p->client[p->nconns] = c;
            p->server[p->nconns] = s;
            p->nconns++;
        }
        for (int i = 0; i < p->nconns; i++) {
            uint8_t buf[65536];
            for (int side = 0; side < 2; side++) {
                struct pollfd *f = &fds[2 + 2 * i + side];
                if (f->fd < 0 || !(f->revents & (POLLIN | POLLHUP | POLLERR))) continue;
                int from = side ? p->server[i] : p->client[i], to = side ? p->client[i] : p->server[i];
                ssize_t got = recv(from, buf, sizeof buf, 0);
                if (got <= 0) {
                    shutdown(to, SHUT_WR);
                    if (side) p->server[i] = -1; else p->client[i] = -1;
                    continue;
                }
                if (side) append(&p->answered[i], &p->answered_len[i], buf, (size_t)got);
                else append(&p->sent[i], &p->sent_len[i], buf, (size_t)got);
                for (ssize_t done = 0; done < got;) {
                    ssize_t w = send(to, buf + done, (size_t)(got - done), MSG_NOSIGNAL);
                    if (w <= 0) break;
                    done += w;
                }
            }
        }
    }
}

static void proxy_start(proxy_t *p, int target_port)
{
    memset(p, 0, sizeof *p);
    p->target_port = target_port;
    p->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (bind(p->listen_fd, (struct sockaddr *)&a, sizeof a) || listen(p->listen_fd, 16) ||
        getsockname(p->listen_fd, (struct sockaddr *)&a, &len) || pipe(p->stop)) {
        perror("proxy");
        exit(1);
    }
    p->port = ntohs(a.sin_port);
    pthread_create(&p->thread, NULL, proxy_run, p);
}

static void proxy_stop(proxy_t *p)
{
    usleep(200000); /* the last bytes relayed */
    if (write(p->stop[1], "x", 1) != 1) exit(1);
    pthread_join(p->thread, NULL);
    close(p->listen_fd);
}

/* ---- the TCP store: a session of every request, recorded between client and server -------- */
static void store_seeds(void)
{
    ddp_store_server_t *server;
    OK(ddp_store_server_start("127.0.0.1", 0, "fuzz-token", &server));
    proxy_t p;
    proxy_start(&p, ddp_store_server_port(server));
    ddp_store_t *a, *b;
    OK(ddp_store_tcp_connect("127.0.0.1", p.port, "fuzz-token", 5000, &a));
    OK(ddp_store_set(a, "key", "value", 5));
    void *v;
    size_t len;
    OK(ddp_store_get(a, "key", &v, &len));
    ddp_free(v);
    int64_t n;
    OK(ddp_store_add(a, "counter", 5, &n));
    OK(ddp_store_compare_set(a, "key", "value", 5, "other", 5, &v, &len));
    ddp_free(v);
    const char *keys[2] = {"key", "counter"};
    int exists;
    OK(ddp_store_check(a, keys, 2, &exists));
    OK(ddp_store_wait(a, keys, 2, 1000));
    int deleted;
    OK(ddp_store_delete(a, "counter", &deleted));
    OK(ddp_store_num_keys(a, &n));
    ddp_store_destroy(a);
    /* Two connections: the second sets the key the first waits for. */
    OK(ddp_store_tcp_connect("127.0.0.1", p.port, "fuzz-token", 5000, &b));
    OK(ddp_store_tcp_connect("127.0.0.1", p.port, "fuzz-token", 5000, &a));
    OK(ddp_store_set(b, "late", "1", 1));
    OK(ddp_store_get(a, "late", &v, &len));
    ddp_free(v);
    ddp_store_destroy(a);
    ddp_store_destroy(b);
    proxy_stop(&p);
    ddp_store_server_stop(server);
    /* The first connection's bytes: a whole session; and each request frame on its own for the
     * codec's corpus is already in corpus/store_frame. */
    uint8_t *one = malloc(3 + p.sent_len[0]);
    one[0] = 0;
    one[1] = one[2] = 0;
    memcpy(one + 3, p.sent[0], p.sent_len[0]);
    write_seed("store_server", "session", one, 3 + p.sent_len[0]);
    one[0] = 2; /* the same against a server without a token */
    write_seed("store_server", "session_tokenless", one, 3 + p.sent_len[0]);
    free(one);
    /* Connections 1 (b, the setter) and 2 (a, the waiter): waiter first, setter after the split. */
    size_t la = p.sent_len[2], lb = p.sent_len[1];
    uint8_t *two = malloc(3 + la + lb);
    two[0] = 1;
    two[1] = (uint8_t)la;
    two[2] = (uint8_t)(la >> 8);
    memcpy(two + 3, p.sent[2], la);
    memcpy(two + 3 + la, p.sent[1], lb);
    write_seed("store_server", "wait_then_set", two, 3 + la + lb);
    free(two);
}

/* ---- c10d: torch's TCPStore answering the fuzz target's script of requests ----------------- */
static void c10d_seeds(int port)
{
    ddp_store_t *direct;
    OK(ddp_store_c10d_connect("127.0.0.1", port, 5000, &direct));
    OK(ddp_store_set(direct, "b", "present", 7));
    proxy_t p;
    proxy_start(&p, port);
    ddp_store_t *s;
    OK(ddp_store_c10d_connect("127.0.0.1", p.port, 5000, &s));
    /* The script of fuzz_c10d_reply.c's one(): ops 0..8 in order. */
    void *v;
    size_t len;
    int64_t n;
    int flag;
    const char *two[2] = {"a", "b"};
    OK(ddp_store_set(s, "a", "1", 1));
    OK(ddp_store_get(s, "a", &v, &len));
    ddp_free(v);
    OK(ddp_store_add(s, "n", 3, &n));
    OK(ddp_store_compare_set(s, "a", "1", 1, "2", 1, &v, &len));
    ddp_free(v);
    OK(ddp_store_check(s, two, 2, &flag));
    OK(ddp_store_wait(s, two, 2, 50));
    OK(ddp_store_delete(s, "a", &flag));
    OK(ddp_store_num_keys(s, &n));
    OK(ddp_store_get(s, "b", &v, &len));
    ddp_free(v);
    ddp_store_destroy(s);
    ddp_store_destroy(direct);
    proxy_stop(&p);
    /* Connection 0 was the probe; 1 carried the script. */
    size_t rl = p.answered_len[1];
    uint8_t *seed = malloc(10 + rl);
    seed[0] = 9;
    for (int i = 0; i < 9; i++) seed[1 + i] = (uint8_t)i;
    memcpy(seed + 10, p.answered[1], rl);
    write_seed("c10d_reply", "torch_script", seed, 10 + rl);
    free(seed);
}

/* ---- the TCP transport's hello ------------------------------------------------------------- */
static void hello_seeds(void)
{
    char h[DDP_TCP_MAX_HELLO];
    size_t n = ddp__tcp_hello_encode(h, 1, 2, 4, "fuzz-token", "fuzz-group");
    write_seed("tcp_hello", "rank1", h, n);
    n = ddp__tcp_hello_encode(h, 0, 2, 4, "fuzz-token", "fuzz-group");
    write_seed("tcp_hello", "rank0_again", h, n);
    n = ddp__tcp_hello_encode(h, 1, 2, 4, "", "fuzz-group");
    write_seed("tcp_hello", "no_token", h, n);
}

/* ---- shm: what two real ranks publish -------------------------------------------------------- */
static void shm_rank(const char *path, int rank)
{
    ddp_store_t *store;
    ddp_group_t *group;
    ddp_group_options_t o = DDP_GROUP_OPTIONS_INIT;
    o.transport = "shm";
    o.timeout_ms = 30000;
    void *buf;
    if (ddp_store_file_create(path, &store) != DDP_OK ||
        ddp_group_create(store, rank, 2, &o, &group) != DDP_OK ||
        ddp_group_alloc_buffer(group, 4096, &buf) != DDP_OK)
        die("shm rank");
    ddp_group_free_buffer(group, buf);
    ddp_group_destroy(group);
    ddp_store_destroy(store);
    _exit(0);
}

static void shm_seeds(void)
{
    char path[] = "/tmp/make_seeds_store.XXXXXX";
    int fd = mkstemp(path);
    close(fd);
    unlink(path);
    pid_t pids[2];
    for (int r = 0; r < 2; r++)
        if ((pids[r] = fork()) == 0) shm_rank(path, r);
    for (int r = 0; r < 2; r++) {
        int st;
        waitpid(pids[r], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) die("shm ranks");
    }
    /* The file store's log: 16-byte records (magic, op, key length, value length), key, value. */
    FILE *f = fopen(path, "rb");
    if (!f) die("shm log");
    uint32_t hdr[4];
    while (fread(hdr, 4, 4, f) == 4) {
        char key[1024] = "", value[1024] = "";
        if (hdr[2] >= sizeof key || hdr[3] >= sizeof value) break;
        if (fread(key, 1, hdr[2], f) != hdr[2] || fread(value, 1, hdr[3], f) != hdr[3]) break;
        const char *shm = strstr(key, "/shm/");
        if (!shm) continue;
        char name[256];
        snprintf(name, sizeof name, "%s", shm + 5);
        for (char *c = name; *c; c++)
            if (*c == '/') *c = '_';
        write_seed("shm_desc", name, value, hdr[3]);
    }
    fclose(f);
    unlink(path);
}

/* ---- DDP_* and the launchers' variables ------------------------------------------------------- */
static void env_seeds(void)
{
    const ddp_env_var_t *table;
    size_t n = ddp_env_vars(&table);
    char *text = NULL;
    size_t len = 0;
    for (size_t i = 0; i < n; i++) {
        char line[512];
        int k = snprintf(line, sizeof line, "%s=%s\n", table[i].name,
                         table[i].default_value[0] ? table[i].default_value : "1");
        append((uint8_t **)&text, &len, (const uint8_t *)line, (size_t)k);
    }
    write_seed("env", "defaults", text, len);
    free(text);
    static const char torchrun[] = "RANK=1\nWORLD_SIZE=4\nLOCAL_RANK=1\nLOCAL_WORLD_SIZE=2\n"
                                   "MASTER_ADDR=127.0.0.1\nMASTER_PORT=29500\nDDP_TIMEOUT=0.5\n";
    write_seed("env", "torchrun", torchrun, sizeof torchrun - 1);
    static const char slurm[] = "SLURM_PROCID=3\nSLURM_NTASKS=4\nSLURM_LOCALID=1\nSLURM_NODEID=1\n"
                                "SLURM_STEP_TASKS_PER_NODE=2(x2)\nSLURM_JOB_ID=77\n"
                                "SLURM_STEP_ID=0\nSLURM_STEP_NODELIST=node[01-02]\n";
    write_seed("env", "slurm", slurm, sizeof slurm - 1);
    static const char mpi[] = "OMPI_COMM_WORLD_RANK=0\nOMPI_COMM_WORLD_SIZE=2\n"
                              "OMPI_COMM_WORLD_LOCAL_RANK=0\nOMPI_COMM_WORLD_LOCAL_SIZE=2\n"
                              "DDP_STORE_ADDR=host\nDDP_STORE_PORT=1234\nDDP_STORE_TOKEN=t\n";
    write_seed("env", "openmpi", mpi, sizeof mpi - 1);
}

/* ---- optimizer, ZeRO and PowerSGD states --------------------------------------------------- */
static void *save_optim(ddp_optim_t *o, size_t *bytes)
{
    OK(ddp_optim_state_size(o, bytes));
    void *b = malloc(*bytes);
    OK(ddp_optim_state_save(o, b, *bytes));
    return b;
}

static void optim_seeds(void)
{
    fuzz_optims_t f;
    if (fuzz_optims_create(&f) != 0) die("optimizers");
    /* Two steps each, so the moments and step counts are not zero. */
    float g0[12];
    uint16_t g1[5];
    double g2[3];
    for (int i = 0; i < 12; i++) g0[i] = 0.1f * (float)(i - 6);
    for (int i = 0; i < 5; i++) g1[i] = 0x3dcc; /* bf16 0.1 */
    for (int i = 0; i < 3; i++) g2[i] = 0.5 - i;
    void *grads[3] = {g0, g1, g2};
    static const char *const names[FUZZ_NOPTIMS] = {"sgd_momentum", "adam_amsgrad", "adamw"};
    for (int k = 0; k < FUZZ_NOPTIMS; k++) {
        OK(ddp_optim_step(f.optim[k], grads));
        OK(ddp_optim_step(f.optim[k], grads));
        size_t bytes;
        void *b = save_optim(f.optim[k], &bytes);
        write_seed("optim_state", names[k], b, bytes);
        free(b);
    }
    for (int k = 0; k < FUZZ_NZEROS; k++) {
        OK(ddp_zero_step(f.zero[k], grads));
        size_t bytes;
        OK(ddp_zero_state_size(f.zero[k], &bytes));
        void *b = malloc(bytes);
        OK(ddp_zero_state_save(f.zero[k], b, bytes));
        write_seed("optim_state", k ? "zero2_shard" : "zero1_shard", b, bytes);
        free(b);
        OK(ddp_zero_consolidated_state_size(f.zero[k], &bytes));
        b = malloc(bytes);
        OK(ddp_zero_state_consolidate(f.zero[k], 0, b, bytes));
        write_seed("optim_state", k ? "zero2_consolidated" : "zero1_consolidated", b, bytes);
        free(b);
    }
}

/* PowerSGD after compressed steps through a one-rank Reducer; returns the saved state. */
static void *powersgd_blob(size_t *bytes)
{
    ddp_store_t *store;
    ddp_group_t *group;
    OK(ddp_store_hash_create(&store));
    OK(ddp_group_create(store, 0, 1, NULL, &group));
    static float w[64], b[8], w2[24];
    ddp_param_t params[3] = {{.name = "w", .data = w, .numel = 64, .dtype = DDP_F32, .rows = 8},
                             {.name = "b", .data = b, .numel = 8, .dtype = DDP_F32},
                             {.name = "w2", .data = w2, .numel = 24, .dtype = DDP_F32, .rows = 4}};
    ddp_powersgd_config_t c = fuzz_powersgd_config();
    ddp_powersgd_state_t *st;
    OK(ddp_powersgd_state_create(&c, &st));
    ddp_reducer_config_t rc = DDP_REDUCER_CONFIG_INIT;
    rc.comm_hook = ddp_powersgd_hook;
    rc.comm_hook_state = st;
    rc.first_bucket_bytes = 128; /* several buckets */
    ddp_reducer_t *r;
    OK(ddp_reducer_create(group, params, 3, NULL, 0, &rc, &r));
    for (int step = 0; step < 4; step++) {
        OK(ddp_reducer_prepare(r));
        for (int i = 2; i >= 0; i--) {
            float *g;
            OK(ddp_reducer_grad(r, (size_t)i, (void **)&g));
            for (size_t e = 0; e < params[i].numel; e++)
                g[e] = (float)((e * 7 + (size_t)step * 3 + (size_t)i) % 11) - 5.0f;
            OK(ddp_reducer_grad_ready(r, (size_t)i));
        }
        OK(ddp_reducer_finalize(r));
    }
    OK(ddp_powersgd_state_size(st, bytes));
    void *blob = malloc(*bytes);
    OK(ddp_powersgd_state_save(st, blob, *bytes));
    ddp_reducer_destroy(r);
    ddp_powersgd_state_destroy(st);
    ddp_group_destroy(group);
    ddp_store_destroy(store);
    return blob;
}

static void powersgd_seeds(void)
{
    size_t bytes;
    void *blob = powersgd_blob(&bytes);
    write_seed("powersgd_state", "after_4_steps", blob, bytes);
    free(blob);
    ddp_powersgd_config_t c = fuzz_powersgd_config();
    ddp_powersgd_state_t *st;
    OK(ddp_powersgd_state_create(&c, &st));
    OK(ddp_powersgd_state_size(st, &bytes));
    blob = malloc(bytes);
    OK(ddp_powersgd_state_save(st, blob, bytes));
    write_seed("powersgd_state", "fresh", blob, bytes);
    free(blob);
    ddp_powersgd_state_destroy(st);
}

/* ---- the trainers' checkpoints ---------------------------------------------------------------- */
static void fm_seeds(void)
{
    char dir[] = "/tmp/make_seeds_fm.XXXXXX";
    if (!mkdtemp(dir)) die("mkdtemp");
    char path[256];
    snprintf(path, sizeof path, "%s/ck", dir);
    fm_mlp_t model;
    if (fm_mlp_create(FUZZ_FM_HIDDEN, 1, 1, &model)) die("fm model");
    for (int which = 0; which < FUZZ_FM_CONFIGS; which++) {
        fm_hyper_t h = fuzz_fm_hyper(which);
        fm_progress_t pr = {.epoch = 1, .step_in_epoch = 3, .global_step = 11, .loss_sum = 4.5,
                            .loss_count = 3, .last_epoch_loss = 1.25};
        fm_optim_t opt = {.kind = which == 1 ? FM_OPTIM_ADAM : FM_OPTIM_SGD};
        if (fm_optim_create(&opt, model.numel)) die("fm optim");
        for (int k = 0; k < FM_NPARAMS; k++)
            for (size_t e = 0; e < model.numel[k]; e++) opt.state1[k][e] = 0.01f * (float)e;
        opt.steps = 11;
        fm_extra_t extra = {0}, *ex = NULL;
        void *states[2] = {NULL, NULL};
        size_t state_bytes[2] = {0, 0};
        ddp_optim_t *lib = NULL;
        if (which == 2) {
            /* libddp's AdamW over the model, and two ranks' PowerSGD states. */
            ddp_param_t params[FM_NPARAMS];
            for (int k = 0; k < FM_NPARAMS; k++)
                params[k] = (ddp_param_t){.name = fm_param_names[k], .data = model.params[k],
                                          .numel = model.numel[k], .dtype = DDP_F32};
            ddp_optim_config_t c = DDP_OPTIM_CONFIG_INIT;
            c.kind = DDP_OPTIM_ADAMW;
            OK(ddp_optim_create(params, FM_NPARAMS, &c, &lib));
            extra.optim_state = save_optim(lib, &extra.optim_state_bytes);
            states[0] = powersgd_blob(&state_bytes[0]);
            states[1] = powersgd_blob(&state_bytes[1]);
            extra.hook_ranks = 2;
            extra.hook_state = states;
            extra.hook_state_bytes = state_bytes;
            ex = &extra;
        }
        char err[1024];
        if (fm_checkpoint_save(path, &h, &pr, &model, &opt, ex, err, sizeof err)) die(err);
        FILE *f = fopen(path, "rb");
        static uint8_t buf[1 << 20];
        size_t n = fread(buf, 1, sizeof buf, f);
        fclose(f);
        static const char *const names[FUZZ_FM_CONFIGS] = {"sgd", "adam", "adamw_powersgd"};
        write_seed("fm_checkpoint", names[which], buf, n);
        fm_optim_destroy(&opt);
        if (lib) {
            free(extra.optim_state);
            free(states[0]);
            free(states[1]);
            ddp_optim_destroy(lib);
        }
    }
    fm_mlp_destroy(&model);
    unlink(path);
    rmdir(dir);
}

static void gpt_seeds(void)
{
    char dir[] = "/tmp/make_seeds_gpt.XXXXXX";
    if (!mkdtemp(dir)) die("mkdtemp");
    char path[256], err[1024];
    snprintf(path, sizeof path, "%s/ck", dir);
    gpt_config_t c = fuzz_gpt_config();
    gpt_t m;
    if (gpt_create(&c, 1, 1, &m, err, sizeof err)) die(err);
    ddp_param_t *params = calloc(m.ntensors, sizeof *params);
    uint32_t *groups = calloc(m.ntensors, sizeof *groups);
    ddp_optim_t *o;
    OK(fuzz_gpt_optim(&m, params, groups, &o));
    float *g = calloc(m.nparams, sizeof *g);
    void **grads = calloc(m.ntensors, sizeof *grads);
    for (size_t i = 0; i < m.nparams; i++) g[i] = 0.001f * (float)(i % 13);
    for (size_t i = 0; i < m.ntensors; i++) grads[i] = g + m.tensors[i].offset;
    OK(ddp_optim_step(o, grads));
    size_t bytes;
    void *state = save_optim(o, &bytes);
    gpt_ckpt_header_t h = fuzz_gpt_header(m.nparams);
    h.steps_done = 1;
    h.state_bytes = bytes;
    if (gpt_checkpoint_write(path, &h, m.params, state, err, sizeof err)) die(err);
    FILE *f = fopen(path, "rb");
    static uint8_t buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    write_seed("gpt_checkpoint", "adamw_step1", buf, n);
    unlink(path);
    rmdir(dir);
    free(state);
    free(g);
    free(grads);
    free(params);
    free(groups);
    ddp_optim_destroy(o);
    gpt_destroy(&m);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: make_seeds OUT_DIR [C10D_PORT]\n");
        return 2;
    }
    out_dir = argv[1];
    mkdir(out_dir, 0755);
    store_seeds();
    if (argc > 2) c10d_seeds(atoi(argv[2]));
    hello_seeds();
    shm_seeds();
    env_seeds();
    optim_seeds();
    powersgd_seeds();
    fm_seeds();
    gpt_seeds();
    return 0;
}
