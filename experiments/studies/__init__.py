"""One-off studies: scripts that measured something once, kept beside the records they wrote
(`experiments/results/`) so the figures in docs/notes/ can be reproduced. Not commands: run them from the repository
root as the docstring of each says."""
