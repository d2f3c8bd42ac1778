"""``python -m hf_tta.cli``: the ``hf-tta`` command."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
