"""A user's Flower app on cancelfl's library API (client.api.attach, strategies.NadpStrategy)."""
