"""`kvfs bench`: benchmarks that print ratios measured in one run, with their conditions."""
