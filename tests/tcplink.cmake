# The TCP transport's receive low-water mark (SO_RCVLOWAT while a payload is awaited): exact
# results for frames shorter and longer than the mark, and every socket back at the default mark
# after each collective (tests/test_tcp_lowat.c).
foreach(world 1 2 3 4)
  ddp_add_test(NAME test_tcp_lowat SOURCES test_tcp_lowat.c ARGS ${world} TIMEOUT 120)
endforeach()
