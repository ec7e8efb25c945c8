"""Tables (rich) and plots (matplotlib, imported only when a plot is asked for)."""
