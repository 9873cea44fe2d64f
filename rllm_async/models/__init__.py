"""Small models built locally, for tests and benchmarks that may not download weights."""
