"""``python -m edgefl``: the command line (what ``edgefl fleet`` starts its device processes with)."""

from edgefl.cli import main

main()
