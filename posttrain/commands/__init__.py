"""`posttrain` sub-commands beyond the trainers: eval, config, data, plot.

Each module adds its own parser (`add_parser(sub)`) and holds its command's logic, so `posttrain/cli.py` stays
a short list of commands. This package sits at the CLI's level: it may import any layer below.
"""
