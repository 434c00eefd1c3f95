"""What a restrict policy costs per training step.

One compiled training step (lookup of a Zipf batch, loss, Adam update of the
touched rows) is timed on a Variable without a policy and on one with a
FrequencyRestrictPolicy (its per-step work: counting the step's keys) or a
TimestampRestrictPolicy, each trained by the fused step (one native apply
op writes rows, slots and the policy's state), and the frequency policy once
more on the optimizer's Python path (tfde.step_kernels.enabled = False when
its step is traced: where every policy trained before the fused step covered
them).  The variants alternate over rounds; each figure is the median over
rounds of steps/s (and of this process's CPU time per step).  Target: a frequency policy costs at most 15% per step.
With --backend redis the Variables are Redis tables (one RedisTableCreator
under a fresh tag on --port, 2 buckets; its keys are deleted afterwards).

  python -m benchmarks.policy_bench [--dim 64] [--batch 4096] [--steps 100] [--rounds 7]
                                    [--backend cuckoo|redis] [--port 6379]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--backend", choices=["cuckoo", "redis"], default="cuckoo")
    p.add_argument("--port", type=int, default=6379, help="redis-server for --backend redis")
    args = p.parse_args(argv)

    import tensorflow as tf

    import tfde
    from benchmarks.table_bench import machine

    rng = np.random.default_rng(0)
    batches = [tf.constant(np.minimum(rng.zipf(1.2, args.batch), args.vocab), tf.int64) for _ in range(args.steps)]
    from tfde import step_kernels

    variants = {
        "no policy": None,
        "frequency": tfde.FrequencyRestrictPolicy,
        "timestamp": tfde.TimestampRestrictPolicy,
        "frequency, Python path": tfde.FrequencyRestrictPolicy,
    }
    creator, tag = None, f"tfde-policy-bench-{uuid.uuid4().hex[:8]}"
    if args.backend == "redis":
        creator = tfde.RedisTableCreator(
            {"redis_host_port": args.port, "model_tag_runtime": tag, "storage_slice": 2, "keys_sending_size": 1024}
        )
    try:
        rate = _measure(args, tfde, step_kernels, variants, batches, creator)
    finally:
        if creator is not None:
            import redis

            client = redis.Redis(port=args.port)
            stale = [k for pattern in (f"{tag}:*", f"tfde-*{tag}:*") for k in client.scan_iter(match=pattern)]
            if stale:
                client.delete(*stale)

    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores; TF {info['tf']}, tfde git {info['git']}")
    print(
        f"training step on {args.backend}: Zipf batch of {args.batch} ids over {args.vocab:,}, dim {args.dim}, "
        f"Adam; median of {args.rounds} alternating rounds of {args.steps} steps"
    )
    base = rate["no policy"][0]
    print(f"\n{'variant':<24}{'steps/s':>10}{'cost per step':>16}{'process CPU ms/step':>22}")
    for name, (r, ms) in rate.items():
        print(f"{name:<24}{r:>10.1f}{(base / r - 1):>15.1%}{ms:>22.2f}")
    out = HERE / "results" / f"policy-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": info,
                **vars(args),
                "steps_per_s": {name: r for name, (r, _) in rate.items()},
                "process_cpu_ms_per_step": {name: ms for name, (_, ms) in rate.items()},
            },
            indent=1,
        )
    )
    print(f"\nwritten: {out.relative_to(HERE.parent)}")
    return 0


def _measure(args, tfde, step_kernels, variants, batches, creator) -> dict:
    """{variant: (steps/s, CPU ms per step of this process: the training
    side, without redis-server's)}, medians over alternating rounds."""
    import tensorflow as tf

    steps = {}
    for name, policy in variants.items():
        var = tfde.Variable(f"bench-{name}", dim=args.dim, restrict_policy=policy, table_creator=creator)
        opt = tfde.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.01))

        @tf.function
        def step(ids, var=var, opt=opt):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tfde.embedding_lookup(var, ids, training=True) ** 2)
            opt.apply_gradients(zip(tape.gradient(loss, [var.step_buffer]), [var.step_buffer]))

        step_kernels.enabled = "Python path" not in name  # read when the step is traced
        for b in batches:  # warm-up: trace, and fill the table
            step(b)
        step_kernels.enabled = True
        steps[name] = step

    times = {name: [] for name in variants}
    cpu = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, step in steps.items():
            t, c = time.perf_counter(), time.process_time()
            for b in batches:
                step(b)
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    return {
        name: (args.steps / statistics.median(times[name]), 1e3 * statistics.median(cpu[name]) / args.steps)
        for name in variants
    }


if __name__ == "__main__":
    sys.exit(main())
