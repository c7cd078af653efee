"""``python -m pipeplan``: the command line (:mod:`pipeplan.cli`)."""

from pipeplan.cli import main

main()
