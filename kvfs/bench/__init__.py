"""`kvfs bench`: benchmarks that print ratios measured in one run, with their conditions.

Imports: the format, the client, the daemon (the mount options, the stats the figures
read), the models and the integrations; only the command line imports the benchmarks.
"""
