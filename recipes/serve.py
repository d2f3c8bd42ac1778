"""A reference retrieval service that adapts while it serves: ``hf-tta serve`` (:mod:`hf_tta.cli.serve`), the same
options from a script. See ``model_cards/serving.md``.

    python recipes/serve.py --state-dir /tmp/hf_tta_serve --port 8000
"""

from __future__ import annotations

import sys

from hf_tta.cli.serve import DEFAULT_TTA, build_config, emoji_encoders, emoji_model, main, parser  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
