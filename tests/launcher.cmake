# The launcher: ddp_env_read (test_env) and ddprun end to end (test_launcher, which starts the real
# build/ddprun binary and uses itself as the worker program).
ddp_add_test(NAME test_env SOURCES test_env.c TIMEOUT 30)
