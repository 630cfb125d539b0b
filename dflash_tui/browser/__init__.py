"""`dflash-tui serve`: the attached dashboard in a browser. ``server`` runs textual-serve, one
attached dashboard process per browser connection; ``lifeline`` ends such a process when its
session or its server goes away."""
