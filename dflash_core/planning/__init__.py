"""What is decided before weights load: preflight checks, the memory plan and its report, the card budget, the layout advice."""
