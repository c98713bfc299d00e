"""The `fedpriv` command line: its parser, its commands and `python -m experiments.cli`."""
