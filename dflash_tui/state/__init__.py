"""What the dashboard shows, as plain data (no Textual): ``dashboard.DashboardState`` folds events
into facts, ``views`` computes what the panels read off them, ``rows`` holds the records the
panels draw; ``set_evals`` the prompt sets' evaluations, ``hours`` the header's device time."""
