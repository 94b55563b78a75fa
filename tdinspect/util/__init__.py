"""Small helpers with no knowledge of dumps: terminal text, regular files, progress, GC, the worker pool."""
