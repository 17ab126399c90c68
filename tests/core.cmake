ddp_add_test(NAME test_core SOURCES test_core.c)
