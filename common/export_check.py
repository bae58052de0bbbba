"""`python -m common.export_check EXPORT_DIR`: load an export where tf_keras and tensorflow_hub cannot be imported,
and print each signature's max abs difference from the probabilities recorded at export time (JSON; exit 1 if over
tolerance)."""

import json
import sys

for _blocked in ("tf_keras", "tensorflow_hub"):  # set before tensorflow is imported: any import of them now fails
    sys.modules[_blocked] = None

from common.export import check_export  # noqa: E402

if __name__ == "__main__":
    print(json.dumps(check_export(sys.argv[1])))
