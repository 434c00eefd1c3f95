"""Distributed training glue.  The exchange itself (tfde/exchange.py) is part
of the core and is used automatically under a tf.distribute strategy; this
package adds what needs an optional engine:

  tfde.distributed.horovod   Horovod (all-to-all exchange), imported on demand
  tfde.distributed.launch    start N local workers (TF_CONFIG or horovodrun)
"""
