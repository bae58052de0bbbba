"""`python -m common.launch.probe_child [ADDRESS]`: does a TPU answer this interpreter's TensorFlow? Run in a child
interpreter by common/launch/negotiation.py, with a time limit, once per candidate TPU stack: the environment it is
given (PJRT variables or none) is set before TensorFlow is imported, as the kernel's own interpreter will have it.

The steps are the training kernel's (common/core/strategy.py): import TensorFlow, connect to the TPU, initialise it,
list its logical devices, then one tiny computation on the first of them. Its last line of output is the verdict:
    TPU_PROBE {"devices": 8, "value": 2097152.0, "tensorflow": "2.19.1", "seconds": 41.2}
Anything else (an exception, a signal, no answer before the limit) is a failure, whose last line says why.
"""

import json
import os
import sys
import time

from common.core.errors import run_entry

VERDICT = "TPU_PROBE "
MATMUL_SIDE = 128  # ones([128, 128]) @ ones([128, 128]) sums to 128 ** 3


def main(address: str) -> int:
    start = time.monotonic()
    import tensorflow as tf

    print(f"TPU_PROBE_IMPORTED tensorflow {tf.__version__}", flush=True)  # what "streamexecutor: *" looks for
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address or None)
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    devices = tf.config.list_logical_devices("TPU")
    if not devices:
        print("the TPU system initialised but TensorFlow lists no TPU device", file=sys.stderr)
        return 1
    with tf.device(devices[0].name):
        ones = tf.ones([MATMUL_SIDE, MATMUL_SIDE])
        value = float(tf.reduce_sum(tf.matmul(ones, ones)))
    if value != MATMUL_SIDE**3:
        print(f"the TPU computed {value} for a sum that is {MATMUL_SIDE**3}", file=sys.stderr)
        return 1
    print(
        VERDICT
        + json.dumps(
            {
                "devices": len(devices),
                "value": value,
                "tensorflow": tf.__version__,
                "seconds": round(time.monotonic() - start, 1),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    run_entry("probe", main, sys.argv[1] if len(sys.argv) > 1 else "local")
