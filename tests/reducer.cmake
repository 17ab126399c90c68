# Reducer tests: bucket assignment (no group), the Reducer over real rank processes, legacy mode.
ddp_add_test(NAME test_bucket_assignment SOURCES test_bucket_assignment.c TIMEOUT 60)
