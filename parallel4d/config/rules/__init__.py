"""Each technique's rules in one torch-free place: one module per technique, every rule a function
that returns its messages (None or [] when it holds); ``config`` collects them, the strategies raise."""
