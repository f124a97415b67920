"""One run, from its config to its metrics: build, train its stages in the one loop, checkpoint, evaluate."""
