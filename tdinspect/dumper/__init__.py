"""Capture: module-level hooks and op-level dispatch mode (torch and the standard library only)."""
