/* The front doors of the network stores: ddp_store_connect asks the server at host:port which
 * protocol it speaks (ddp__store_probe, c10d_wire.c) and opens a libddp client (tcp_client.c) or a
 * c10d one (c10d_client.c); ddp_store_c10d_connect insists on c10d. It sits above both clients,
 * which never call it. */
#include <stdint.h>

#include "store/c10d.h"
#include "store/store_impl.h"

static ddp_status_t check_connect_args(const char *fn, const char *host, int port, int *timeout_ms,
                                       ddp_store_t **out)
{
    if (!host || !*host)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: host is %s", fn, host ? "empty" : "NULL");
    if (port <= 0 || port > 65535)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: port %d is not in 1..65535", fn, port);
    if (*timeout_ms < 0)
        return ddp__error(DDP_ERR_INVALID_ARGUMENT,
                          "%s: timeout_ms must be >= 0 (0: DDP_TIMEOUT), got %d", fn, *timeout_ms);
    if (!out) return ddp__error(DDP_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
    if (*timeout_ms == 0) {
        ddp_status_t s = ddp__env_seconds_ms("DDP_TIMEOUT", timeout_ms);
        if (s != DDP_OK) return ddp__error_context(s, "%s: timeout_ms 0 asks for DDP_TIMEOUT", fn);
    }
    return DDP_OK;
}

ddp_status_t ddp_store_c10d_connect(const char *host, int port, int timeout_ms, ddp_store_t **out)
{
    static const char fn[] = "ddp_store_c10d_connect";
    ddp__clear_error();
    ddp_status_t s = check_connect_args(fn, host, port, &timeout_ms, out);
    if (s != DDP_OK) return s;
    ddp__store_kind_t kind;
    s = ddp__store_probe(host, port, ddp__deadline_precise_ns(timeout_ms), &kind);
    if (s != DDP_OK) return ddp__error_context(s, "%s", fn);
    if (kind == DDP__STORE_KIND_LIBDDP)
        return ddp__error(DDP_ERR_PROTOCOL,
                          "%s: the server at %s:%d is a libddp store, not a c10d TCPStore: "
                          "connect with ddp_store_tcp_connect (or ddp_store_connect)",
                          fn, host, port);
    return ddp__store_c10d_open(host, port, timeout_ms, kind, out);
}

ddp_status_t ddp_store_connect(const char *host, int port, const char *token, int timeout_ms,
                               ddp_store_t **out)
{
    static const char fn[] = "ddp_store_connect";
    ddp__clear_error();
    ddp_status_t s = check_connect_args(fn, host, port, &timeout_ms, out);
    if (s != DDP_OK) return s;
    int64_t deadline = ddp__deadline_precise_ns(timeout_ms);
    ddp__store_kind_t kind;
    s = ddp__store_probe(host, port, deadline, &kind);
    if (s != DDP_OK) return ddp__error_context(s, "%s", fn);
    if (kind != DDP__STORE_KIND_LIBDDP) {
        /* c10d has no authentication: a token given for it protects nothing, say so in the log
         * rather than fail a torchrun job that exported one for other reasons. */
        if (token && *token)
            DDP_LOG(DDP_LOG_INFO, "store %s:%d is a c10d TCPStore: the token is not used", host,
                    port);
        DDP_LOG(DDP_LOG_INFO, "store %s:%d speaks c10d's TCPStore protocol (torch %s)", host,
                port, kind == DDP__STORE_KIND_C10D_V2 ? "2.x" : "1.x");
        return ddp__store_c10d_open(host, port, timeout_ms, kind, out);
    }
    int left = ddp__ms_left(deadline, 1000000000);
    return ddp_store_tcp_connect(host, port, token, left > 0 ? left : 1, out);
}
