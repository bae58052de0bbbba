"""`python -m common.export.check_child EXPORT_DIR`: load an export where only TensorFlow can be imported (not tf_keras,
tensorflow_hub, Keras 3 or JAX), and print each signature's max abs difference from the probabilities recorded at
export time, its saved graph's op dtype census, and the accelerator settings it ran with (JSON; exit 1 if over
tolerance or a float16 signature is not float16)."""

import json
import os
import sys

from common.core.children import BLOCKED_IN_CHECK, CPU_ONLY_ENV

for _blocked in BLOCKED_IN_CHECK:  # set before tensorflow is imported: any import of them now fails
    sys.modules[_blocked] = None

from common.core.errors import run_entry  # noqa: E402
from common.export.verify import check_export  # noqa: E402


def main(folder: str) -> int:
    diffs, census = check_export(folder)
    print(
        json.dumps(
            {"max_abs_diff": diffs, "census": census, "environment": {k: os.environ.get(k) for k in CPU_ONLY_ENV}}
        )
    )
    return 0


if __name__ == "__main__":
    run_entry("check", main, sys.argv[1])
