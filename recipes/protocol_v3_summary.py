"""Protocol v3's choices and tables, moved to :mod:`hf_tta.benchmarks.protocols.v3_summary` (issue 46); this file keeps the
archived v3 card's commands (``python recipes/protocol_v3_summary.py ...``) working: the same as ``python -m
hf_tta.benchmarks.protocols.v3_summary ...``."""

from hf_tta.benchmarks.protocols.v3_summary import main

if __name__ == "__main__":
    main()
