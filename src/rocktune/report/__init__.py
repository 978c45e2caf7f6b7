"""See what you train: the data preview before a run, plots and an HTML report after it."""
