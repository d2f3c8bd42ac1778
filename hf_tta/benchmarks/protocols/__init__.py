"""The benchmark protocols' runs and tables (v3, v4): importable, no sys.path edits."""
