"""The diff: which entries meet, the per-pair rule, thresholds and the verdict, cubes and rankings."""
