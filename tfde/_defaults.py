"""tfde's tunables, in one place, with their units.  Modules import them
from here; none defines its own copy."""

# Rows per chunk when tfde walks a whole table: export, restriction's
# scoring and removal, the change log, checkpoint streams.  A chunk of
# 65,536 rows of dim 64 float32 is 16 MiB.
CHUNK_ROWS = 1 << 16

# Widest row a table holds, in values (the native kernels size their
# buffers from it).
MAX_DIM = 1 << 16

# Redis: attempts after the first failure of a call, and the wait before
# each (seconds, doubling from the base up to the maximum).  The native
# client uses the same figures (backends/redis/resp_client.h:
# kBackoffBaseMs, kBackoffMaxMs), which the Redis tests check.
REDIS_RETRIES = 4
REDIS_BACKOFF_BASE_S = 0.05
REDIS_BACKOFF_MAX_S = 1.0
