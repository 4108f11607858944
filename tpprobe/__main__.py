"""`python -m tpprobe`: the command line, as the `tpprobe` script runs it."""
from .cli import main

main()
