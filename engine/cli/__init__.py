"""The ``engine`` command line (docs/cli.md).

``main`` parses and reports errors (one line, exit codes 0/1/2); ``args`` reads ``--symbol`` and
``--input`` values; ``loading`` checks paths, devices and input files against the bundle before
anything runs; ``progress`` draws bars on terminals only; ``render`` formats tables and JSON from one
results dict per command; ``commands/<name>.py`` holds one subcommand each.
"""
