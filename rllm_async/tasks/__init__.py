"""Built-in tasks: seeded problem generators and their reward functions."""
