"""The embedded example model used by ``engine demo`` and the examples."""
