"""The docs and the repository's shape: README, the docs site, RESULTS, the layers."""
