/* tcp-stream: raw TCP throughput between two endpoints, the anchor against which the TCP
 * transport's bus bandwidth is judged (bench/compare_tcp.sh runs both between the same two
 * network namespaces in one run). One connection, 1 MiB writes, like the transport's frames.
 *
 *   tcp-stream server [--bind ADDR] [--port P] [--bidir] [--buffer BYTES]
 *   tcp-stream client --connect ADDR [--port P] [--seconds S] [--bidir] [--buffer BYTES]
 *
 * Unidirectional: the client sends for S seconds, the server only reads. Bidirectional: both
 * send and read at once (what each rank of a 2-rank ring does). The client prints the
 * throughput of what it sent, per direction, in GB/s (10^9 bytes per second). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define WRITE_BYTES (1 << 20)

/* Bytes of the memory region sends read from and receives write to, cycling (--buffer): 1 MiB
 * stays in cache; a region as large as the collective's buffers makes the kernel's copies go to
 * memory, as they do for the transport. */
static size_t region_bytes = WRITE_BYTES;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die(const char *what)
{
    fprintf(stderr, "tcp-stream: %s: %s\n", what, strerror(errno));
    exit(1);
}

/* Sends (until `until`, then shuts the write side) and/or reads until EOF, with poll.
 * Returns bytes sent; *received gets bytes read. */
static double send_end;
static char *out_region, *in_region;

/* Allocated and touched before any timing starts. */
static void make_regions(void)
{
    out_region = malloc(region_bytes);
    in_region = malloc(region_bytes);
    if (!out_region || !in_region) die("malloc");
    memset(out_region, 0x5a, region_bytes);
    memset(in_region, 0, region_bytes);
}

static long long pump(int fd, int do_send, double until, long long *received)
{
    char *out = out_region, *in = in_region;
    size_t out_at = 0, in_at = 0;
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK);
    long long sent = 0, got = 0;
    int sending = do_send, reading = 1;
    while (sending || reading) {
        /* Stop at the end of the period, or (server side) when the peer has stopped. */
        if (sending && (now_s() >= until || !reading)) {
            send_end = now_s();
            shutdown(fd, SHUT_WR);
            sending = 0;
        }
        struct pollfd p = {fd, (short)((reading ? POLLIN : 0) | (sending ? POLLOUT : 0)), 0};
        if (poll(&p, 1, 100) < 0 && errno != EINTR) die("poll");
        if (sending && (p.revents & POLLOUT)) {
            ssize_t n = send(fd, out + out_at, WRITE_BYTES, MSG_NOSIGNAL);
            if (n > 0) {
                sent += n;
                out_at = (out_at + (size_t)n) % (region_bytes - WRITE_BYTES + 1);
            }
            else if (n < 0 && errno != EAGAIN && errno != EINTR) die("send");
        }
        if (reading && (p.revents & (POLLIN | POLLHUP | POLLERR))) {
            for (;;) {
                ssize_t n = recv(fd, in + in_at, WRITE_BYTES, 0);
                if (n > 0) {
                    got += n;
                    in_at = (in_at + (size_t)n) % (region_bytes - WRITE_BYTES + 1);
                    continue;
                }
                if (n == 0) reading = 0;
                else if (errno != EAGAIN && errno != EINTR) die("recv");
                break;
            }
        }
    }
    *received = got;
    return sent;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: tcp-stream server [--bind A] [--port P] [--bidir] [--buffer B]\n"
                        "       tcp-stream client --connect A [--port P] [--seconds S] [--bidir] "
                        "[--buffer B]\n");
        return 2;
    }
    int server = strcmp(argv[1], "server") == 0;
    const char *addr = server ? "0.0.0.0" : NULL;
    int port = 29600, bidir = 0;
    double seconds = 3.0;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--bind") && i + 1 < argc) addr = argv[++i];
        else if (!strcmp(argv[i], "--connect") && i + 1 < argc) addr = argv[++i];
        else if (!strcmp(argv[i], "--port") && i + 1 < argc) port = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--seconds") && i + 1 < argc) seconds = atof(argv[++i]);
        else if (!strcmp(argv[i], "--bidir")) bidir = 1;
        else if (!strcmp(argv[i], "--buffer") && i + 1 < argc) {
            region_bytes = (size_t)strtoull(argv[++i], NULL, 10);
            if (region_bytes < WRITE_BYTES) region_bytes = WRITE_BYTES;
        }
        else {
            fprintf(stderr, "tcp-stream: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (!addr) {
        fprintf(stderr, "tcp-stream: client needs --connect ADDR\n");
        return 2;
    }
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((unsigned short)port);
    if (inet_pton(AF_INET, addr, &sa.sin_addr) != 1) {
        fprintf(stderr, "tcp-stream: %s is not an IPv4 address\n", addr);
        return 2;
    }
    int one = 1;
    make_regions();
    if (server) {
        int ls = socket(AF_INET, SOCK_STREAM, 0);
        if (ls < 0) die("socket");
        setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(ls, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(ls, 4) != 0) die("bind");
        int fd = accept(ls, NULL, NULL);
        if (fd < 0) die("accept");
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        long long got = 0;
        /* bidir: the server sends as long as the client does (until the client's EOF) */
        pump(fd, bidir, bidir ? now_s() + 3600.0 : 0, &got);
        close(fd);
        close(ls);
        return 0;
    }
    int fd = -1;
    for (int attempt = 0; attempt < 100; attempt++) {
        fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0) die("socket");
        if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0) break;
        close(fd);
        fd = -1;
        usleep(50000);
    }
    if (fd < 0) die("connect");
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    double t0 = now_s();
    long long got = 0;
    long long sent = pump(fd, 1, t0 + seconds, &got);
    double t = send_end - t0;
    printf("tcp-stream %s: sent %.3f GB in %.2f s: %.3f GB/s per direction\n",
           bidir ? "bidirectional" : "unidirectional", (double)sent / 1e9, t,
           (double)sent / 1e9 / t);
    close(fd);
    return 0;
}
