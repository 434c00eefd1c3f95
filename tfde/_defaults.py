"""tfde's tunables, in one place, with their units.  Modules import them
from here; none defines its own copy."""

# Rows per chunk when tfde walks a whole table: export, restriction's
# scoring and removal, the change log, checkpoint streams.  A chunk of
# 65,536 rows of dim 64 float32 is 16 MiB.
CHUNK_ROWS = 1 << 16

# Widest row a table holds, in values (the native kernels size their
# buffers from it).
MAX_DIM = 1 << 16

# Redis: how long a failing call keeps being retried, in total backoff
# waited (milliseconds; the config's redis_retry_deadline_ms), and the wait
# before each retry (seconds, doubling from the base up to the maximum).
# The default rides out a Sentinel failover with Sentinel's defaults
# (down-after-milliseconds 30 s, then an election of a few seconds) and a
# Cluster failover (cluster-node-timeout 15 s).  The native client uses the
# same figures (backends/redis/resp_client.h: kBackoffBaseMs,
# kBackoffMaxMs), which the Redis tests check.
REDIS_RETRY_DEADLINE_MS = 60_000
REDIS_BACKOFF_BASE_S = 0.05
REDIS_BACKOFF_MAX_S = 1.0
