"""The on-disk format: pass files, sidecars, run folders, and the readers that check them."""
