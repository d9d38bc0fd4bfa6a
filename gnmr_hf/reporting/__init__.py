"""Tables and plots of runs: the paper's Table 7 layout, loss curves, GNMR heat maps."""
