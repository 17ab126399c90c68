# build/tcp-stream: raw TCP throughput between two endpoints, the anchor of bench/compare_tcp.sh
# (the TCP transport's bus bandwidth between two network namespaces against plain sockets).
add_executable(tcp-stream ${PROJECT_SOURCE_DIR}/bench/tcp_stream.c)
