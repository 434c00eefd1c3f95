"""Distributed training beside the core.  The core (Variable, lookups, the
optimizer wrapper, restriction, saving) talks only to the Exchange
interface of tfde/exchange.py; the engines plug in from here:

  tfde.distributed.tf_distribute  tf.distribute (MultiWorkerMirroredStrategy):
                                  registered on import, used automatically
  tfde.distributed.horovod        Horovod: tfde_hvd.init() instead of hvd.init()
  tfde.distributed.alltoall       the all-to-all routing Horovod uses
  tfde.distributed.keys           string keys on number-only collectives
  tfde.distributed.fit_logs       tf-keras fit's logs of local steps (semi-synchronous training)
  tfde.distributed.launch         start N local workers (TF_CONFIG or horovodrun)

Importing this package registers tf.distribute and the Horovod guard (which
notices a Horovod job without tfde's exchange); `import tfde` does.
Horovod itself is imported only by tfde.distributed.horovod.init().
"""

from tfde.distributed import horovod, tf_distribute  # noqa: F401  (register their engines)
