"""Small models, a hand-written port and the bundled sample dumps, for the demo, notebooks and tests."""
