"""Protocol v3's runs, moved to :mod:`hf_tta.benchmarks.protocols.v3` (issue 46); this file keeps the
archived v3 card's commands (``python recipes/protocol_v3.py ...``) working: the same as ``python -m
hf_tta.benchmarks.protocols.v3 ...``."""

from hf_tta.benchmarks.protocols.v3 import main

if __name__ == "__main__":
    main()
