"""``python -m engine.cli`` runs the ``engine`` command (same as the console script)."""

from engine.cli import main

main(prog_name="engine")
